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

from sparta.comm import Handle, all_to_all
from sparta.comm.dtypes import dtype_code, dtype_name
from sparta.errors import InputError, SpartaError
from sparta.moe.dispatch import DispatchPlan, combine, rowwise_dot, weighted_index_add
from sparta.moe.expert_loop import (
    LoopGrads,
    LoopWeights,
    PreActivations,
    accumulation_targets,
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
    x: Tensor,
    plan: DispatchPlan,
    recv_counts: Tensor,
    experts: GroupedExperts,
    comm: Communicator,
    degrees: PipelineDegrees | None = None,
    exchange: Exchange | None = None,
) -> Tensor:
    """Run the pairs of ``plan`` (grouped by global expert, ``plan.counts`` ``[E]`` int64)
    through the experts of every rank. Token form (``plan.token_idx`` set): ``x`` is the
    tokens ``[T, d]`` and the result ``[T, d]`` each token's experts' outputs, weighted by
    ``plan.weight`` and summed (dispatch, experts and combine). Rows form (``token_idx``
    None, Soft MoE's slots): ``x`` is the rows ``[N, d]`` and the result ``[N, d]`` in the
    same order. ``recv_counts`` is what ``exchange_counts`` returned for these counts.
    Differentiable: the backward sends the gradients back along the reverse all-to-all.

    ``degrees`` cuts the row exchanges into chunks so that chunk ``i + 1`` travels while
    chunk ``i`` is computed (forward and backward separately, ``sparta.scheduling``);
    ``exchange`` moves the rows instead of ``comm`` (a ``HierarchicalAllToAll`` over the
    same ranks). Collectives, identical in order on every rank: the rows and the outputs
    (one all-to-all each, or one per chunk).
    """
    ep_size, local = comm.size, experts.num_experts
    pipelined = degrees is not None and (degrees.forward > 1 or degrees.backward > 1)
    # exchange_counts proved the splits, dtypes and widths consistent: no second check.
    send_splits, recv_splits = rank_splits(plan.counts, ep_size), rank_splits(recv_counts, ep_size)
    if not pipelined and not experts.uses_grouped_mm(x):
        blocks = recv_counts.view(ep_size, local).tolist()
        route = _Route(exchange or comm, comm.rank, send_splits, recv_splits, blocks)
        weight = None if plan.weight is None else plan.weight.to(x.dtype)
        w = experts.loop_weights()
        return _LocalFirst.apply(x, plan.token_idx, weight, route, w.activation, *w.tensors())
    rows = x if plan.token_idx is None else x.index_select(0, plan.token_idx)

    def compute(received: Tensor, chunk_counts: Tensor) -> Tensor:
        # Received rows come grouped by (source rank, local expert): the experts run each
        # source's block where it lies, with no copy into expert order and back.
        return experts.forward_blocks(received, chunk_counts.reshape(ep_size, local))

    if pipelined:
        assert degrees is not None
        params = [p for _, p in experts.named_weights()]
        out = pipelined_exchange(rows, plan.counts, compute, exchange or comm, degrees, params, recv_counts)
    else:
        received = all_to_all(rows, send_splits, recv_splits, exchange or comm, check=False)
        out = all_to_all(compute(received, recv_counts), recv_splits, send_splits, exchange or comm, check=False)
    return out if plan.token_idx is None else combine(out, plan, x.shape[0])


class _Route:
    """Where an expert-parallel step's rows go. Only the rows bound for other ranks travel:
    this rank's split is 0 both ways, and its own rows (``own``, in dispatch order) are
    computed where they lie."""

    def __init__(self, exchange: Exchange, me: int, send: list[int], recv: list[int], blocks: list[list[int]]) -> None:
        self.exchange = exchange
        self.own = slice(sum(send[:me]), sum(send[: me + 1]))
        self.send = [0 if r == me else n for r, n in enumerate(send)]
        self.recv = [0 if r == me else n for r, n in enumerate(recv)]
        self.own_segments = consecutive_segments(blocks[me], self.own.start)
        self.other_segments = block_segments([b for r, b in enumerate(blocks) if r != me])

    def others(self, t: Tensor) -> Tensor:
        """``t``'s entries (dim 0, in dispatch order) outside this rank's own: a view where
        the own block is at either end, as it always is on two ranks."""
        if self.own.start == 0:
            return t[self.own.stop :]
        if self.own.stop == t.shape[0]:
            return t[: self.own.start]
        return torch.cat([t[: self.own.start], t[self.own.stop :]])

    def send_filled(
        self, fill: Callable[[Tensor], None], width: int, like: Tensor, borrow: bool = False
    ) -> Handle[Tensor]:
        """Start the exchange of the ``[sum(send), width]`` rows (``like``'s dtype and device)
        that ``fill`` writes, straight into the exchange's buffer where it has one
        (``borrow``: see ``Communicator.all_to_all_fill``)."""
        return self._filled(fill, width, like, self.send, self.recv, borrow)

    def return_filled(
        self, fill: Callable[[Tensor], None], width: int, like: Tensor, borrow: bool = False
    ) -> Handle[Tensor]:
        """The reverse exchange: the ``[sum(recv), width]`` rows ``fill`` writes go back."""
        return self._filled(fill, width, like, self.recv, self.send, borrow)

    def _filled(
        self, fill: Callable[[Tensor], None], width: int, like: Tensor, send: list[int], recv: list[int], borrow: bool
    ) -> Handle[Tensor]:
        shape = (sum(send), width)
        return self.exchange.all_to_all_fill(
            fill, shape, like.dtype, send, recv, async_op=True, check=False, device=like.device, borrow=borrow
        )

    def place_others(self, into: Tensor, src: Tensor) -> None:
        """Copy ``src`` (``others``' rows) into the rows of ``into`` outside this rank's own."""
        head = self.own.start
        into[:head].copy_(src[:head])
        into[self.own.stop :].copy_(src[head:])


def _compute_span(exchange: Exchange, name: str) -> AbstractContextManager[None]:
    """A span on the "compute" track when the exchange records into a Tracer
    (sparta.scheduling.trace.TracedExchange, as `sparta profile` passes): the unpipelined
    step then shows its compute beside its transfers, as the pipelined one does."""
    tracer = getattr(exchange, "tracer", None)
    return tracer.span(name, "compute") if tracer is not None else nullcontext()


class _LocalFirst(torch.autograd.Function):
    """All-to-all, experts, all-to-all back, with this rank's own pairs computed while the
    other ranks' rows travel, and their gradients while the other ranks' gradients travel.
    A rank's own pairs never enter the exchange (its split is 0): in token form they run as
    the one-process layer runs them, gathered from the tokens and combined into the output
    one expert at a time, so that only the pairs bound for other ranks are gathered into a
    send buffer and combined from the returned rows. ``apply(x, token_idx, weight, route,
    activation, *weights)``: token form ``x`` ``[T, d]``, ``token_idx`` / ``weight`` ``[N]``
    -> ``[T, d]``; rows form (``token_idx``, ``weight`` None) ``x`` ``[N, d]`` -> ``[N, d]``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        token_idx: Tensor | None,
        weight: Tensor | None,
        route: _Route,
        activation: str,
        *params: Tensor | None,
    ) -> Tensor:
        weights = LoopWeights(activation, *params)
        x = x.contiguous()
        d_out = weights.w2.shape[2]

        def send_rows(buf: Tensor) -> None:
            if token_idx is None:
                buf.copy_(route.others(x))
            else:
                torch.index_select(x, 0, route.others(token_idx), out=buf)

        out = x.new_empty(x.shape[0], d_out) if token_idx is None else x.new_zeros(x.shape[0], d_out)
        in_flight = route.send_filled(send_rows, x.shape[1], x)
        with _compute_span(route.exchange, "fwd compute own"):
            own_pre = loop_forward(x, route.own_segments, weights, out, token_idx, weight)
        received = in_flight.wait()
        other_pre: list[tuple[PreActivations, PreActivations | None]] = []

        def compute_others(done: Tensor) -> None:
            with _compute_span(route.exchange, "fwd compute others"):
                other_pre.append(loop_forward(received, route.other_segments, weights, done))

        back = route.return_filled(compute_others, d_out, x).wait()
        if token_idx is None:
            route.place_others(out, back)
        else:
            assert weight is not None
            weighted_index_add(out, route.others(token_idx), back, route.others(weight))
        # Intermediates, not inputs or outputs: kept on ctx so that backward can drop them.
        ctx.pre, ctx.route, ctx.activation = (own_pre, other_pre[0]), route, activation
        # The returned rows give the routing weights' gradients (token form only).
        ctx.save_for_backward(x, token_idx, weight, received, back if token_idx is not None else None, *params)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        ctx.into = accumulation_targets(ctx.saved_tensors[5:], ctx.needs_input_grad[5:])
        return _LocalFirst._backward(ctx, grad)

    @staticmethod
    @once_differentiable
    def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, token_idx, weight, received, back, *params = ctx.saved_tensors
        route: _Route = ctx.route
        weights = LoopWeights(ctx.activation, *params)
        (own_pre, other_pre), ctx.pre = ctx.pre, None
        grad = grad.contiguous()
        grad_weight = None
        if token_idx is not None and ctx.needs_input_grad[2]:
            grad_weight = torch.empty_like(weight)

        def send_grads(buf: Tensor) -> None:
            if token_idx is None:
                buf.copy_(route.others(grad))
                return
            torch.index_select(grad, 0, route.others(token_idx), out=buf)
            if grad_weight is not None:
                route.place_others(grad_weight, rowwise_dot(buf, back))
            buf.mul_(route.others(weight).unsqueeze(1))

        # Borrowed: read only by the next exchange's fill.
        in_flight = route.send_filled(send_grads, grad.shape[1], grad, borrow=True)
        grad_x = torch.empty_like(x) if token_idx is None else torch.zeros_like(x)
        into, ctx.into = ctx.into, None  # no .grad kept alive by a retained graph
        grads = LoopGrads(weights, into)
        with _compute_span(route.exchange, "bwd compute own"):
            loop_backward(x, route.own_segments, weights, own_pre, grad, grads, grad_x, token_idx, weight, grad_weight)
        got = in_flight.wait()

        def compute_others(grad_received: Tensor) -> None:
            with _compute_span(route.exchange, "bwd compute others"):
                loop_backward(received, route.other_segments, weights, other_pre, got, grads, grad_received)

        grad_back = route.return_filled(compute_others, received.shape[1], received, borrow=True).wait()
        if token_idx is None:
            route.place_others(grad_x, grad_back)
        else:
            grad_x.index_add_(0, route.others(token_idx), grad_back)
        return grad_x, None, grad_weight, None, None, *grads.finish()
