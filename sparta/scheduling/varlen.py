"""Variable-length samples into micro-batches (DynaPipe), against padding and packing.

A global batch of samples of different lengths reaches the trainer as micro-batches, each a
rectangle ``[rows, length]``. Three ways to cut it:

- ``pad_batches``: the trainer's way today: the samples in their order, ``microbatches``
  equal groups, every one padded to ``pad_to`` (the run's ``seq_len``). Short samples pay
  for the longest one.
- ``pack_batches``: samples concatenated into rows of ``row_length`` (first-fit decreasing),
  ``max_tokens // row_length`` rows a micro-batch. Little padding, but every row pays
  attention over its full length, and under a plain causal mask a sample attends to the
  ones packed before it (Megatron's default) unless the attention takes a document mask.
- ``dynamic_batches``: DynaPipe's dynamic programme. Samples sorted by length are cut into
  contiguous groups, each padded to its longest sample, so that the predicted step is
  smallest: over a pipeline of ``stages`` ranks a schedule (GPipe, 1F1B) takes about
  ``(sum(c) + (stages - 1) * max(c)) / stages`` for micro-batches of cost ``c`` (the fill and
  drain wait for the slowest one), so the programme minimises the sum under each candidate
  bound on the largest cost and keeps the best. Each group holds at most ``max_tokens``
  (padded) tokens: the activation memory a micro-batch may take.

Costs come from `LengthCost`: seconds of one micro-batch's forward and backward through the
whole model by its shape, ``alpha + per_token * rows * length + per_token_len * rows *
length**2`` (attention's scores grow with the square of the length), fitted to measured
shapes (`LengthCost.fit`), counted from the model's FLOPs (`LengthCost.of_flops`), or read
off the planner's measured parts (`sparta.planner.length_cost`, linear only: parts are
measured at ``seq_len``).

``collate(samples, mb)`` makes a micro-batch's ids and targets: padding on the right with
targets of -100, which the trainer's loss skips, so with causal attention every real token's
loss and gradient are those of the sample alone, whatever it is grouped with.

For the trainer's pipeline, ``bucketed_steps``: torch's pipeline schedules run micro-batches
of one shape per step, and a stage keeps the shapes of its first step, so the trainer takes a
few padded lengths (``ParallelConfig.lengths``, a schedule each). The same programme then cuts
the sorted samples into steps, each padded to a bucket and dealt into the schedule's
micro-batches of a power-of-two number of rows: a few shapes per bucket. Each step is one
`ParallelModel.step` call and one optimizer step, a batch by token budget (fairseq's
``max_tokens``): `ParallelModel.step` scales the gradients it leaves, so it does not add
several calls into one update.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sparta.errors import InputError

IGNORE_INDEX = -100  # targets of padding positions: the losses skip them (torch's default)

# bounds tried on the largest micro-batch's cost (quantiles of the feasible groups' costs)
BOUND_CANDIDATES = 64


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: ``samples`` (indices into the batch's samples, in row order),
    ``rows`` x ``length`` tokens as laid out (padded or packed)."""

    samples: tuple[int, ...]
    rows: int
    length: int

    @property
    def tokens(self) -> int:
        """Tokens of the rectangle, padding included."""
        return self.rows * self.length


@dataclass(frozen=True)
class LengthCost:
    """Seconds of one micro-batch's forward + backward by its shape [rows, length]:
    ``alpha + per_token * rows * length + per_token_len * rows * length**2``."""

    alpha: float
    per_token: float
    per_token_len: float = 0.0

    def __post_init__(self) -> None:
        for name in ("alpha", "per_token", "per_token_len"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise InputError(f"LengthCost.{name}={value!r} must be a finite number >= 0 (seconds)")

    def __call__(self, rows: int, length: int) -> float:
        tokens = rows * length
        return self.alpha + self.per_token * tokens + self.per_token_len * tokens * length

    @classmethod
    def fit(cls, shapes: Sequence[tuple[int, int]], seconds: Sequence[float]) -> LengthCost:
        """Least squares over measured (rows, length) -> seconds; a negative coefficient is
        dropped and the rest refitted (a cost never falls as a shape grows). Shapes of one
        length alone cannot tell the quadratic term from the linear one: then it is 0."""
        if len(shapes) != len(seconds) or len({r * n for r, n in shapes}) < 3:
            raise InputError(
                f"LengthCost.fit needs one time per shape and three or more token counts, got {len(shapes)} "
                f"shapes {list(shapes)} and {len(seconds)} times"
            )
        columns = [
            [1.0] * len(shapes),
            [float(r * n) for r, n in shapes],
            [float(r * n * n) for r, n in shapes],
        ]
        keep = [0, 1, 2] if len({n for _, n in shapes}) > 1 else [0, 1]
        t = torch.tensor([float(s) for s in seconds], dtype=torch.float64)
        while True:
            a = torch.tensor([columns[k] for k in keep], dtype=torch.float64).T
            # scaled columns: tokens**2 is ~1e8 times tokens, which least squares must not feel
            scale = a.abs().amax(dim=0)
            x = torch.linalg.lstsq(a / scale, t.unsqueeze(1)).solution.squeeze(1) / scale
            if (x >= 0).all() or len(keep) == 1:
                break
            keep = [k for k, v in zip(keep, x.tolist(), strict=True) if v >= 0] or [1]
        coef = [0.0, 0.0, 0.0]
        for k, v in zip(keep, x.tolist(), strict=True):
            coef[k] = max(0.0, v)
        return cls(*coef)

    @classmethod
    def of_flops(cls, params_per_token: int, n_layers: int, d_model: int, flops_per_s: float = 1e12) -> LengthCost:
        """Forward + backward counted in FLOPs at ``flops_per_s``: 6 per parameter a token
        passes through, and attention's scores and weighted sum, ``12 * d_model * length``
        per token and layer (forward 4, backward twice that). No constant: for comparing
        shapes by their work where nothing was timed."""
        if not flops_per_s > 0:
            raise InputError(f"flops_per_s={flops_per_s} must be > 0")
        return cls(0.0, 6 * params_per_token / flops_per_s, 12 * n_layers * d_model / flops_per_s)


def pipeline_seconds(batches: Sequence[MicroBatch], cost: LengthCost, stages: int = 1) -> float:
    """Predicted step of these micro-batches through ``stages`` balanced pipeline stages
    (GPipe / 1F1B): ``(sum + (stages - 1) * max) / stages`` of their costs; on one stage, the sum."""
    if stages < 1:
        raise InputError(f"stages={stages} must be >= 1")
    if not batches:
        return 0.0
    c = [cost(mb.rows, mb.length) for mb in batches]
    return (sum(c) + (stages - 1) * max(c)) / stages


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    if not lengths:
        raise InputError("no samples: lengths is empty")
    bad = [(i, n) for i, n in enumerate(lengths) if not isinstance(n, int) or isinstance(n, bool) or n < 1]
    if bad:
        raise InputError(f"sample lengths must be integers >= 1; (index, length) {bad[:5]} are not")
    return list(lengths)


def pad_batches(lengths: Sequence[int], microbatches: int, pad_to: int | None = None) -> list[MicroBatch]:
    """The samples in order, cut into ``microbatches`` groups (sizes differ by at most one),
    each padded to ``pad_to`` (default: the batch's longest sample)."""
    lengths = _check_lengths(lengths)
    if not 1 <= microbatches <= len(lengths):
        raise InputError(f"microbatches={microbatches} must be between 1 and the {len(lengths)} samples")
    longest = max(lengths)
    pad_to = longest if pad_to is None else pad_to
    if pad_to < longest:
        raise InputError(f"pad_to={pad_to} is shorter than the longest sample ({longest}); raise it or cut samples")
    groups = torch.tensor_split(torch.arange(len(lengths)), microbatches)
    return [MicroBatch(tuple(g.tolist()), len(g), pad_to) for g in groups]


def pack_batches(lengths: Sequence[int], row_length: int, max_tokens: int) -> list[MicroBatch]:
    """Samples packed into rows of ``row_length`` (first-fit decreasing), ``max_tokens //
    row_length`` rows per micro-batch; ``samples`` lists them row after row."""
    lengths = _check_lengths(lengths)
    if max(lengths) > row_length:
        raise InputError(f"a sample of {max(lengths)} tokens does not fit a packed row of {row_length}")
    per_batch = max_tokens // row_length
    if per_batch < 1:
        raise InputError(f"max_tokens={max_tokens} holds no row of {row_length} tokens; raise it")
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
        if slot is None:
            rows.append([])
            free.append(row_length)
            slot = len(rows) - 1
        rows[slot].append(i)
        free[slot] -= lengths[i]
    return [
        MicroBatch(tuple(i for row in rows[s : s + per_batch] for i in row), len(rows[s : s + per_batch]), row_length)
        for s in range(0, len(rows), per_batch)
    ]


def dynamic_batches(lengths: Sequence[int], cost: LengthCost, max_tokens: int, stages: int = 1) -> list[MicroBatch]:
    """DynaPipe's grouping: the samples sorted by length, cut into contiguous groups padded
    to their longest sample, each at most ``max_tokens`` tokens, minimising
    `pipeline_seconds` over ``stages``. Groups come shortest first. With one stage the
    programme is exact; with several, the bound on the largest group's cost is tried at
    ``BOUND_CANDIDATES`` quantiles, not at every cost, so the grouping may miss the optimum
    by a little (a review's 300 random cases of 20-60 samples: 19 worse, by 0.58 % at most)."""
    lengths = _check_lengths(lengths)
    if stages < 1:
        raise InputError(f"stages={stages} must be >= 1")
    if max(lengths) > max_tokens:
        raise InputError(
            f"a sample of {max(lengths)} tokens exceeds max_tokens={max_tokens} (one micro-batch's memory); "
            "raise max_tokens or cut the sample"
        )
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    sorted_len = [lengths[i] for i in order]
    n = len(order)
    # group (i, j] of sorted samples: feasible while (j - i) * sorted_len[j - 1] <= max_tokens
    group_cost: list[list[tuple[int, float]]] = [[] for _ in range(n + 1)]
    for j in range(1, n + 1):
        longest = sorted_len[j - 1]
        for i in range(j - 1, -1, -1):
            if (j - i) * longest > max_tokens:
                break
            group_cost[j].append((i, cost(j - i, longest)))
    if stages == 1:
        bounds = [math.inf]
    else:
        every = sorted({c for row in group_cost for _, c in row})
        floor = max(cost(1, sorted_len[-1]), 0.0)  # the longest sample's group costs at least this
        every = [c for c in every if c >= floor]
        picks = {every[round(k * (len(every) - 1) / (BOUND_CANDIDATES - 1))] for k in range(BOUND_CANDIDATES)}
        bounds = sorted(picks)
    best: tuple[float, list[int]] | None = None
    for bound in bounds:
        total = [0.0] + [math.inf] * n
        cut = [0] * (n + 1)
        for j in range(1, n + 1):
            for i, c in group_cost[j]:
                if c <= bound and total[i] + c < total[j]:
                    total[j], cut[j] = total[i] + c, i
        if math.isinf(total[n]):
            continue
        ends, j = [], n
        while j:
            ends.append(j)
            j = cut[j]
        ends.reverse()
        starts = [0] + ends[:-1]
        largest = max(cost(e - s, sorted_len[e - 1]) for s, e in zip(starts, ends, strict=True))
        step = (total[n] + (stages - 1) * largest) / stages
        if best is None or step < best[0]:
            best = (step, ends)
    assert best is not None  # bounds include every feasible group's cost, so the largest admits all
    ends = best[1]
    starts = [0] + ends[:-1]
    return [MicroBatch(tuple(order[s:e]), e - s, sorted_len[e - 1]) for s, e in zip(starts, ends, strict=True)]


def bucketed_steps(
    lengths: Sequence[int],
    cost: LengthCost,
    buckets: Sequence[int],
    max_tokens: int,
    microbatches: int,
    stages: int = 1,
) -> list[list[MicroBatch]]:
    """The grouping for the trainer's pipeline, whose `ParallelModel.step` runs
    ``microbatches`` micro-batches of one shape and shapes its stages once per batch shape
    (``ParallelConfig.lengths = buckets``). Each returned step is one such call: the samples
    sorted by length are cut into contiguous steps, each padded to the smallest bucket L that
    holds its longest sample and dealt round-robin into ``microbatches`` micro-batches of R
    rows, R the smallest power of two that holds them, at most ``max_tokens // L`` (rows
    past the samples are padding). So a bucket has at most log2(max_tokens / L) + 2 shapes,
    whatever the batches. A dynamic programme over the cuts minimises the predicted time, each
    step costing `pipeline_seconds` of its micro-batches over ``stages``; of cuts predicted
    alike (within 1e-9), the one with fewer steps. A step holds at
    least one sample per micro-batch (a micro-batch of padding alone has no loss). Steps come
    shortest first."""
    lengths = _check_lengths(lengths)
    buckets = sorted(set(buckets))
    if not buckets or buckets[0] < 1:
        raise InputError(f"buckets={list(buckets)} must hold padded lengths >= 1, e.g. [128, 256, 512]")
    if max(lengths) > buckets[-1]:
        raise InputError(f"a sample of {max(lengths)} tokens exceeds the longest bucket ({buckets[-1]}); add one")
    if max_tokens < buckets[-1]:
        raise InputError(f"max_tokens={max_tokens} holds no row of the longest bucket ({buckets[-1]}); raise it")
    if not 1 <= microbatches <= len(lengths):
        raise InputError(f"microbatches={microbatches} must be between 1 and the {len(lengths)} samples")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    padded = [next(b for b in buckets if b >= lengths[i]) for i in order]
    cap = {b: max_tokens // b for b in buckets}

    def rows(size: int, bucket: int) -> int:
        return min(1 << (-(-size // microbatches) - 1).bit_length(), cap[bucket])

    @functools.cache
    def shape_cost(r: int, bucket: int) -> float:
        return pipeline_seconds([MicroBatch((), r, bucket)] * microbatches, cost, stages)

    def step_cost(size: int, bucket: int) -> float:
        return shape_cost(rows(size, bucket), bucket)

    n = len(order)
    total, cut, count = [0.0] + [math.inf] * n, [0] * (n + 1), [0] * (n + 1)
    for j in range(microbatches, n + 1):  # step (i, j]: padded to padded[j - 1]
        bucket = padded[j - 1]
        for i in range(max(0, j - microbatches * cap[bucket]), j - microbatches + 1):
            c = total[i] + step_cost(j - i, bucket)
            # equal times (a cost without a constant, as of_flops's, makes two half steps cost
            # one full one): fewer, fuller steps win, so optimizer steps keep their size
            tie = math.isclose(c, total[j], rel_tol=1e-9)
            if (c < total[j] and not tie) or (tie and count[i] + 1 < count[j]):
                total[j], cut[j], count[j] = c, i, count[i] + 1
    if math.isinf(total[n]):
        raise InputError(
            f"{n} samples do not cut into steps of {microbatches} micro-batches (at least one sample and at most "
            f"max_tokens // length rows each): raise max_tokens={max_tokens}, or pass more samples"
        )
    ends, j = [], n
    while j:
        ends.append(j)
        j = cut[j]
    ends.reverse()
    steps = []
    for start, end in zip([0, *ends[:-1]], ends, strict=True):
        bucket, members = padded[end - 1], order[start:end]
        r = rows(end - start, bucket)
        steps.append([MicroBatch(tuple(members[k::microbatches]), r, bucket) for k in range(microbatches)])
    return steps


def summed_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of logits [rows, length, vocab] against targets [rows, length], summed
    over the real tokens (targets of -100 skipped). Divided by the global batch's real
    tokens and added over micro-batches, it is the per-token mean whatever the grouping."""
    return torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def collate(samples: Sequence[Tensor], mb: MicroBatch, pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """``(ids [rows, length], targets [rows, length])`` of a padded micro-batch (from
    `pad_batches`, `dynamic_batches` or `bucketed_steps`; rows past its samples are padding).
    ``samples[i]`` holds sample i's tokens plus one: the ids are ``s[:-1]``, the targets
    ``s[1:]``; padding is ``pad_id`` with target -100."""
    if mb.rows < len(mb.samples):
        raise InputError(
            f"collate takes padded micro-batches (one sample a row); this one packs {mb.samples} into {mb.rows} rows"
        )
    ids = torch.full((mb.rows, mb.length), pad_id, dtype=torch.long)
    targets = torch.full((mb.rows, mb.length), IGNORE_INDEX, dtype=torch.long)
    for row, i in enumerate(mb.samples):
        s = samples[i]
        n = s.numel() - 1
        if not 1 <= n <= mb.length:
            raise InputError(
                f"sample {i} has {n} tokens (plus its last target); the micro-batch's length is {mb.length}"
            )
        ids[row, :n] = s[:-1]
        targets[row, :n] = s[1:]
    return ids, targets
