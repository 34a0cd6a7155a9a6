"""Expert parallelism: send each expert's rows to the rank that holds it, and back.

Rank ``r`` of an ``ep_size`` communicator holds global experts ``[r * L, (r + 1) * L)``
with ``L = num_experts / ep_size``. Dispatch leaves the rows sorted by global expert, hence
already grouped by destination rank: ``send_splits[r]`` is the sum of the counts of rank
``r``'s experts. This is the only place sparta.moe calls ``sparta.comm``, and only for a
layer with ``ep_size > 1``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext, suppress
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from sparta.comm import all_to_all
from sparta.comm.dtypes import dtype_code, dtype_name
from sparta.errors import InputError, SpartaError
from sparta.moe.expert_loop import (
    LoopGrads,
    LoopWeights,
    block_segments,
    consecutive_segments,
    loop_backward,
    loop_forward,
)
from sparta.moe.experts import GroupedExperts
from sparta.scheduling.pipeline import Exchange, PipelineDegrees, pipelined_exchange

if TYPE_CHECKING:
    from sparta.comm import Communicator


def rank_splits(counts: Tensor, ep_size: int) -> list[int]:
    """Rows per destination rank, given ``counts`` ``[ep_size * L]`` rows per global expert."""
    return counts.view(ep_size, -1).sum(dim=1).tolist()


def exchange_counts(
    counts: Tensor,
    comm: Communicator,
    layer: str,
    rows_like: Tensor | None = None,
    failed: bool = False,
    stats: Tensor | None = None,
    check: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Send ``counts`` ``[E]`` (rows per global expert) to the ranks holding those experts;
    returns ``recv_counts`` ``[ep_size * L]``, entry ``s * L + j`` being the rows source rank
    ``s`` sends to local expert ``j``, and the sum over ranks of ``stats``.

    Each message also carries a flag and the dtype and width of the rows to come. A rank that
    rejected its input (``failed=True``) still takes part, so that every rank raises
    ``InputError`` here instead of waiting forever for it in the next collective; rows that
    differ in dtype or width between ranks raise here too. Every rank then knows the row
    exchanges agree, and they skip the communicator's own input check.

    ``stats`` ``[S]`` int64 (the same ``S`` on every rank) rides along to every rank, so that
    counts summed over the group (the layer's ``last_stats``) cost no collective of their own:
    on a busy CPU each small collective costs milliseconds of wake-up latency.

    ``check=False`` skips the communicator's check that every rank sends the same layout
    (``E``, ``S``): a layer checks its first exchange and trusts the later ones, whose layout
    its configuration fixes. Every rank must pass the same ``check``.
    """
    ep_size = comm.size
    local = counts.numel() // ep_size
    meta = [int(failed), 0, 0] if rows_like is None else [int(failed), dtype_code(rows_like.dtype), rows_like.shape[1]]
    extra = counts.new_tensor(meta) if stats is None else torch.cat([counts.new_tensor(meta), stats])
    width = local + extra.numel()
    send = torch.cat([counts.view(ep_size, local), extra.expand(ep_size, -1)], dim=1)
    splits = [width] * ep_size
    recv = comm.all_to_all(send.reshape(-1), splits, splits, check=check).view(ep_size, width)
    failed_ranks = recv[:, local].nonzero().flatten().tolist()
    if failed_ranks:
        raise InputError(
            f"MoE layer {layer!r}: expert-parallel rank(s) {failed_ranks} of {comm.where} rejected "
            "their input (their own error says why); this rank stops with them instead of hanging"
        )
    kinds = {(dtype_name(int(code)), int(width)) for code, width in recv[:, local + 1 : local + 3].tolist()}
    if len(kinds) > 1:
        raise InputError(
            f"MoE layer {layer!r}: the ranks of {comm.where} send rows of different (dtype, width): "
            f"{sorted(kinds)}; run the layer in the same dtype on every rank"
        )
    summed = None if stats is None else recv[:, local + 3 :].sum(dim=0)
    return recv[:, :local].reshape(-1), summed


T = TypeVar("T")


def fail_together(
    step: Callable[[], T],
    num_experts: int,
    stats_len: int,
    comm: Communicator | None,
    layer: str,
    device: torch.device,
    check: bool = True,
) -> T:
    """Run ``step``, a local stage before the layer's first collective (input checks,
    routing). If it raises a ``SpartaError`` on one rank, that rank still joins the counts
    exchange (with ``stats_len`` zero stats, the length the other ranks send, and their
    ``check``), flagged, so that every rank of ``comm`` raises instead of hanging."""
    try:
        return step()
    except SpartaError:
        if comm is not None:
            # The flag we sent comes back as an InputError; this rank raises its own error.
            with suppress(InputError):
                # Counts live on the input's device, and engines pick the transport by device.
                zeros = torch.zeros(num_experts + stats_len, dtype=torch.int64, device=device)
                exchange_counts(zeros[:num_experts], comm, layer, failed=True, stats=zeros[num_experts:], check=check)
        raise


def expert_parallel_mlp(
    rows: Tensor,
    counts: Tensor,
    recv_counts: Tensor,
    experts: GroupedExperts,
    comm: Communicator,
    degrees: PipelineDegrees | None = None,
    exchange: Exchange | None = None,
) -> Tensor:
    """Run ``rows`` ``[N, d]`` (grouped by global expert, ``counts`` ``[E]`` int64) through
    the experts of every rank; returns ``[N, d]`` in the same order. ``recv_counts`` is what
    ``exchange_counts`` returned for these ``counts``. Differentiable: the backward sends the
    gradients back along the reverse all-to-all.

    ``degrees`` cuts the row exchanges into chunks so that chunk ``i + 1`` travels while
    chunk ``i`` is computed (forward and backward separately, ``sparta.scheduling``);
    ``exchange`` moves the rows instead of ``comm`` (a ``HierarchicalAllToAll`` over the
    same ranks). Collectives, identical in order on every rank: the rows and the outputs
    (one all-to-all each, or one per chunk).
    """
    ep_size, local = comm.size, experts.num_experts

    def compute(received: Tensor, chunk_counts: Tensor) -> Tensor:
        # Received rows come grouped by (source rank, local expert): the experts run each
        # source's block where it lies, with no copy into expert order and back.
        return experts.forward_blocks(received, chunk_counts.reshape(ep_size, local))

    if degrees is not None and (degrees.forward > 1 or degrees.backward > 1):
        params = [p for _, p in experts.named_weights()]
        return pipelined_exchange(rows, counts, compute, exchange or comm, degrees, params, recv_counts)
    send_splits = rank_splits(counts, ep_size)
    recv_splits = rank_splits(recv_counts, ep_size)
    # exchange_counts proved the splits, dtypes and widths consistent: no second check.
    if not experts.uses_grouped_mm(rows):
        blocks = recv_counts.view(ep_size, local).tolist()
        route = _Route(exchange or comm, comm.rank, send_splits, recv_splits, blocks)
        w = experts.loop_weights()
        return _LocalFirst.apply(rows, route, w.activation, *w.tensors())
    received = all_to_all(rows, send_splits, recv_splits, exchange or comm, check=False)
    out = compute(received, recv_counts)
    return all_to_all(out, recv_splits, send_splits, exchange or comm, check=False)


class _Route:
    """Where an expert-parallel step's rows go: this rank's own block and the others'."""

    def __init__(self, exchange: Exchange, me: int, send: list[int], recv: list[int], blocks: list[list[int]]) -> None:
        self.exchange, self.send, self.recv = exchange, send, recv
        self.own_sent = slice(sum(send[:me]), sum(send[: me + 1]))
        self.own_received = slice(sum(recv[:me]), sum(recv[: me + 1]))
        self.own_segments = consecutive_segments(blocks[me])
        self.other_segments = block_segments(blocks, skip=me)


def _compute_span(exchange: Exchange, name: str) -> AbstractContextManager[None]:
    """A span on the "compute" track when the exchange records into a Tracer
    (sparta.scheduling.trace.TracedExchange, as `sparta profile` passes): the unpipelined
    step then shows its compute beside its transfers, as the pipelined one does."""
    tracer = getattr(exchange, "tracer", None)
    return tracer.span(name, "compute") if tracer is not None else nullcontext()


class _LocalFirst(torch.autograd.Function):
    """All-to-all, experts, all-to-all back, with this rank's own rows computed while the
    other ranks' rows travel, and their gradients while the other ranks' gradients travel:
    the rows a rank sends itself need no network, so they need not wait for it. Same
    collectives, in the same order, as the plain exchange; the own block still goes through
    the all-to-all (a local copy), because the engines take one contiguous buffer.
    """

    @staticmethod
    def forward(ctx: Any, rows: Tensor, route: _Route, activation: str, *params: Tensor | None) -> Tensor:
        weights = LoopWeights(activation, *params)
        in_flight = route.exchange.all_to_all(rows, route.send, route.recv, async_op=True, check=False)
        out = rows.new_empty(sum(route.recv), weights.w2.shape[2])
        own = rows[route.own_sent]
        with _compute_span(route.exchange, "fwd compute own"):
            own_pre = loop_forward(own, route.own_segments, weights, out[route.own_received])
        received = in_flight.wait()
        with _compute_span(route.exchange, "fwd compute others"):
            other_pre = loop_forward(received, route.other_segments, weights, out)
        # Intermediates, not inputs or outputs: kept on ctx so that backward can drop them.
        ctx.pre, ctx.route, ctx.activation = (own_pre, other_pre), route, activation
        ctx.save_for_backward(rows, received, *params)
        return route.exchange.all_to_all(out, route.recv, route.send, check=False)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        rows, received, *params = ctx.saved_tensors
        route: _Route = ctx.route
        weights = LoopWeights(ctx.activation, *params)
        (own_pre, other_pre), ctx.pre = ctx.pre, None
        grad = grad.contiguous()
        in_flight = route.exchange.all_to_all(grad, route.send, route.recv, async_op=True, check=False)
        grads = LoopGrads(weights)
        grad_received = received.new_empty(received.shape)
        own, own_grad = rows[route.own_sent], grad[route.own_sent]
        with _compute_span(route.exchange, "bwd compute own"):
            own_out = grad_received[route.own_received]
            loop_backward(own, route.own_segments, weights, own_pre, own_grad, grads, own_out)
        got = in_flight.wait()
        with _compute_span(route.exchange, "bwd compute others"):
            loop_backward(received, route.other_segments, weights, other_pre, got, grads, grad_received)
        grad_rows = route.exchange.all_to_all(grad_received, route.recv, route.send, check=False)
        return grad_rows, None, None, *grads.finish()
