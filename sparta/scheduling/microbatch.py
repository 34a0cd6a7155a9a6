"""Micro-batch overlap: a block's dense layers compute while its expert exchange travels.

`pipelined_exchange` overlaps the experts' compute with the exchange, but the layers around
an MoE layer (attention, norms, projections, the router) run whole before the dispatch and
after the combine, and the network idles meanwhile: on the emulated cluster at 300 Mbit/s
that was a seventh of the step (benchmarks/moe_pipeline.py). Cut the block's tokens into
micro-batches, each running the whole block (before -> out -> experts -> back -> after), and
put them through the same pipeline (pipeline.run_pipeline): micro-batch i+1's `before`
computes while micro-batch i's rows travel, and micro-batch i-1's `after` while micro-batch
i's results come back:

    before 0 | before 1 | experts 0 | experts 1 | after 0 | after 1    (this thread)
             | out 0    | out 1     | back 0    | back 1  |            (network)

Backward runs the same pipeline on the gradients: `after`'s backward makes the gradient
rows, the experts' backward runs where they went, `before`'s backward takes what returns.
DeepSeek-V3's DualPipe and SGLang's two-batch overlap pair micro-batches in the same spirit
(there: one micro-batch's attention beside another's all-to-all); here it is one block,
forward and backward, and the cost model predicts it (`CostModel.predict_microbatched`).

Micro-batches are cuts of dim 0 (`torch.tensor_split`), so `before` and `after` must treat
the rows of dim 0 independently (attention over whole sequences is fine when dim 0 is the
batch). Each micro-batch routes its own tokens: its counts travel first, one small
all-to-all of ``[size * slots]`` int64 per micro-batch, over the same exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sparta.comm import Exchange
from sparta.errors import InputError
from sparta.scheduling.pipeline import (
    Compute,
    ParamGrads,
    check_counts,
    exchange_counts,
    grad_or_zeros,
    run_pipeline,
)
from sparta.scheduling.trace import Tracer


@dataclass
class Routed:
    """What `before` returns for one micro-batch.

    rows: [N, d] grouped by destination rank, then by slot (for MoE: sorted by global expert).
    counts: [size * slots] int64, rows per (destination rank, slot); the same slots on every
        rank and micro-batch.
    side: tensors `after` reads besides the returned rows (routing weights, a permutation);
        gradients flow back into `before` through those that require one.
    carry: [S] int64 (the same S on every rank and micro-batch) sent to every rank with the
        counts, and summed over the ranks (`overlapped_block`'s ``carried``): totals such as
        an MoE layer's load, with no collective of their own.
    """

    rows: Tensor
    counts: Tensor
    side: tuple[Tensor, ...] = ()
    carry: Tensor | None = None


Before = Callable[[Tensor], Routed]
"""before(micro-batch [n, ...]) -> Routed: the dense layers and routing ahead of the exchange."""
After = Callable[[Tensor, tuple[Tensor, ...]], Tensor]
"""after(returned rows [N, d_out], side) -> [n', ...]: combine and the dense layers after it."""


@dataclass
class _Micro:
    """One micro-batch's graphs, kept from forward for backward."""

    leaf: Tensor
    routed: Routed
    recv_counts: Tensor
    send: list[int]
    recv: list[int]
    experts: tuple[Tensor, Tensor] | None = None  # (received rows leaf, expert output)
    after: tuple[Tensor, tuple[Tensor, ...], Tensor] | None = None  # (returned leaf, side leaves, y)
    side_grads: list[Tensor] = field(default_factory=list)


@dataclass
class _Plan:
    exchange: Exchange
    microbatches: int
    before: Before
    compute: Compute
    after: After
    tracer: Tracer | None
    carried: list[Tensor] | None


def overlapped_block(
    x: Tensor,
    microbatches: int,
    before: Before,
    compute: Compute,
    after: After,
    exchange: Exchange,
    params: Sequence[Tensor] = (),
    tracer: Tracer | None = None,
    carried: list[Tensor] | None = None,
) -> Tensor:
    """Run a block (before -> expert exchange -> after) over `microbatches` cuts of `x`'s dim
    0, pipelined so that the dense layers of one micro-batch compute while another's rows
    travel; forward and backward.

    x: [n, ...] this rank's input to the block; cut into `microbatches` near-equal parts,
        empty ones where n < microbatches: the exchanges follow the micro-batch count alone,
        never a rank's own row count, so ranks holding other row counts stay paired.
    before: micro-batch -> Routed (rows for the exchange, their counts, side tensors).
    compute: the receiving side, as in `pipelined_exchange` (rows grouped by source rank,
        then slot, and their counts [size, slots]) -> [M, d_out], row-wise.
    after: (the micro-batch's returned rows [N, d_out], its side tensors) -> its output.
    exchange: a Communicator or HierarchicalAllToAll (every rank of it calls this with the
        same `microbatches`).
    params: every tensor the three functions read that needs a gradient (dense and expert
        weights); their gradients are returned through autograd, summed over micro-batches.
    tracer: spans "fwd|bwd before|out|compute|back|after {i}" (trace.py).
    carried: where given, each micro-batch's `Routed.carry` summed over the exchange's ranks
        is appended to it, in micro-batch order (forward only).
    Returns the micro-batches' outputs concatenated along dim 0. Equal to running `before`,
    one exchange, `compute`, the exchange back and `after` on each micro-batch in turn.
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise InputError(f"overlapped_block: microbatches = {microbatches!r}; use an int >= 1")
    if x.dim() == 0:
        raise InputError("overlapped_block: x is a 0-dim tensor; give rows along dim 0")
    plan = _Plan(exchange, microbatches, before, compute, after, tracer, carried)
    return _Overlapped.apply(x, plan, *params)


def _routed_splits(routed: Routed, plan: _Plan, i: int) -> tuple[Tensor, list[int], list[int]]:
    """Check micro-batch i's routing, exchange its counts (and its carry, whose sum goes to
    ``plan.carried``): (recv_counts [size, slots], rows to each rank, rows from each rank)."""
    size = plan.exchange.size
    slots = check_counts(routed.rows, routed.counts, size, f"overlapped_block, micro-batch {i}")
    got, summed = exchange_counts(routed.counts, plan.exchange, routed.carry)
    recv = got.view(size, slots)
    if summed is not None and plan.carried is not None:
        plan.carried.append(summed)
    return recv, routed.counts.view(size, slots).sum(1).tolist(), recv.sum(1).tolist()


class _Overlapped(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, plan: _Plan, *params: Tensor) -> Tensor:
        grad = any(ctx.needs_input_grad)
        pieces = x.tensor_split(plan.microbatches)
        micro: list[_Micro] = []
        outs: list[Tensor | None] = [None] * plan.microbatches

        def produce(i: int) -> tuple[Tensor, list[int], list[int]]:
            leaf = pieces[i].detach().requires_grad_(bool(ctx.needs_input_grad[0]))
            with torch.set_grad_enabled(grad):
                routed = plan.before(leaf)
            recv_counts, send, recv = _routed_splits(routed, plan, i)
            micro.append(_Micro(leaf, routed, recv_counts, send, recv))
            return routed.rows.detach(), send, recv

        def work(i: int, got: Tensor) -> Tensor:
            leaf = got.detach().requires_grad_(grad)
            with torch.set_grad_enabled(grad):
                out = plan.compute(leaf, micro[i].recv_counts)
            micro[i].experts = (leaf, out)
            return out.detach()

        def consume(i: int, back: Tensor) -> None:
            leaf = back.detach().requires_grad_(grad)
            side = tuple(s.detach().requires_grad_(grad and s.requires_grad) for s in micro[i].routed.side)
            with torch.set_grad_enabled(grad):
                y = plan.after(leaf, side)
            micro[i].after = (leaf, side, y)
            outs[i] = y.detach()

        run_pipeline(plan.exchange, plan.microbatches, produce, work, consume, plan.tracer, "fwd", trace_ends=True)
        ys = [y for y in outs if y is not None]
        ctx.plan, ctx.micro, ctx.rows = plan, micro if grad else [], [y.shape[0] for y in ys]
        ctx.save_for_backward(*params)
        return torch.cat(ys)

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        plan: _Plan = ctx.plan
        micro: list[_Micro] = ctx.micro
        params = ctx.saved_tensors
        sums = ParamGrads(params, ctx.needs_input_grad[2:])
        wanted = sums.wanted
        grads_y = grad_y.split(ctx.rows)
        grad_x: list[Tensor] = []

        def differentiate(outputs: list[Tensor], grads: list[Tensor], inputs: list[Tensor]) -> list[Tensor | None]:
            pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
            if not pairs or not inputs:
                return [None] * len(inputs)
            found = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
            return list(found)

        def produce(i: int) -> tuple[Tensor, list[int], list[int]]:
            m = micro[i]
            assert m.after is not None
            leaf, side, y = m.after
            side_in = [s for s in side if s.requires_grad]
            g = differentiate([y], [grads_y[i]], [leaf, *side_in, *wanted])
            m.side_grads = [grad_or_zeros(s, t) for s, t in zip(g[1 : 1 + len(side_in)], side_in, strict=True)]
            sums.add(g[1 + len(side_in) :])
            m.after = None
            return grad_or_zeros(g[0], leaf), m.send, m.recv

        def work(i: int, got: Tensor) -> Tensor:
            assert micro[i].experts is not None
            leaf, out = micro[i].experts
            g = differentiate([out], [got], [leaf, *wanted])
            sums.add(g[1:])
            micro[i].experts = None
            return grad_or_zeros(g[0], leaf)

        def consume(i: int, grad_rows: Tensor) -> None:
            m = micro[i]
            side = [s for s in m.routed.side if s.requires_grad]
            first = [m.leaf] if ctx.needs_input_grad[0] else []
            g = differentiate([m.routed.rows, *side], [grad_rows, *m.side_grads], [*first, *wanted])
            if first:
                grad_x.append(grad_or_zeros(g[0], m.leaf))
            sums.add(g[len(first) :])

        run_pipeline(plan.exchange, plan.microbatches, produce, work, consume, plan.tracer, "bwd", trace_ends=True)
        ctx.micro = []
        return (torch.cat(grad_x) if grad_x else None, None, *sums.result())
