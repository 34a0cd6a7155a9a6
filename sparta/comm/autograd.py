"""Collectives that autograd can differentiate.

``all_to_all``: its backward is the reverse all-to-all. ``all_reduce_forward`` and
``all_reduce_backward``: the pair around a layer whose weights are split over ranks that all
see the same input (Megatron's tensor-parallel "g" and "f"): the partial outputs are summed
in forward, the partial input gradients in backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from sparta.comm.exchange import Exchange
from sparta.errors import InputError

if TYPE_CHECKING:
    from sparta.comm.communicator import Communicator


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        send: list[int] | None,
        recv: list[int] | None,
        comm: Exchange,
        check: bool | None,
    ) -> torch.Tensor:
        started = comm.start_all_to_all(x, send, recv, check)
        ctx.send, ctx.recv, ctx.comm = started.send_splits, started.recv_splits, comm
        return started.handle.wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        # Forward proved the splits consistent on every rank, so backward skips the check.
        back = ctx.comm.all_to_all(grad.contiguous(), ctx.recv, ctx.send, check=False)
        return back, None, None, None, None


def all_to_all(
    x: torch.Tensor,
    send_splits: Sequence[int] | None,
    recv_splits: Sequence[int] | None,
    comm: Exchange,
    check: bool | None = None,
) -> torch.Tensor:
    """Differentiable `comm.all_to_all`: x [n, *rest] -> [sum(recv_splits), *rest], over any
    Exchange (a Communicator, a HierarchicalAllToAll, a traced one).

    recv_splits=None exchanges them once in forward; backward reuses them reversed. Every
    rank must run backward through it (collectives are matched across ranks), which holds
    when every rank's loss depends on the output, as in MoE dispatch.
    """
    send = [int(s) for s in send_splits] if send_splits is not None else None
    recv = [int(s) for s in recv_splits] if recv_splits is not None else None
    return _AllToAll.apply(x, send, recv, comm, check)


def _summed(x: torch.Tensor, comm: Communicator, length: int | None) -> torch.Tensor:
    """The sum over ``comm`` of ``x``, sent as ``length`` rows (zeros after x's) when given."""
    pad = 0 if length is None else length - x.shape[0]
    if pad < 0:  # checked on this rank alone (the sum runs unchecked): its peers wait until their timeout
        raise InputError(
            f"all_reduce: {x.shape[0]} rows exceed length={length}; pass a length no smaller than any rank's rows"
        )
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    out = comm.all_reduce(x.contiguous(), op="sum", check=False)
    assert isinstance(out, torch.Tensor)
    return out[: out.shape[0] - pad] if pad else out


class _SumForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, length: int | None) -> torch.Tensor:
        return _summed(x, comm, length)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _SumBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, length: int | None) -> torch.Tensor:
        ctx.comm, ctx.length = comm, length
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _summed(grad, ctx.comm, ctx.length), None, None


def all_reduce_forward(x: torch.Tensor, comm: Communicator, length: int | None = None) -> torch.Tensor:
    """The sum of ``x`` over ``comm``'s ranks (same shape); backward passes the gradient
    through unchanged. For partial outputs whose sum every rank then uses alike.

    ``length``: send ``x`` [n, *rest] as ``length`` >= n rows (zero-padded), for callers
    whose n can differ between ranks where the values do not matter (torch's pipelining
    infers stage shapes from uninitialised tensors): the collective then has one size on
    every rank, and never hangs on a size mismatch."""
    return _SumForward.apply(x, comm, length)


def all_reduce_backward(x: torch.Tensor, comm: Communicator, length: int | None = None) -> torch.Tensor:
    """``x`` unchanged; backward sums the gradient over ``comm``'s ranks (``length`` as for
    `all_reduce_forward`). For an input that every rank holds alike and feeds to its own
    part of a split layer."""
    return _SumBackward.apply(x, comm, length)
