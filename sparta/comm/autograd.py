"""All-to-all that autograd can differentiate: its backward is the reverse all-to-all."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from sparta.comm.exchange import Exchange


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
