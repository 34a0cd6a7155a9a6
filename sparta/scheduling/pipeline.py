"""Chunked expert-parallel exchange: chunk i+1 travels while chunk i is computed.

An expert-parallel layer sends rows to the ranks that own their experts (dispatch), computes
them there, and sends the results back (combine). Done whole, the network idles while the
experts compute and the experts idle while the network moves rows. Cut every expert's rows
into `degree` pieces and the exchange becomes a pipeline:

    dispatch 0 | dispatch 1 | combine 0 + dispatch 2 | combine 1 + ...    (network, async)
               | compute 0  | compute 1              | compute 2  ...     (this thread)

Only dispatch 0 (nothing to compute yet) and the last compute and combine (nothing left to
send) are not overlapped, so the chunks may taper: small at both ends, full size in the
middle (`PipelineDegrees.taper`).

The backward pass runs the same pipeline on the gradients, with its own degree (the best
one differs: backward computes about twice as much per row). When the degrees are equal
the forward's autograd graphs are reused; otherwise each backward chunk recomputes its
forward first (from the saved received rows), which is exact because `compute` is row-wise.

This module knows nothing of MoE: rows arrive grouped by destination rank and, within one,
by a "slot" of that rank (its local experts), and `compute` is any row-wise function. The
collectives are the same in number and order on every rank for a given degree, so every
rank must use the same degrees.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sparta.comm import Exchange
from sparta.comm.handle import Handle
from sparta.errors import InputError
from sparta.scheduling.chunks import Chunks, PipelineDegrees
from sparta.scheduling.trace import ObservedExchange, Tracer

# compute(rows [M, d_in], counts [size, slots] int64) -> [M, d_out]: rows grouped by source
# rank, then slot, `counts[s, j]` of them from source s for slot j; output rows in the same order
Compute = Callable[[Tensor, Tensor], Tensor]


@dataclass
class _Plan:
    """Everything the autograd Function needs besides tensors."""

    exchange: Exchange
    compute: Compute
    degrees: PipelineDegrees
    send_fwd: Chunks  # over my rows: segments are (destination rank, slot)
    recv_fwd: Chunks  # over rows I receive: segments are (source rank, slot)
    send_bwd: Chunks
    recv_bwd: Chunks
    slots: int
    tracer: Tracer | None


def check_counts(rows: Tensor, counts: Tensor, size: int, where: str) -> int:
    """The slots per rank of `counts` ([size * slots] rows per (destination rank, slot));
    raises InputError naming `where` unless they are that shape and sum to `rows`' rows."""
    if counts.dim() != 1 or counts.numel() % size or counts.numel() == 0:
        raise InputError(
            f"{where}: counts has shape {tuple(counts.shape)}; give [size * slots] = "
            f"[{size} * slots] rows per (destination rank, slot)"
        )
    if int(counts.sum()) != rows.shape[0]:
        raise InputError(
            f"{where}: counts sum to {int(counts.sum())} but rows has {rows.shape[0]} rows; counts must sum to "
            "rows.shape[0]"
        )
    return counts.numel() // size


def exchange_counts(counts: Tensor, exchange: Exchange, carry: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Each rank's `counts` [size * slots] to the ranks they name, in one small all-to-all.

    carry: an integer vector (e.g. a layer's load statistics) sent along to every rank of
        the exchange, so that summing it over the ranks costs no collective of its own.
    Returns ([size * slots] int64 on the host, entry s * slots + j the rows source s sends
    this rank for slot j; `carry` summed over the ranks, or None without one).
    """
    size = exchange.size
    slots = counts.numel() // size
    send = counts.to(torch.int64).cpu().view(size, slots)
    if carry is not None:
        send = torch.cat([send, carry.to(torch.int64).cpu().reshape(1, -1).expand(size, -1)], dim=1)
    width = [send.shape[1]] * size
    got = exchange.all_to_all(send.reshape(-1), width, width, check=False)
    assert isinstance(got, Tensor)
    if carry is None:
        return got, None
    table = got.view(size, -1)
    return table[:, :slots].reshape(-1), table[:, slots:].sum(0)


def pipelined_exchange(
    rows: Tensor,
    counts: Tensor,
    compute: Compute,
    exchange: Exchange,
    degrees: PipelineDegrees,
    params: Sequence[Tensor] = (),
    recv_counts: Tensor | None = None,
    tracer: Tracer | None = None,
) -> Tensor:
    """Send `rows` to their ranks, `compute` them there, bring the results back; pipelined.

    rows: [N, d_in], grouped by destination rank and within one by slot (for MoE: sorted by
        global expert, rank r owning experts [r*L, (r+1)*L)).
    counts: [size * slots] int64, rows per (destination rank, slot), on any device.
    compute: row-wise function of (received rows [M, d_in], their counts [size, slots]) ->
        [M, d_out], rows grouped by source rank then slot (see `Compute`).
    exchange: a Communicator or HierarchicalAllToAll of `size` ranks.
    params: tensors `compute` reads that need gradients (e.g. expert weights); their
        gradients are returned through autograd like any input's.
    recv_counts: [size * slots], rows each source sends me per slot, if already known;
        otherwise exchanged here (one small all-to-all).
    tracer: records each chunk's transfers and compute, forward and backward (trace.py).
    Returns [N, d_out] in the order of `rows`; differentiable in `rows` and `params`.
    """
    size = exchange.size
    slots = check_counts(rows, counts, size, "pipelined_exchange")
    if recv_counts is None:
        recv_counts, _ = exchange_counts(counts, exchange)
    plan = _Plan(
        exchange,
        compute,
        degrees,
        Chunks.cut(counts, degrees.forward_weights, size),
        Chunks.cut(recv_counts, degrees.forward_weights, size),
        Chunks.cut(counts, degrees.backward_weights, size),
        Chunks.cut(recv_counts, degrees.backward_weights, size),
        slots,
        tracer,
    )
    return _Pipelined.apply(rows, plan, *params)


def _gather(x: Tensor, index: Tensor) -> Tensor:
    return x.index_select(0, index.to(x.device))


def run_pipeline(
    exchange: Exchange,
    degree: int,
    produce: Callable[[int], tuple[Tensor, list[int], list[int]]],
    work: Callable[[int, Tensor], Tensor],
    consume: Callable[[int, Tensor], None],
    tracer: Tracer | None,
    label: str,
    trace_ends: bool = False,
) -> None:
    """The pipeline every pass runs. `produce(i)` gives chunk i's rows and their splits (rows
    to each rank, rows from each rank); they go out, `work(i, received)` runs there, and the
    result comes back into `consume(i, returned)`. Issue order on every rank: out 0, out 1,
    back 0, out 2, back 1, ... so chunk i+1 travels during work i and back i during work
    i+1. On this thread: produce i+1 runs while out i travels (before waiting for it), and
    consume i-1 once back i is issued, so sender-side compute (a micro-batch's dense layers,
    microbatch.py) overlaps the transfers too.
    `tracer` gets spans "{label} out|compute|back {i}" on tracks "send", "compute", "return"
    (and, with `trace_ends`, "{label} before|after {i}" on "compute" for produce and
    consume). An ObservedExchange (trace.py) hears of each transfer just after it is issued
    (`issued(name)`: the gradient partitioner sends its pieces into the gaps that follow, see
    grad_sync.py); one with a tracer (a TracedExchange) records the transfers under those
    names on its own tracks, and its tracer gets the compute spans."""
    clock = time.perf_counter
    observed = exchange if isinstance(exchange, ObservedExchange) else None
    own = observed.tracer if observed is not None else None
    tracer = tracer if tracer is not None else own
    comm_spans = tracer is not None and own is None
    back_splits: list[tuple[list[int], list[int]]] = []

    def start(x: Tensor, splits: list[int], back: list[int], name: str) -> tuple[Handle[Tensor], float]:
        if tracer is not None:
            tracer.context = name
        handle = exchange.all_to_all(x.contiguous(), splits, back, async_op=True, check=False)
        assert isinstance(handle, Handle)
        if tracer is not None:
            tracer.context = ""
        if observed is not None:
            observed.issued(name)
        return handle, clock()

    def span(name: str, begin: float, i: int, rows: int) -> None:
        if tracer is not None:
            tracer.record(name, "compute", begin, clock(), chunk=i, rows=rows)

    def made(i: int) -> tuple[Tensor, list[int], list[int]]:
        begin = clock()
        rows, splits, back = produce(i)
        if trace_ends:
            span(f"{label} before {i}", begin, i, int(rows.shape[0]))
        back_splits.append((back, splits))
        return rows, splits, back

    def returned(i: int, handle: Handle[Tensor], issued: float) -> None:
        back = handle.wait()
        if comm_spans:
            tracer.record(f"{label} back {i}", "return", issued, clock(), chunk=i, rows=int(back.shape[0]))
        begin = clock()
        consume(i, back)
        if trace_ends:
            span(f"{label} after {i}", begin, i, int(back.shape[0]))

    outbound = [start(*made(0), f"{label} out 0")]
    inbound: list[tuple[Handle[Tensor], float]] = []
    for i in range(degree):
        nxt = made(i + 1) if i + 1 < degree else None
        handle, issued = outbound[i]
        got = handle.wait()
        if comm_spans:
            tracer.record(f"{label} out {i}", "send", issued, clock(), chunk=i, rows=int(got.shape[0]))
        if nxt is not None:
            outbound.append(start(*nxt, f"{label} out {i + 1}"))
        begin = clock()
        done = work(i, got)
        span(f"{label} compute {i}", begin, i, int(got.shape[0]))
        inbound.append(start(done, *back_splits[i], f"{label} back {i}"))
        if i >= 1:
            returned(i - 1, *inbound[i - 1])
    returned(degree - 1, *inbound[degree - 1])


def _exchange_rows(
    exchange: Exchange,
    source: Tensor,
    send: Chunks,
    recv: Chunks,
    work: Callable[[int, Tensor], Tensor],
    tracer: Tracer | None,
    label: str,
) -> Tensor:
    """`run_pipeline` over chunks of one buffer: chunk i is `source`'s rows `send.index[i]`, and
    what comes back lands in the same rows of the result."""
    result: list[Tensor] = []

    def produce(i: int) -> tuple[Tensor, list[int], list[int]]:
        return _gather(source, send.index[i]), send.splits[i], recv.splits[i]

    def consume(i: int, back: Tensor) -> None:
        if not result:
            result.append(back.new_empty((source.shape[0], *back.shape[1:])))
        result[0].index_copy_(0, send.index[i].to(back.device), back)

    run_pipeline(exchange, len(send.index), produce, work, consume, tracer, label)
    return result[0]


def grad_or_zeros(grad: Tensor | None, like: Tensor) -> Tensor:
    """An input's gradient as autograd.grad gave it, or zeros where the input was unused."""
    return torch.zeros_like(like) if grad is None else grad


class ParamGrads:
    """The gradients a pass's chunks give the parameters that need one (`needs`, from
    ctx.needs_input_grad), summed: `wanted` are those parameters, `add` takes one chunk's
    gradients for them (None where a chunk does not reach one), `result()` one entry per
    parameter for an autograd Function's return (zeros where no chunk reached it)."""

    def __init__(self, params: Sequence[Tensor], needs: Sequence[bool]) -> None:
        self._params, self._needs = list(params), list(needs)
        self.wanted = [p for p, need in zip(self._params, self._needs, strict=True) if need]
        self._sums: list[Tensor | None] = [None] * len(self.wanted)

    def add(self, grads: Sequence[Tensor | None]) -> None:
        """Add one chunk's gradients, one per parameter (None where the chunk gave none)."""
        for k, g in enumerate(grads):
            if g is not None:
                total = self._sums[k]
                self._sums[k] = g if total is None else total + g

    def result(self) -> list[Tensor | None]:
        """The summed gradient of each parameter, None where it needs none."""
        found = iter(self._sums)
        out: list[Tensor | None] = []
        for p, need in zip(self._params, self._needs, strict=True):
            g = next(found) if need else None
            out.append(torch.zeros_like(p) if need and g is None else g)
        return out


class _Pipelined(torch.autograd.Function):
    """The chunked exchange. With equal degrees each chunk's graph (received rows -> computed
    rows) is built in forward and kept as saved tensors, so autograd frees it after a
    backward that does not retain the graph and keeps it for one that does
    (``backward(retain_graph=True)`` twice works); with different degrees the backward
    recomputes each of its chunks from the saved received rows."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, plan: _Plan, *params: Tensor) -> Tensor:
        ctx.plan = plan
        keep_graphs = any(ctx.needs_input_grad) and plan.degrees.forward == plan.degrees.backward
        recompute = any(ctx.needs_input_grad) and not keep_graphs
        leaves: list[Tensor] = []
        outs: list[Tensor] = []
        received: list[Tensor] = []

        def work(i: int, got: Tensor) -> Tensor:
            counts = plan.recv_fwd.counts[i].view(-1, plan.slots)
            if not keep_graphs:
                if recompute:
                    received.append(got)
                return plan.compute(got, counts).detach()
            leaf = got.detach().requires_grad_()
            with torch.enable_grad():
                out = plan.compute(leaf, counts)
            leaves.append(leaf)
            outs.append(out)
            return out.detach()

        y = _exchange_rows(plan.exchange, rows, plan.send_fwd, plan.recv_fwd, work, plan.tracer, "fwd")
        ctx.num_params, ctx.recompute = len(params), recompute
        if recompute:
            # all received rows in one buffer, grouped by (source, slot), for the backward's chunks
            full = rows.new_empty((sum(r.shape[0] for r in received), *rows.shape[1:]))
            for i, got in enumerate(received):
                full.index_copy_(0, plan.recv_fwd.index[i].to(got.device), got)
            ctx.save_for_backward(*params, full)
        else:
            ctx.save_for_backward(*params, *leaves, *outs)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        plan: _Plan = ctx.plan
        saved = ctx.saved_tensors
        params, rest = saved[: ctx.num_params], saved[ctx.num_params :]
        full = rest[0] if ctx.recompute else None
        chunks = len(rest) // 2
        sums = ParamGrads(params, ctx.needs_input_grad[2:])

        def work(i: int, got: Tensor) -> Tensor:
            if full is None:
                leaf, out = rest[i], rest[chunks + i]
            else:
                leaf = _gather(full, plan.recv_bwd.index[i]).requires_grad_()
                with torch.enable_grad():
                    out = plan.compute(leaf, plan.recv_bwd.counts[i].view(-1, plan.slots))
            # retain_graph: a graph kept as saved tensors lives as long as autograd keeps them.
            grads = torch.autograd.grad(out, [leaf, *sums.wanted], got, allow_unused=True, retain_graph=full is None)
            sums.add(grads[1:])
            return grad_or_zeros(grads[0], leaf)

        grad_rows = _exchange_rows(plan.exchange, grad, plan.send_bwd, plan.recv_bwd, work, plan.tracer, "bwd")
        return (grad_rows if ctx.needs_input_grad[0] else None, None, *sums.result())
