"""Adaptive gradient partitioning: cut the dense gradients' all-reduce to fit the network's gaps.

During an MoE layer's pipelined backward the network is idle while the first chunk's
gradients are computed and whenever compute outlasts a transfer. The dense parameters'
gradients (attention, norms: everything outside the experts) must be all-reduced too; sent
as DDP's fixed 25 MiB buckets they either wait for the end of backward or push in front of
the all-to-alls and delay them. Sized by the cost model instead, each piece fills one gap:
n = (gap - alpha) / beta bytes of a fitted all-reduce t = alpha + beta * n, and only what no
gap can hold is left exposed after backward.

    gaps = model.backward_timeline(shape, plan.degrees, plan.hierarchical).idle_network()
    part = partition_gradients(dense_bytes, [end - begin for begin, end in gaps], profile.fit("all_reduce", "world"))
    part.pieces, part.gaps, part.exposed_s

The plan assumes the gradients a piece carries are ready when its gap opens, which holds for
those of the layers after the MoE layer (their backward ran first). Issuing the pieces (in
order, through sparta.comm's priority queue) is the trainer's part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sparta.errors import ConfigError
from sparta.scheduling.profiler import LinearFit

DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class GradientPartition:
    """pieces: bytes of each all-reduce piece, in issue order; gaps: the index of the gap
    each piece travels in, or -1 for the remainder sent after backward; exposed_s: predicted
    seconds of all-reduce left after backward (the remainder's)."""

    pieces: tuple[int, ...]
    gaps: tuple[int, ...]
    exposed_s: float


def partition_gradients(
    total_bytes: int,
    gaps_s: Sequence[float],
    all_reduce: LinearFit,
    min_bytes: int = 64 * 1024,
    element_bytes: int = 1,
) -> GradientPartition:
    """Fill each gap (seconds, in time order) with the largest all-reduce piece that fits,
    never smaller than `min_bytes` (below that the latency alpha dominates), until
    `total_bytes` are placed; the rest is one piece after backward. Pieces are whole
    multiples of `element_bytes` (4 for float32 gradients) so none splits an element."""
    if total_bytes < 0 or min_bytes < 1 or element_bytes < 1 or total_bytes % element_bytes:
        raise ConfigError(
            f"partition_gradients: total_bytes = {total_bytes}, min_bytes = {min_bytes}, element_bytes = "
            f"{element_bytes}; use >= 0, >= 1, >= 1, with total_bytes a multiple of element_bytes"
        )
    if any(g < 0 for g in gaps_s):
        raise ConfigError(f"partition_gradients: gaps_s = {list(gaps_s)}; gaps last >= 0 seconds")
    left, pieces, where = total_bytes, [], []
    for i, gap in enumerate(gaps_s):
        if left == 0:
            break
        if all_reduce.beta == 0:  # a flat fit (LinearFit.fit clamps a negative slope): any size or none
            fits = left if gap >= all_reduce.alpha else 0
        else:
            fits = int((gap - all_reduce.alpha) / all_reduce.beta)
        n = min(left, fits) // element_bytes * element_bytes
        if n >= min(min_bytes, left) and n > 0:
            pieces.append(n)
            where.append(i)
            left -= n
    if left:
        pieces.append(left)
        where.append(-1)
    return GradientPartition(tuple(pieces), tuple(where), all_reduce(left) if left else 0.0)


def bucketed_exposed_s(total_bytes: int, all_reduce: LinearFit, bucket_bytes: int = DDP_BUCKET_BYTES) -> float:
    """Predicted seconds of fixed-size buckets sent after backward (DDP's buckets when the
    all-to-alls hold the network throughout backward): the baseline partitioning beats."""
    if bucket_bytes < 1:
        raise ConfigError(f"bucketed_exposed_s: bucket_bytes = {bucket_bytes}; use >= 1")
    full, rest = divmod(total_bytes, bucket_bytes)
    return full * all_reduce(bucket_bytes) + (all_reduce(rest) if rest else 0.0)
