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

Failures. A rank that fails (a stage's error, an output it cannot send, or a refusal from the
stage before) sends every rank it still owes an activation a refusal header instead, naming
the ranks that stopped, so that the news travels down the pipeline without going back to them
(looped and V schedules return to earlier ranks); each such rank raises and passes it on.
Every pass ends with one all-reduce over the pp group of the headers each rank sent to each
other and of who failed: each rank then receives what it was sent and never took, so no
message is left to pair with a later pass's, waits on its own sends, and raises where any rank
failed, naming the ranks where the failure began. The pairs of ranks that hand on activations
exchange one small message first, in a fixed order: NCCL connects a pair at its first message,
and a send to a rank that has stopped receiving must not be that first message. This covers
the pp group; a failure inside a stage's own collectives with other pipelines' ranks (its
expert exchanges, tp sums) ends at their communicator's timeout, except the MoE layer's bad
input, which its ranks agree on before any exchange.
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
_REFUSED = -1  # a header's ndim when the sender stopped: the rest of the header says who
_WORDS = _HEADER - 1  # int64 words after the marker: a bit for each stopped pp rank, 62 to a word
_ORIGIN, _RELAY = 2, 1  # what a rank reports at the end: it failed itself, or passed a refusal on


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
    ranks raises on all of them (see the module docstring)."""
    if group is None:  # one pipeline rank: every stage is here
        return _run(modules, num_stages, inputs, targets, loss_fn, None)
    links = _Links(group, inputs[0].device, modules, num_stages, owner, len(inputs))
    failure: Exception | None = None
    losses: list[Tensor] = []
    try:
        losses = _run(modules, num_stages, inputs, targets, loss_fn, links)
    except Exception as exc:
        failure = exc
        links.refuse(exc.stopped if isinstance(exc, _Refused) else frozenset())
    origins = links.settle(
        origin=failure is not None and not isinstance(failure, _Refused), stopped=failure is not None
    )
    if failure is not None and not isinstance(failure, _Refused):
        raise failure
    if origins:
        raise PeerStageFailure(
            f"the forward-only pass failed on pp rank(s) {origins}: see the first of their errors (this rank's "
            "stages stopped there)"
        )
    return losses


def _run(
    modules: dict[int, nn.Module],
    num_stages: int,
    inputs: Sequence[Tensor],
    targets: Sequence[Tensor],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    links: _Links | None,
) -> list[Tensor]:
    held: dict[tuple[int, int], Tensor] = {}
    losses: list[Tensor] = []
    for stage in sorted(modules):
        for k in range(len(inputs)):
            if stage == 0:
                x = inputs[k]
            elif stage - 1 in modules:
                x = held.pop((stage - 1, k))
            else:
                assert links is not None
                x = links.receive(stage - 1)
            y = modules[stage](x)
            if stage == num_stages - 1:
                losses.append(loss_fn(y, targets[k]))
            elif stage + 1 in modules:
                held[(stage, k)] = y
            else:
                assert links is not None
                links.send(y, stage + 1)
    return losses


class PeerStageFailure(InputError):
    """The forward-only pass failed on other ranks of the pp group, not on this one."""


class _Refused(InputError):
    """A stage before this rank's stopped (``stopped``: the pp ranks known to have)."""

    def __init__(self, message: str, stopped: frozenset[int]) -> None:
        super().__init__(message)
        self.stopped = stopped


class _Links:
    """This rank's point-to-point traffic of one pass: what it owes whom, the headers sent to
    and taken from each rank, the sends in flight."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        modules: dict[int, nn.Module],
        num_stages: int,
        owner: Callable[[int], int],
        microbatches: int,
    ) -> None:
        self.group, self.device, self.owner = group, device, owner
        self.me, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.owed = [0] * self.size  # activations still owed to each rank
        for stage in modules:
            if stage + 1 < num_stages and stage + 1 not in modules:
                self.owed[owner(stage + 1)] += microbatches
        self.sent = [0] * self.size  # headers sent to each rank
        self.taken = [0] * self.size  # headers received from each rank
        self.works: list[tuple[dist.Work | None, Tensor]] = []
        peers = {owner(s + 1) for s in modules if s + 1 < num_stages and s + 1 not in modules}
        peers |= {owner(s - 1) for s in modules if s > 0 and s - 1 not in modules}
        self._connect(sorted(peers))

    def _connect(self, peers: list[int]) -> None:
        # each pair in increasing (low, high) order on both sides: the lowest pair not yet done
        # has both its ranks at it, so the handshakes never wait on one another
        token = torch.zeros(1, dtype=torch.int64, device=self.device)
        for peer in peers:
            if self.me < peer:
                dist.send(token, group=self.group, group_dst=peer)
                dist.recv(token, group=self.group, group_src=peer)
            else:
                dist.recv(token, group=self.group, group_src=peer)
                dist.send(token, group=self.group, group_dst=peer)

    def send(self, y: Tensor, stage: int) -> None:
        """Hand ``y`` on to ``stage``'s rank (non-blocking)."""
        dst = self.owner(stage)
        if not isinstance(y, Tensor) or y.dtype not in _DTYPES or y.dim() > _MAX_DIMS:
            raise InputError(  # the next stage's rank hears of it by the refusal
                f"a pipeline stage handed on {type(y).__name__} "
                f"{getattr(y, 'dtype', '')} {tuple(getattr(y, 'shape', ()))}: the forward-only pass takes one "
                f"floating tensor of at most {_MAX_DIMS} dims ({', '.join(map(str, _DTYPES))})"
            )
        y = y.contiguous()
        header = torch.zeros(_HEADER, dtype=torch.int64, device=y.device)
        header[0], header[1] = y.dim(), _DTYPES.index(y.dtype)
        header[2 : 2 + y.dim()] = torch.tensor(y.shape, dtype=torch.int64)
        self._isend(header, dst)
        self._isend(y, dst)
        self.sent[dst] += 1
        self.owed[dst] -= 1

    def receive(self, stage: int) -> Tensor:
        """The activation ``stage``'s rank hands on; _Refused where that rank stopped."""
        src = self.owner(stage)
        header, x = self._take(src)
        if x is None:
            words = header[1:].tolist()
            stopped = frozenset(62 * i + b for i, word in enumerate(words) for b in range(62) if word >> b & 1)
            raise _Refused(f"pp rank(s) {sorted(stopped)} stopped before this stage", stopped)
        return x

    def _take(self, src: int) -> tuple[Tensor, Tensor | None]:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, group=self.group, group_src=src)
        self.taken[src] += 1
        ndim, dtype, *shape = header.tolist()
        if ndim == _REFUSED:
            return header, None
        x = torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=self.device)
        dist.recv(x, group=self.group, group_src=src)
        return header, x

    def _isend(self, t: Tensor, dst: int) -> None:
        self.works.append((dist.isend(t, group=self.group, group_dst=dst), t))  # t lives until waited

    def refuse(self, stopped: frozenset[int]) -> None:
        """Tell every rank still owed an activation that none will come (not waited: a rank
        that stopped meanwhile from another cause takes it only at `settle`)."""
        stopped = stopped | {self.me}
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0] = _REFUSED
        for r in stopped:
            if r < _WORDS * 62:  # a pp group past 558 ranks: the others go unnamed
                header[1 + r // 62] |= 1 << (r % 62)
        for dst, n in enumerate(self.owed):
            if n and dst not in stopped:
                self._isend(header, dst)
                self.sent[dst] += 1

    def settle(self, origin: bool, stopped: bool) -> list[int]:
        """Collective over the group: agree on every rank's sent headers and state, take what
        was sent here and never taken, wait on this rank's sends. Returns the ranks where a
        failure began."""
        table = torch.zeros(self.size, self.size + 1, dtype=torch.int64, device=self.device)
        table[self.me, : self.size] = torch.tensor(self.sent, dtype=torch.int64)
        table[self.me, self.size] = _ORIGIN if origin else _RELAY if stopped else 0
        dist.all_reduce(table, group=self.group)
        rows = table.tolist()
        for src in range(self.size):
            for _ in range(rows[src][self.me] - self.taken[src]):
                self._take(src)
        for work, _ in self.works:
            if work is not None:
                work.wait()
        return [r for r in range(self.size) if rows[r][self.size] == _ORIGIN]
