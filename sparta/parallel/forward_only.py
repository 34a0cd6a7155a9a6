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
any floating tensor; the receiving rank allocates it on its device. A rank that fails (a
stage's error, an output it cannot send, or such a header from the stage before) sends every
rank still owed an activation a refusal header instead, naming the failed pp ranks; each of
those raises and passes it on, skipping ranks already failed (looped and V schedules come
back to them). At the end the pp ranks agree on who failed (one small all-reduce) before
any waits on its sends, which a failed rank will never take: every rank raises, none waits.
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
_REFUSED = -1  # a header's ndim when the sender failed: the rest of the header says who
_WORDS = _HEADER - 1  # int64 words after the marker: a bit for each failed pp rank, 62 to a word


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
    where this rank holds it, else []. Collective over the pp group: a failure on any of its
    ranks raises on all of them."""
    device = inputs[0].device
    held: dict[tuple[int, int], Tensor] = {}
    sends: list[tuple[dist.Work | None, Tensor]] = []
    losses: list[Tensor] = []
    # activations still owed to each other rank: a failure here tells each of them
    owed: dict[int, int] = {}
    for stage in modules:
        if stage + 1 < num_stages and stage + 1 not in modules:
            owed[owner(stage + 1)] = owed.get(owner(stage + 1), 0) + len(inputs)
    failure: Exception | None = None
    try:
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
                    sends += _send(y, owner(stage + 1), group)
                    owed[owner(stage + 1)] -= 1
    except Exception as exc:
        if group is None:  # one pipeline rank: nobody waits on this one
            raise
        failure = exc
        known = exc.failed if isinstance(exc, _Refused) else frozenset()
        sends += _refuse(owed, known | {dist.get_rank(group)}, group, device)
    if group is not None:
        # earlier stages' ranks are done with their loops but may still owe sends to a failed
        # rank, which will never take them: all agree before anyone waits on a send
        failed = _failed_ranks(failure is not None, group, device)
        if failure is not None:
            raise failure
        if failed:
            raise InputError(
                f"the forward-only pass failed on pp rank(s) {failed}, after this rank's stages: see the first of "
                "their errors"
            )
    for work, _ in sends:  # the tensors stay referenced until their send completes
        if work is not None:
            work.wait()
    return losses


class _Refused(InputError):
    """A previous stage's rank failed (``failed``: the pp ranks known to have)."""

    def __init__(self, message: str, failed: frozenset[int]) -> None:
        super().__init__(message)
        self.failed = failed


def _refuse(
    owed: dict[int, int], failed: frozenset[int], group: dist.ProcessGroup, device: torch.device
) -> list[tuple[dist.Work | None, Tensor]]:
    """Tell every rank still waiting for an activation from this one that none will come, and
    which ranks failed, so that the news travels down the pipeline without going back to a
    rank that has stopped receiving (a looped or V schedule returns to earlier ranks). Not
    waited: a rank that failed meanwhile from another cause never takes it."""
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    header[0] = _REFUSED
    for r in failed:
        if r < _WORDS * 62:  # a pp group past 558 ranks: the others go unnamed
            header[1 + r // 62] |= 1 << (r % 62)
    return [
        (dist.isend(header, group=group, group_dst=dst), header) for dst, n in owed.items() if n and dst not in failed
    ]


def _failed_ranks(failed: bool, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """The pp ranks that failed, agreed by every rank of ``group``."""
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=device)
    flags[dist.get_rank(group)] = int(failed)
    dist.all_reduce(flags, group=group)
    return [r for r, f in enumerate(flags.tolist()) if f]


def _send(y: Tensor, dst: int, group: dist.ProcessGroup | None) -> list[tuple[dist.Work | None, Tensor]]:
    if not isinstance(y, Tensor) or y.dtype not in _DTYPES or y.dim() > _MAX_DIMS:
        raise InputError(  # the next stage's rank is told by forward_only's refusal
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
        words = header[1:].tolist()
        failed = frozenset(62 * i + b for i, word in enumerate(words) for b in range(62) if word >> b & 1)
        raise _Refused(
            f"the forward-only pass stopped: pp rank(s) {sorted(failed)} failed before this stage (the one "
            f"before it is pp rank {src}); see the first of their errors",
            failed,
        )
    x = torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device)
    dist.recv(x, group=group, group_src=src)
    return x
