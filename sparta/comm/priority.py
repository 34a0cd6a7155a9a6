"""A priority queue of communication tasks, issued in an order every rank agrees on.

Two dimensions (EmbRace's 2D scheduling): across tasks, a priority key (the layer's position
in the next forward, the embedding first, with a name to break ties); inside a task, chunks
of at most `chunk_bytes`, so a task's all-reduce is many small collectives and the window
of chunks in flight bounds how long anything queued behind it waits.

Ranks must issue collectives in the same order or they deadlock. So the order is a pure
function of the keys: each round declares its tasks (`expect`), every rank sorts them the
same way, and a task is issued when it and every task before it have been submitted on this
rank. Submitting in another order, or later, changes when a rank issues, never what.

    q = PriorityQueue(comm, QueueConfig(chunk_bytes=1 << 20))
    q.expect([TaskKey(0, "emb"), TaskKey(1, "block.0"), TaskKey(2, "head")])
    h = q.submit(TaskKey(2, "head"), grad)          # may issue nothing yet
    ...                                              # the other submits
    reduced = h.wait()                               # every rank's grad, summed
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from sparta.comm import checks
from sparta.comm.communicator import REDUCE_OPS, Communicator
from sparta.comm.handle import Handle
from sparta.errors import ConfigError, InputError

TASK_OPS = ("all_reduce", "all_to_all")


@dataclass(frozen=True, order=True)
class TaskKey:
    """Issue order: lower `priority` first, then `name` (the same string on every rank)."""

    priority: int
    name: str


@dataclass(frozen=True)
class QueueConfig:
    """chunk_bytes: an all-reduce is cut into pieces of at most this many bytes.
    max_in_flight: chunks issued and not yet completed; issuing one more waits for the oldest.
    All-to-all tasks travel whole (their chunk boundaries would need every rank's splits)."""

    chunk_bytes: int = 4 << 20
    max_in_flight: int = 4

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1 or self.max_in_flight < 1:
            raise ConfigError(
                f"QueueConfig(chunk_bytes={self.chunk_bytes}, max_in_flight={self.max_in_flight}): both must be >= 1"
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


class PriorityQueue:
    """Communication tasks over `comm`, issued in key order (see the module docstring).

    `issue_log` lists (key, chunk index) in the order this rank issued them this round.
    """

    def __init__(self, comm: Communicator, config: QueueConfig | None = None) -> None:
        self.comm = comm
        self.config = config or QueueConfig()
        self._order: list[TaskKey] = []
        self._tasks: dict[TaskKey, _Task] = {}
        self._next = 0  # index in _order of the first task not fully issued
        self._chunk = 0  # chunks of that task already issued
        self._in_flight: deque[Handle[torch.Tensor]] = deque()
        self.issue_log: list[tuple[TaskKey, int]] = []

    def expect(self, keys: Iterable[TaskKey]) -> None:
        """Start a round of these tasks (the same keys on every rank, in any order)."""
        if self._tasks and self._next < len(self._order):  # a round nobody submitted to may be dropped
            missing = [k for k in self._order[self._next :] if k not in self._tasks]
            raise InputError(f"PriorityQueue.expect: the last round still waits for {missing}; submit them first")
        order = sorted(keys)
        if len(set(order)) != len(order):
            raise InputError(f"PriorityQueue.expect: keys repeat in {order}; give every task its own key")
        self._drain()
        self._order, self._tasks, self._next, self._chunk, self.issue_log = order, {}, 0, 0, []

    def submit(
        self,
        key: TaskKey,
        tensor: torch.Tensor,
        op: str = "all_reduce",
        reduce: str = "sum",
        send_splits: Sequence[int] | None = None,
        recv_splits: Sequence[int] | None = None,
    ) -> Handle[torch.Tensor]:
        """Queue `op` on `tensor`; returns a handle whose `wait()` gives the result.

        all_reduce: `reduce` is "sum" or "avg", the tensor keeps its shape. all_to_all: rows
        split by `send_splits`, and `recv_splits` must be given (nothing is exchanged
        first, so the queue never issues a collective the keys did not order).
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
        task = _Task(key, tensor, op, reduce, send, recv, chunks)
        self._tasks[key] = task
        self._pump()
        return Handle(lambda: self._finish(task))

    def _pump(self) -> None:
        """Issue, in key order, every chunk whose task and predecessors are submitted."""
        while self._next < len(self._order) and self._order[self._next] in self._tasks:
            task = self._tasks[self._order[self._next]]
            while self._chunk < len(task.chunks):
                if len(self._in_flight) >= self.config.max_in_flight:
                    self._in_flight.popleft().wait()
                task.pending.append(self._issue(task, self._chunk))
                self._in_flight.append(task.pending[-1])
                self.issue_log.append((task.key, self._chunk))
                self._chunk += 1
            self._next, self._chunk = self._next + 1, 0

    def _issue(self, task: _Task, index: int) -> Handle[torch.Tensor]:
        comm, chunk = self.comm, task.chunks[index]
        if task.op == "all_to_all":
            return comm.all_to_all(chunk, task.send, task.recv, async_op=True, check=False)  # type: ignore[return-value]
        name = comm._op(f"queued all_reduce({task.reduce}) of {task.key} chunk {index}")
        if index == 0:  # one agreed shape/dtype check per task, not per chunk (that would block each)
            comm._agree(task.tensor, checks.OK, name, same_dim0=True)
        wide = comm._reduce_prep(chunk, task.reduce, name)
        return comm._all_reduce(wide, name).then(lambda y: comm._reduce_finish(y, chunk, task.reduce))

    def _finish(self, task: _Task) -> torch.Tensor:
        if task.result is None:
            if len(task.pending) < len(task.chunks):
                missing = [k for k in self._order[: self._order.index(task.key)] if k not in self._tasks]
                raise InputError(
                    f"PriorityQueue: task {task.key} waits behind unsubmitted {missing}; "
                    "submit those before waiting (every rank issues in key order)"
                )
            parts = [h.wait() for h in task.pending]
            task.result = torch.cat(parts).view(task.tensor.shape) if task.op == "all_reduce" else parts[0]
        return task.result

    def _drain(self) -> None:
        while self._in_flight:
            self._in_flight.popleft().wait()
