"""A forward-only pass of the pipeline, for evaluation: every micro-batch through this rank's
stages, activations handed to the next stage's rank by point-to-point over the pp group.

Why not the schedule's own ``eval()``: in torch 2.13 it runs the action list of training
with backward switched off, and the V-shaped schedules (ZBVZeroBubble, DualPipeV) still hand
input gradients between their two local stages, which fails ("can't steal_bwd_input if this
stage doesn't have backward"): `sparta train` under those schedules died at its first
validation. This pass needs no action list, so it is the same for every schedule.

Order: each rank runs its stages in ascending global index and, within a stage, the
micro-batches in order: the pairs (stage, micro-batch) in lexicographic order, which every
dependency (stage s - 1 before stage s, same micro-batch) respects. Sends are non-blocking
and receives are posted in that order, so no rank waits on one that waits on it, and a
stage's tensor- and expert-parallel collectives are issued in the same order on every rank
of their group. Consecutive stages pipeline as GPipe's forward does: stage s + 1 starts on
micro-batch 0 while stage s computes micro-batch 1.

Each activation is preceded by a header (its dims, dtype and shape), so stages may hand on
any floating tensor; the receiving rank allocates it on its device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from sparta.errors import InputError

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_DIMS = 8
_HEADER = 2 + _MAX_DIMS  # ndim, dtype index, shape padded with zeros
_REFUSED = -1  # a header's ndim when the sender could not send its stage's output


@torch.no_grad()
def forward_only(
    modules: dict[int, nn.Module],
    num_stages: int,
    owner: Callable[[int], int],
    group: dist.ProcessGroup | None,
    inputs: Sequence[Tensor],
    targets: Sequence[Tensor],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
) -> list[Tensor]:
    """Run micro-batches ``inputs[k]`` (stage 0's input, used where this rank holds stage 0)
    through this rank's ``modules`` (global stage index -> module), receiving other stages'
    activations from ``owner(stage)`` over ``group`` (the pp group; None when there is one
    pipeline rank). Returns the last stage's ``loss_fn(output, targets[k])`` per micro-batch
    where this rank holds it, else []. Collective over the pp group."""
    device = inputs[0].device
    held: dict[tuple[int, int], Tensor] = {}
    sends: list[tuple[dist.Work | None, Tensor]] = []
    losses: list[Tensor] = []
    for stage in sorted(modules):
        for k in range(len(inputs)):
            if stage == 0:
                x = inputs[k]
            elif stage - 1 in modules:
                x = held.pop((stage - 1, k))
            else:
                x = _receive(owner(stage - 1), group, device)
            y = modules[stage](x)
            if stage == num_stages - 1:
                losses.append(loss_fn(y, targets[k]))
            elif stage + 1 in modules:
                held[(stage, k)] = y
            else:
                sends += _send(y, owner(stage + 1), group, device)
    for work, _ in sends:  # the tensors stay referenced until their send completes
        if work is not None:
            work.wait()
    return losses


def _send(
    y: Tensor, dst: int, group: dist.ProcessGroup | None, device: torch.device
) -> list[tuple[dist.Work | None, Tensor]]:
    if not isinstance(y, Tensor) or y.dtype not in _DTYPES or y.dim() > _MAX_DIMS:
        # the next stage's rank is already waiting for this header: tell it, then raise here
        dist.send(torch.full((_HEADER,), _REFUSED, dtype=torch.int64, device=device), group=group, group_dst=dst)
        raise InputError(
            f"a pipeline stage handed on {type(y).__name__} "
            f"{getattr(y, 'dtype', '')} {tuple(getattr(y, 'shape', ()))}: the forward-only pass takes one "
            f"floating tensor of at most {_MAX_DIMS} dims ({', '.join(map(str, _DTYPES))})"
        )
    y = y.contiguous()
    header = torch.zeros(_HEADER, dtype=torch.int64, device=y.device)
    header[0], header[1] = y.dim(), _DTYPES.index(y.dtype)
    header[2 : 2 + y.dim()] = torch.tensor(y.shape, dtype=torch.int64)
    return [
        (dist.isend(header, group=group, group_dst=dst), header),
        (dist.isend(y, group=group, group_dst=dst), y),
    ]


def _receive(src: int, group: dist.ProcessGroup | None, device: torch.device) -> Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=src)
    ndim, dtype, *shape = header.tolist()
    if ndim == _REFUSED:
        raise InputError(
            f"the previous pipeline stage (pp rank {src}) handed on what the forward-only pass cannot send: "
            "see that rank's error"
        )
    x = torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device)
    dist.recv(x, group=group, group_src=src)
    return x
