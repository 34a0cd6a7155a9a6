"""Communicator over Horovod (its gloo or MPI controller, whichever horovodrun/mpirun gave).

Horovod's ops are asynchronous handles; polling them turns a stuck collective into
CollectiveTimeoutError. Sub-communicators are Horovod process sets, which Horovod builds only
with every rank of the world taking part. Horovod 0.28 wants int32 all-to-all splits and has
no bfloat16, which the byte-level transport and widened reductions of the base class absorb.

One background loop serves every process set, so a timeout breaks the whole world, and its
shutdown is skipped (it would wait for the lost op forever); Horovod 0.28's loop then
aborts its process (an uncaught gloo::IoException) as soon as a peer exits: a failed job
ends with SIGABRT, after the error was raised and reported.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

from sparta.comm.communicator import Communicator, require_world_parent
from sparta.comm.config import CommConfig
from sparta.comm.engines import import_engine
from sparta.comm.handle import Handle, engine_failure, poll_until_done
from sparta.comm.launch import LaunchInfo
from sparta.errors import CollectiveError, CollectiveTimeoutError


@dataclass
class _Session:
    """State shared by the world communicator and its process sets."""

    hvd: Any
    process_sets: dict[tuple[int, ...], Any] = field(default_factory=dict)
    running: bool = True
    splits: int = 0  # split calls so far, in step on every rank: every rank of the world makes each


class HorovodCommunicator(Communicator):
    backend = "horovod"
    # measured on 0.28.1: its reductions reject uint8, int8, int16, bfloat16 and bool
    native_reduce_dtypes = frozenset({torch.float32, torch.float64, torch.float16, torch.int64, torch.int32})
    failures_span_world = True  # one background loop serves every process set

    def __init__(self, session: _Session, process_set: Any, ranks: list[int], config: CommConfig, name: str) -> None:
        hvd = session.hvd
        rank = ranks.index(hvd.rank())
        super().__init__(rank, len(ranks), ranks, config, name)
        self._session = session
        self._hvd = hvd
        self.process_set = process_set
        self._issued = 0
        # two splits over the same ranks (dp and ep groups alike) must not share op names
        self._tag = f"{name}#{session.splits}"

    def _name(self, kind: str) -> str:
        """Horovod pairs ops across ranks by name; unnamed ops are numbered per process,
        which drifts apart as soon as ranks run different sub-group ops. Numbering per
        communicator stays in step, as every member issues the same ops in the same order."""
        self._issued += 1
        return f"sparta.{self._tag}.{kind}.{self._issued}"

    @classmethod
    def init_world(cls, launch: LaunchInfo, config: CommConfig) -> HorovodCommunicator:
        hvd: Any = import_engine(
            "horovod.torch",
            "horovod",
            "Horovod built for this torch: run `bash scripts/install_horovod.sh .venv` from the Sparta "
            "checkout (PyPI's 0.28.1 sdist does not build against torch >= 2.1 as is)",
        )
        hvd.init(process_sets="dynamic")
        return cls(_Session(hvd), hvd.global_process_set, list(range(hvd.size())), config, "world")

    def shutdown(self) -> None:
        if self.name != "world":
            # A process set lives as long as Horovod. Ending the session here made the world's
            # shutdown skip hvd.shutdown(), left to Horovod's atexit hook, which has no barrier.
            return
        # A timed-out op would keep Horovod's background loop waiting in shutdown forever.
        if self._session.running and self.broken is None:
            # One rank's hvd.shutdown() ends every rank's loop (its flag is OR-ed into the next
            # negotiation), failing the ops its peers still wait for in other process sets: a
            # 4-rank run saw ranks 0-1's last all-gather over [0, 1] fail that way when ranks
            # 2-3 finished theirs first. So leave together.
            try:
                self.barrier()
            except CollectiveError:
                pass  # the barrier broke the world: its loop may be waiting on a lost op
            if self.broken is None:
                self._hvd.shutdown()
        self._session.running = False

    def _handle(self, start: Callable[[], Any], op: str, post: Any = None) -> Handle[torch.Tensor]:
        """Issue `start` (a Horovod *_async call) and wait for it by polling; its errors, at
        issue (a loop already shut down by a lost peer) or at wait, come out as
        CollectiveError naming the operation."""
        hvd = self._hvd
        issued = time.monotonic()
        try:
            handle = start()
        except Exception as exc:  # HorovodInternalError and friends carry no common base
            raise engine_failure(exc, op) from exc

        def wait() -> torch.Tensor:
            try:
                poll_until_done(lambda: hvd.poll(handle), self.config.timeout_s, lambda: op, issued)
                out = hvd.synchronize(handle)
            except CollectiveError:  # poll_until_done's timeout, already named
                raise
            except Exception as exc:
                raise engine_failure(exc, op) from exc
            return post(out) if post else out

        return Handle(wait)

    def _all_to_all_bytes(self, buf: torch.Tensor, send: list[int], recv: list[int], op: str) -> Handle[torch.Tensor]:
        splits = torch.tensor(send, dtype=torch.int32)
        name, ps = self._name("alltoall"), self.process_set
        # alltoall returns (tensor, received splits) when splits are given
        return self._handle(
            lambda: self._hvd.alltoall_async(buf, splits=splits, name=name, process_set=ps),
            op,
            post=lambda out: out[0] if isinstance(out, tuple) else out,
        )

    def _all_gather_bytes(self, buf: torch.Tensor, counts: list[int], op: str) -> Handle[torch.Tensor]:
        name = self._name("allgather")
        return self._handle(lambda: self._hvd.allgather_async(buf, name=name, process_set=self.process_set), op)

    def _broadcast_bytes(self, buf: torch.Tensor, src: int, op: str) -> Handle[torch.Tensor]:
        name, root = self._name("broadcast"), self.ranks[src]
        return self._handle(
            lambda: self._hvd.broadcast_async(buf, root_rank=root, name=name, process_set=self.process_set), op
        )

    def _all_reduce(self, x: torch.Tensor, op: str, donate: bool = False) -> Handle[torch.Tensor]:
        # donate is not taken: Horovod's out-of-place allreduce_async returns its own tensor
        name = self._name("allreduce")
        return self._handle(
            lambda: self._hvd.allreduce_async(x, op=self._hvd.Sum, name=name, process_set=self.process_set), op
        )

    def grouped_sum(self, tensors: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
        """`tensors` summed over this group and times `scale`: Horovod's grouped all-reduce (one
        negotiation, fused), for data_parallel='horovod'. Named and waited like every op here:
        Horovod's name for an unnamed op is this process's count of ops issued in any group, so
        it pairs across ranks only while every rank has issued as many, and hvd.synchronize()
        waits without a timeout."""
        op = self._op(f"grouped all_reduce of {len(tensors)} tensors")
        name, hvd, ps = self._name("grouped_allreduce"), self._hvd, self.process_set

        def start() -> Any:
            return hvd.grouped_allreduce_async(tensors, op=hvd.Sum, name=name, process_set=ps, postscale_factor=scale)

        return self._issue(op, lambda: self._handle(start, op)).wait()  # type: ignore[return-value]

    def _split(self, groups: list[list[int]], mine: int | None, config: CommConfig) -> Communicator | None:
        hvd = self._hvd
        require_world_parent(self, hvd.size(), "Horovod registers a process set with every rank taking part")
        sets = self._session.process_sets
        op = self._op(f"split into groups {groups}")
        self._session.splits += 1
        for g in groups:  # Horovod refuses a duplicate set, so reuse one made before
            key = tuple(g)
            if key not in sets:
                sets[key] = hvd.global_process_set if len(key) == hvd.size() else self._add_process_set(list(key), op)
        if mine is None:
            return None
        members = groups[mine]
        return HorovodCommunicator(self._session, sets[tuple(members)], members, config, f"{self.name}{members}")

    def _add_process_set(self, ranks: list[int], op: str) -> Any:
        """`hvd.add_process_set`, which waits for every rank of the world, within the
        timeout: on a thread of its own, as nothing interrupts Horovod's wait. A rank that
        joins late completes it there, after this rank gave up; the world is broken anyway."""
        made: Future[Any] = Future()

        def add() -> None:
            try:
                made.set_result(self._hvd.add_process_set(ranks))
            except BaseException as exc:  # handed to the waiting caller, not lost in this thread
                made.set_exception(exc)

        threading.Thread(target=add, name="sparta-horovod-split", daemon=True).start()
        try:
            return made.result(timeout=self.config.timeout_s)
        except FutureTimeout:
            failure: CollectiveError = CollectiveTimeoutError(
                f"{op} did not complete within {self.config.timeout_s:g} s"
            )
        except Exception as exc:
            failure = engine_failure(exc, op)
        self._break(str(failure))
        raise failure
