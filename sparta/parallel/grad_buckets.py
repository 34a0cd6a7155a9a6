"""The "sparta" data-parallel strategy's dense gradients: flat pieces of the local gradients,
each all-reduced over the dp group as soon as backward has accumulated every micro-batch into
all of its parameters, so that the reductions overlap the rest of backward.

The pieces are buckets of ``bucket_bytes`` in backward's order (the reverse of the forward),
each at most 1 / ``bucket_shares`` of them (the trainer asks its layers plus one), or, given a
`GapRelease`, the cost model's partition released into an MoE layer's network gaps. With a
`PriorityQueue` each piece is a task keyed by its earliest parameter in the next forward
(EmbRace's 2D scheduling: what the next forward needs first goes first); without one, the
pieces go straight to the engine in ready order, the same on every rank whatever order their
hooks fire in. `DataParallel` owns one of these for "sparta" and drives it: `add` when
it wraps a module, `start` before backward, `complete_rest` and `finish` after.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from sparta.comm import Communicator, Handle
from sparta.comm.priority import PriorityQueue, TaskKey
from sparta.errors import ConfigError, InputError
from sparta.scheduling.grad_sync import GapRelease


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard; a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``p.grad`` (which must be set)."""
    assert p.grad is not None
    return local_tensor(p.grad)


def scale_grads(params: Iterable[nn.Parameter], factor: float) -> None:
    """Multiply each parameter's local gradient by ``factor`` in place."""
    if factor == 1.0:
        return
    for p in params:
        local_grad(p).mul_(factor)


def unflatten_into(flat: torch.Tensor, spans: list[tuple[torch.Tensor, int, int]], factor: float = 1.0) -> None:
    """Copy consecutive pieces of ``flat`` into elements [first, end) of each tensor, times ``factor``."""
    offset = 0
    for t, lo, hi in spans:
        piece, src = t.view(-1)[lo:hi], flat[offset : offset + hi - lo]
        if factor != 1.0:
            torch.mul(src, factor, out=piece)  # scaled on the way: one pass over the gradient
        else:
            piece.copy_(src)
        offset += hi - lo


# below this a bucket's all-reduce is mostly its latency
MIN_BUCKET_BYTES = 256 * 1024


def bucket_cap(total_bytes: int, bucket_bytes: int, bucket_shares: int) -> int:
    """The bytes at which a bucket closes: ``bucket_bytes``, or ``total_bytes`` over
    ``bucket_shares`` where that is less, but never under `MIN_BUCKET_BYTES`."""
    return min(bucket_bytes, max(MIN_BUCKET_BYTES, -(-total_bytes // bucket_shares)))


@dataclass
class _Task:
    """One dense all-reduce: element slices (parameter, first, end) of the flat local gradients."""

    key: TaskKey
    spans: list[tuple[nn.Parameter, int, int]]
    handle: Handle[torch.Tensor] | None = None
    flat: torch.Tensor | None = None  # the piece's buffer, kept from step to step


class GradBuckets:
    """The dense parameters' reductions over ``dp`` (see the module docstring).

    microbatches: backward passes per step (a piece leaves after the last one); queue: send
    through this PriorityQueue (None: straight to the engine); release: send the partition's
    pieces into an exchange's gaps instead of buckets; order, names: each parameter's
    position in the forward and its name (for errors), kept up to date by the owner;
    bucket_shares: close a bucket at most every 1 / ``bucket_shares`` of the dense gradients
    (`bucket_cap`: a bucket ends at a parameter's end, so a large one makes fewer), so that a
    model whose dense gradients fit one bucket still sends most of them while backward runs.
    """

    def __init__(
        self,
        dp: Communicator,
        microbatches: int,
        bucket_bytes: int,
        queue: PriorityQueue | None,
        release: GapRelease | None,
        order: dict[nn.Parameter, int],
        names: dict[nn.Parameter, str],
        bucket_shares: int = 1,
    ) -> None:
        self.dp, self.microbatches, self.bucket_bytes = dp, microbatches, bucket_bytes
        self.bucket_shares = bucket_shares
        self.queue, self.release = queue, release
        self.params: list[nn.Parameter] = []
        self._order, self._names = order, names  # the owner's, filled as it wraps modules
        self._tasks: list[_Task] = []  # in ready order (backward's)
        self._task_of: dict[nn.Parameter, list[int]] = {}
        self._ready_index: dict[nn.Parameter, int] = {}
        self._stale = True
        self._agreed = False  # the plan's piece sizes compared across ranks (once per plan)
        self._started = False
        self._arrivals: dict[nn.Parameter, int] = {}
        self._missing: list[int] = []  # per task: parameters not complete yet
        self._sent = 0  # tasks sent, in order (no queue: keeps every rank's order)

    def add(self, params: list[nn.Parameter]) -> list[RemovableHandle]:
        """Reduce ``params`` too (each already in ``order`` and ``names``); returns their
        gradient hooks, for the caller to remove."""
        self.params += params
        self._stale, self._agreed = True, False
        return [p.register_post_accumulate_grad_hook(self._arrived) for p in params]

    @property
    def keys(self) -> list[TaskKey]:
        """The queue keys of this step's pieces (planned at the first `start` after an `add`)."""
        if self._stale:
            self._plan()
        return [t.key for t in self._tasks]

    def _plan(self) -> None:
        """The tasks (buckets or pieces), in ready order: the reverse of the forward."""
        ready = sorted(self.params, key=lambda p: -self._order[p])
        self._ready_index = {p: i for i, p in enumerate(ready)}
        spans: list[list[tuple[nn.Parameter, int, int]]] = []
        if self.release is not None:
            sizes = {p.element_size() for p in ready}
            if len(sizes) != 1:
                dtypes = sorted({str(p.dtype) for p in ready})
                raise ConfigError(
                    f"partition= needs dense parameters of one dtype, got {dtypes}: cast the model to one dtype "
                    "or leave the gradient partitioning off"
                )
            self.release.bind([local_tensor(p).numel() for p in ready], sizes.pop())
            spans = [[(ready[i], lo, hi) for i, lo, hi in self.release.spans(k)] for k in range(len(self.release))]
        else:
            total = sum(local_tensor(p).numel() * p.element_size() for p in ready)
            cap = bucket_cap(total, self.bucket_bytes, self.bucket_shares)
            current: list[tuple[nn.Parameter, int, int]] = []
            size = 0
            for p in ready:
                n = local_tensor(p).numel()
                current.append((p, 0, n))
                size += n * p.element_size()
                if size >= cap:
                    spans.append(current)
                    current, size = [], 0
            if current:
                spans.append(current)
        # priority: the task's earliest parameter in the forward (the next forward needs it first)
        self._tasks = [
            _Task(TaskKey(min(self._order[p] for p, _, _ in s), f"dense {i}"), s) for i, s in enumerate(spans)
        ]
        self._task_of = {}
        for index, task in enumerate(self._tasks):
            for p, _, _ in task.spans:
                self._task_of.setdefault(p, []).append(index)
        self._stale = False

    def start(self) -> None:
        """Begin a step: no piece sent yet, every parameter awaiting its micro-batches. At
        the first step of a plan, collective over ``dp``: the pieces' sizes are compared
        across ranks (InputError on every rank where they differ), so that the steps' own
        reductions skip the per-call check, a rendezvous that would stall the backward hook
        issuing it until every rank reached the same point."""
        if self._stale:
            self._plan()
        if not self._agreed:
            self._agree()
        self._started = True
        self._arrivals = {}
        self._missing = [len({p for p, _, _ in t.spans}) for t in self._tasks]
        self._sent = 0
        for task in self._tasks:
            task.handle = None
        if self.release is not None:
            self.release.start(self._send)

    def _agree(self) -> None:
        sizes = torch.tensor([sum(hi - lo for _, lo, hi in t.spans) for t in self._tasks], dtype=torch.int64)
        every = self.dp.all_gather(sizes)
        if any(not torch.equal(other, sizes) for other in every):  # type: ignore[union-attr]
            raise InputError(
                f"data-parallel gradient pieces differ across the dp ranks (elements per piece, by rank: "
                f"{[t.tolist() for t in every]}): every rank must wrap the same model with the same parameters"  # type: ignore[union-attr]
            )
        self._agreed = True

    def _arrived(self, p: torch.Tensor) -> None:
        if not self._started:
            return  # a backward outside start() / finish() is not ours to reduce
        n = self._arrivals[p] = self._arrivals.get(p, 0) + 1  # type: ignore[index]
        if n > self.microbatches:
            raise InputError(
                f"{self._names[p]} received gradients from {n} backward passes in one step of "  # type: ignore[index]
                f"microbatches={self.microbatches}: its reduction may have left already. Pass "
                "DataParallel(microbatches=<backwards per step>), or call start()/finish() around each"
            )
        if n == self.microbatches:
            self._complete(p)  # type: ignore[arg-type]

    def _complete(self, p: nn.Parameter) -> None:
        if self.release is not None:
            self.release.ready(self._ready_index[p])
            return
        for index in self._task_of[p]:
            self._missing[index] -= 1
            if self._missing[index] == 0:
                self._ready_task(index)

    def _ready_task(self, index: int) -> None:
        if self.queue is not None:
            self._send(index)
            return
        # straight to the engine: in ready order on every rank, whatever order they complete in
        while self._sent < len(self._tasks) and self._missing[self._sent] == 0:
            self._send(self._sent)

    def _send(self, index: int) -> None:
        task = self._tasks[index]
        pieces = [local_grad(p).reshape(-1)[lo:hi] for p, lo, hi in task.spans]
        # into the buffer of the last step (finish waited on it): a fresh one each step cost
        # a 16 MiB flatten 3.8 ms instead of 1.7 on CPU, its pages faulted in anew
        if task.flat is None or (task.flat.dtype, task.flat.device) != (pieces[0].dtype, pieces[0].device):
            task.flat = torch.cat(pieces)
        else:
            torch.cat(pieces, out=task.flat)
        flat = task.flat
        # no per-call check: the sizes were agreed at the plan's first start; flat is ours to
        # donate, so the engine may sum into it instead of a copy
        if self.queue is not None:
            task.handle = self.queue.submit(task.key, flat, reduce="sum", check=False, donate=True)
        else:
            task.handle = self.dp.all_reduce(flat, op="sum", async_op=True, check=False, donate=True)  # type: ignore[assignment]
        self._sent += 1

    def complete_rest(self) -> None:
        """Send what hooks never completed: zero-bubble W gradients, parameters no loss used
        (their ``.grad`` must be set, zeros for the unused ones)."""
        self._started = False
        for p in self.params:
            if self._arrivals.get(p, 0) < self.microbatches:
                self._arrivals[p] = self.microbatches
                self._complete(p)
        if self.release is not None:
            self.release.finish()

    def finish(self, scale: float) -> None:
        """Wait every piece and write it back into the gradients, times ``scale``."""
        for task in self._tasks:
            assert task.handle is not None
            unflatten_into(task.handle.wait(), [(local_grad(p), lo, hi) for p, lo, hi in task.spans], scale)

    def stop(self) -> None:
        """Hooks firing from now on are ignored until the next `start`."""
        self._started = False
