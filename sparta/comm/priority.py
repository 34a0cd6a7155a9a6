"""A priority queue of communication tasks, issued in an order every rank agrees on.

Two dimensions (EmbRace's 2D scheduling): across tasks, a priority key (the layer's position
in the next forward, the embedding first, with a name to break ties); inside a task, chunks
of at most `chunk_bytes`, so a task's all-reduce is many small collectives and a task that
becomes ready late waits behind a few chunks, never behind a whole huge tensor.

Ranks must issue collectives in the same order or they deadlock, so the order is a fixed
schedule computed from the keys and the order in which the round declares its tasks become
ready (`expect(keys, ready_order)`: for gradients, the model's layers in reverse). The
schedule replays that readiness: after each task becomes ready, `chunks_per_ready` chunks
of the highest-priority ready tasks are placed before the next task becomes ready; once all
are ready the rest follows in key order. So lower-priority chunks travel while backward
still computes the higher-priority gradients, and a high-priority task overtakes every chunk
not yet placed. A rank issues the schedule's next chunk as soon as that chunk's task has
been submitted on this rank: submitting in another order, or later, changes when a rank
issues, never what (a rank ahead of its declared order simply waits).

    q = PriorityQueue(comm, QueueConfig(chunk_bytes=1 << 20))
    q.expect([TaskKey(0, "emb"), TaskKey(1, "block.0"), TaskKey(2, "head")],
             ready_order=[TaskKey(2, "head"), TaskKey(1, "block.0"), TaskKey(0, "emb")])
    h = q.submit(TaskKey(2, "head"), grad)          # issued at once: it is ready first
    ...                                              # the other submits
    reduced = h.wait()                               # every rank's grad, summed
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from sparta.comm.communicator import Communicator
from sparta.comm.dtypes import REDUCE_OPS
from sparta.comm.handle import Handle
from sparta.errors import CollectiveError, ConfigError, InputError

TASK_OPS = ("all_reduce", "all_to_all")


@dataclass(frozen=True, order=True)
class TaskKey:
    """Issue order: lower `priority` first, then `name` (the same string on every rank)."""

    priority: int
    name: str


@dataclass(frozen=True)
class QueueConfig:
    """chunk_bytes: an all-reduce is cut into pieces of at most this many bytes.
    max_in_flight: chunks issued and not yet completed, this round's and the last's; issuing
        one more waits for the oldest.
    chunks_per_ready: chunks the schedule places after each task becomes ready, before the
        next one does (how much communication one task's backward compute is expected to
        hide); 0 issues strictly in key order, after every task has been submitted.
    All-to-all tasks travel whole (their chunk boundaries would need every rank's splits)."""

    chunk_bytes: int = 4 << 20
    max_in_flight: int = 4
    chunks_per_ready: int = 2

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1 or self.max_in_flight < 1 or self.chunks_per_ready < 0:
            raise ConfigError(
                f"QueueConfig(chunk_bytes={self.chunk_bytes}, max_in_flight={self.max_in_flight}, "
                f"chunks_per_ready={self.chunks_per_ready}): the first two must be >= 1, the last >= 0"
            )


@dataclass
class _Task:
    key: TaskKey
    tensor: torch.Tensor
    op: str
    reduce: str
    send: list[int] | None
    recv: list[int] | None
    chunks: list[torch.Tensor]
    pending: list[Handle[torch.Tensor]] = field(default_factory=list)
    result: torch.Tensor | None = None
    check: bool | None = None
    donate: bool = False


class PriorityQueue:
    """Communication tasks over `comm`, issued by the agreed schedule (see the module docstring).

    `issue_log` lists (key, chunk index) in the order this rank issued them this round.
    """

    def __init__(self, comm: Communicator, config: QueueConfig | None = None) -> None:
        self.comm = comm
        self.config = config or QueueConfig()
        self._order: list[TaskKey] = []
        self._tasks: dict[TaskKey, _Task] = {}
        self._in_flight: deque[Handle[torch.Tensor]] = deque()
        self.issue_log: list[tuple[TaskKey, int]] = []
        self._start_schedule([])

    def _start_schedule(self, ready_order: list[TaskKey]) -> None:
        """The schedule's replay state: which tasks count as ready, chunks placed, budget."""
        self._ready_order = ready_order
        self._ready: list[TaskKey] = []  # kept sorted: the first with chunks left goes next
        self._placed: dict[TaskKey, int] = {}  # chunks of each ready task already issued
        self._budget = 0  # chunks still to place before the next task becomes ready

    def expect(self, keys: Iterable[TaskKey], ready_order: Sequence[TaskKey] | None = None) -> None:
        """Start a round of these tasks (the same keys on every rank, in any order).

        ready_order: the order in which the tasks are declared to become ready (the same on
        every rank; for gradients, the reverse of the layers' forward order). Default: key
        order, which issues everything in key order.
        """
        self._refuse_if_broken("PriorityQueue.expect", "no new round can start")
        if self._tasks and len(self._tasks) < len(self._order):  # a round nobody submitted to may be dropped
            missing = [k for k in self._order if k not in self._tasks]
            raise InputError(f"PriorityQueue.expect: the last round still waits for {missing}; submit them first")
        order = sorted(keys)
        if len(set(order)) != len(order):
            raise InputError(f"PriorityQueue.expect: keys repeat in {order}; give every task its own key")
        ready = list(ready_order) if ready_order is not None else order
        if sorted(ready) != order:
            raise InputError(
                f"PriorityQueue.expect: ready_order {ready} must list exactly the round's keys {order}, once each"
            )
        # the last round's chunks may still be in flight (their handles wait for them); they were
        # all issued, so every rank's order is unchanged
        self._order, self._tasks, self.issue_log = order, {}, []
        self._start_schedule(ready)

    def expects(self, key: TaskKey) -> bool:
        """Whether `key` is in this round and not submitted yet."""
        return key in self._order and key not in self._tasks

    def submit(
        self,
        key: TaskKey,
        tensor: torch.Tensor,
        op: str = "all_reduce",
        reduce: str = "sum",
        send_splits: Sequence[int] | None = None,
        recv_splits: Sequence[int] | None = None,
        check: bool | None = None,
        donate: bool = False,
    ) -> Handle[torch.Tensor]:
        """Queue `op` on `tensor`; returns a handle whose `wait()` gives the result.

        all_reduce: `reduce` is "sum" or "avg", the tensor keeps its shape. all_to_all: rows
        split by `send_splits`, and `recv_splits` must be given (nothing is exchanged
        first, so the queue never issues a collective the keys did not order).
        check: compare the all-reduce's tensor across ranks before its first chunk (None:
        `CommConfig.check_inputs`); a caller whose shapes were agreed once passes False, since
        the check is a rendezvous that stalls whatever issues it (a backward hook). donate:
        `tensor` is the caller's scratch, summed in place where the engine can
        (`Communicator.all_reduce`); the result is then `tensor` itself, with no copy.
        """
        if key not in self._order or key in self._tasks:
            why = "was already submitted" if key in self._tasks else f"is not in this round {self._order}"
            raise InputError(f"PriorityQueue.submit: task {key} {why}; call expect() with every task's key first")
        if op not in TASK_OPS or reduce not in REDUCE_OPS:
            raise InputError(f"PriorityQueue.submit: op={op!r}, reduce={reduce!r}; use {TASK_OPS} and {REDUCE_OPS}")
        if op == "all_to_all" and (send_splits is None or recv_splits is None):
            raise InputError(f"PriorityQueue.submit: all_to_all task {key} needs both send_splits and recv_splits")
        if op == "all_reduce":
            per_chunk = max(1, self.config.chunk_bytes // tensor.element_size())
            chunks = list(tensor.detach().reshape(-1).split(per_chunk)) or [tensor.detach().reshape(-1)]
        else:
            chunks = [tensor.detach()]
        send = [int(s) for s in send_splits] if send_splits is not None else None
        recv = [int(s) for s in recv_splits] if recv_splits is not None else None
        # a strided tensor's reshape is a copy: summing into that would leave `tensor` as it was
        donate = donate and tensor.is_contiguous()
        task = _Task(key, tensor, op, reduce, send, recv, chunks, check=check, donate=donate)
        self._tasks[key] = task
        self._pump()
        return Handle(lambda: self._finish(task))

    def _next_chunk(self) -> TaskKey | None:
        """The schedule's next task (None when the round is done), replaying readiness.

        Depends only on the keys, the ready order and the chunk counts of tasks already
        issued from, so it is the same on every rank. A ready task not yet submitted here
        is still chosen: it has at least one chunk, and the rank waits for it.
        """
        while True:
            all_ready = len(self._ready) == len(self._ready_order)
            if self._budget > 0 or all_ready:
                for key in self._ready:
                    task = self._tasks.get(key)
                    if task is None or self._placed[key] < len(task.chunks):
                        return key
                if all_ready:
                    return None
            key = self._ready_order[len(self._ready)]
            self._ready.append(key)
            self._ready.sort()
            self._placed[key] = 0
            self._budget = self.config.chunks_per_ready

    def _pump(self) -> None:
        """Issue the schedule's chunks for as long as their tasks are submitted on this rank."""
        while (key := self._next_chunk()) is not None and key in self._tasks:
            task, index = self._tasks[key], self._placed[key]
            if len(self._in_flight) >= self.config.max_in_flight:
                self._in_flight.popleft().wait()
            task.pending.append(self._issue(task, index))
            self._in_flight.append(task.pending[-1])
            self.issue_log.append((key, index))
            self._placed[key] += 1
            self._budget -= 1

    def _issue(self, task: _Task, index: int) -> Handle[torch.Tensor]:
        comm, chunk = self.comm, task.chunks[index]
        if task.op == "all_to_all":
            return comm.start_all_to_all(chunk, task.send, task.recv, check=False).handle
        check = comm.config.check_inputs if task.check is None else task.check
        if index == 0 and check:  # once per task: a check per chunk would block each
            comm.agree_tensor(task.tensor, f"queued all_reduce({task.reduce}) of {task.key} on {comm.where}")
        return comm.all_reduce(chunk, task.reduce, async_op=True, check=False, donate=task.donate)  # type: ignore[return-value]

    def _finish(self, task: _Task) -> torch.Tensor:
        if task.result is None:
            if len(task.pending) < len(task.chunks):
                unissued = "the round's remaining chunks will never be issued"
                self._refuse_if_broken(f"PriorityQueue: task {task.key}", unissued)
                missing = [self._next_chunk()]
                raise InputError(
                    f"PriorityQueue: task {task.key} waits behind unsubmitted {missing}; "
                    "submit those before waiting (every rank issues in the same agreed order)"
                )
            parts = [h.wait() for h in task.pending]
            if task.op != "all_reduce":
                task.result = parts[0]
            elif all(p is c for p, c in zip(parts, task.chunks, strict=True)):  # summed in place: donated
                task.result = task.tensor
            else:
                task.result = torch.cat(parts).view(task.tensor.shape)
        return task.result

    def _refuse_if_broken(self, what: str, so: str) -> None:
        """After a chunk failed, the round's unissued chunks never will be: say so, not that the
        caller left a task unsubmitted (which is what an unissued chunk means otherwise)."""
        if self.comm.broken is not None:
            raise CollectiveError(
                f"{what} on {self.comm.where}: the queue's communicator is broken, so {so}: {self.comm.broken}"
            )
