"""How a pipelined exchange is cut: its degrees and taper (`PipelineDegrees`), the chunks'
relative sizes (`chunk_weights`) and their row indices within a buffer (`Chunks`).

The pipeline itself (pipeline.py) and the cost model that predicts it (cost_model.py) share
these, as do the MoE layer's config and the tools that take degrees on a command line
(`DEGREES_HELP`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sparta.errors import ConfigError


@dataclass(frozen=True)
class PipelineDegrees:
    """How many chunks the forward and the backward exchange are cut into (1 = no pipeline),
    and how their sizes taper at the ends.

    With `taper` t > 0 the first and last chunks are 2**-t the size of the middle ones, and
    sizes double from either end up to the middle size (degree 6, taper 2: sizes in
    proportion 1, 2, 4, 4, 2, 1). The first chunk's transfer (before any compute can start)
    and the last chunk's compute and return (after the last transfer in) are the parts of a
    pipeline that nothing overlaps; small end chunks shorten them. 0 cuts equal chunks.
    """

    forward: int = 1
    backward: int = 1
    taper: int = 0

    def __post_init__(self) -> None:
        for name in ("forward", "backward"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"PipelineDegrees.{name} = {value!r}; use an int >= 1 (1 means no pipelining)")
        if not isinstance(self.taper, int) or not 0 <= self.taper <= MAX_TAPER:
            raise ConfigError(
                f"PipelineDegrees.taper = {self.taper!r}; use an int in [0, {MAX_TAPER}] (0: equal chunks)"
            )

    @classmethod
    def of(cls, value: int | Sequence[int]) -> PipelineDegrees:
        """From an int (both passes), a (forward, backward) pair or (forward, backward,
        taper): the forms `MoELayer(pipeline_degree=...)` and `sparta profile` take. Raises
        ConfigError for anything else (see DEGREES_HELP)."""
        parts = list(value) if isinstance(value, (tuple, list)) else [value]
        if not 1 <= len(parts) <= 3 or not all(isinstance(p, int) and not isinstance(p, bool) for p in parts):
            raise ConfigError(f"pipeline degrees {value!r}: use {DEGREES_HELP}")
        return cls(parts[0], parts[1] if len(parts) > 1 else parts[0], parts[2] if len(parts) > 2 else 0)

    @property
    def forward_weights(self) -> tuple[int, ...]:
        """Relative sizes of the forward's chunks (ints, for exact cuts)."""
        return chunk_weights(self.forward, self.taper)

    @property
    def backward_weights(self) -> tuple[int, ...]:
        """Relative sizes of the backward's chunks."""
        return chunk_weights(self.backward, self.taper)


MAX_TAPER = 3
DEGREES_HELP = (
    "an int >= 1 (1 = no pipelining), a (forward, backward) pair of them, optionally with a "
    f"taper in [0, {MAX_TAPER}] as a third"
)


def chunk_weights(degree: int, taper: int) -> tuple[int, ...]:
    """Relative sizes of `degree` chunks whose ends are 2**-taper of the middle ones (see
    PipelineDegrees); all 1 for taper 0."""
    return tuple(min(2**taper, 2 ** min(i, degree - 1 - i)) for i in range(degree))


@dataclass(frozen=True)
class Chunks:
    """Chunks of a buffer grouped into segments of `counts` rows (dim 0), in proportion to
    integer `weights`.

    With W_i the sum of the first i weights and W their total, chunk i takes rows
    [c*W_i//W, c*W_{i+1}//W) of every segment of c rows, so every chunk stays grouped by
    segment. index[i]: its row indices [rows_i] (int64); counts[i]: its rows per segment;
    splits[i]: its rows per rank (segments are `slots` per rank).
    """

    index: tuple[Tensor, ...]
    counts: tuple[Tensor, ...]
    splits: tuple[list[int], ...]

    @classmethod
    def cut(cls, counts: Tensor, weights: Sequence[int], ranks: int) -> Chunks:
        """The chunks of a buffer whose segments hold ``counts`` rows each ([ranks x slots]
        segments, grouped by rank), in proportion to ``weights`` (see the class)."""
        counts = counts.to(torch.int64).cpu()
        starts = torch.cumsum(counts, 0) - counts
        total = sum(weights)
        edges = [sum(weights[:i]) for i in range(len(weights) + 1)]
        index, per_chunk, splits = [], [], []
        for i in range(len(weights)):
            lo = starts + counts * edges[i] // total
            sizes = starts + counts * edges[i + 1] // total - lo
            rows = int(sizes.sum())
            # row k of the chunk is row (k - first row of its segment in the chunk) + lo of the segment
            shift = torch.repeat_interleave(lo - (torch.cumsum(sizes, 0) - sizes), sizes)
            index.append(torch.arange(rows, dtype=torch.int64) + shift)
            per_chunk.append(sizes)
            splits.append(sizes.view(ranks, -1).sum(1).tolist())
        return cls(tuple(index), tuple(per_chunk), tuple(splits))
