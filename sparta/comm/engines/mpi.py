"""Communicator over MPI through mpi4py.

CPU tensors are handed to MPI as zero-copy numpy views; CUDA tensors are staged through
host memory (a CUDA-aware MPI could take device pointers, but mpi4py cannot tell us whether
the library is one).

Each communicator runs its MPI calls, in issue order, on a thread of its own, as blocking
calls: Open MPI's blocking collectives are 1.6-2.7x faster than its non-blocking ones
(libnbc; 64 MiB all-to-all on 4 ranks here: 37 ms vs 100 ms), and a non-blocking call
progresses only inside MPI calls, so it never overlaps the caller's compute, while the
thread's call (mpi4py releases the GIL) does. The caller waits on the call's future until
the communicator's timeout, counted from when the thread began the call, so a stuck
collective still raises CollectiveTimeoutError instead of hanging. Needs
MPI_THREAD_MULTIPLE (what mpi4py asks for by default).

MPI-3 counts and displacements are C ints: a call of more bytes than fit counts them in
units of a divisor of their greatest common divisor (a contiguous type of that many bytes,
at least a row of the call, since counts are whole rows), so a call moves up to 2**31 - 1
rows a rank, not bytes (2.25 GiB a rank each way, one all-to-all of 4 KiB rows on 2 ranks,
here); below that, plain bytes, which MPI segments and pipelines.

The threads end at shutdown (see `MPICommunicator`), which leaves none behind unless a call
is stuck inside MPI after a timeout; a split, too, times out instead of hanging when a
rank never joins it.

When a rank dies (Open MPI 4.1, measured by tests/test_faults.py): plain mpirun kills the
whole job at once and prints which rank died and by which signal; the survivors say
nothing. With `mpirun --mca orte_enable_recovery 1` the survivors keep running and their
pending collective raises CollectiveTimeoutError after `timeout_s` (MPI itself never
reports the dead peer: that needs ULFM, Open MPI 5); a survivor whose call thread is still
stuck there at shutdown ends with MPI_Abort at exit (status 1) rather than MPI_Finalize,
which could wait forever. mpirun then exits 0 whatever its ranks returned: read their output.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from sparta.comm.communicator import Communicator
from sparta.comm.config import CommConfig
from sparta.comm.engines import import_engine
from sparta.comm.handle import Handle, engine_failure
from sparta.comm.launch import LaunchInfo
from sparta.errors import BackendUnavailableError, CollectiveError, CollectiveTimeoutError, InputError

log = logging.getLogger("sparta.comm")

_MAX_COUNT = 2**31 - 1  # MPI-3 counts are C ints
# A call that outlived its timeout ends moments after a late peer joins it, but on its own
# thread: shutdown gives the stuck calls this long, together (a CI run lost that race with
# no wait at all), and a failed job's shutdown is no longer than that.
_LATE_PEER_GRACE_S = 5.0


@dataclass(eq=False)
class _Call:
    """One call queued on a call thread. Its timeout counts from `began`, when the thread
    began it (from `queued` while it waits behind another call): k collectives that peers
    never join then time out together, not one timeout after another."""

    run: Callable[[], Any]
    done: Future[Any] = field(default_factory=Future)
    queued: float = field(default_factory=time.monotonic)
    began: float | None = None

    def deadline(self, timeout_s: float) -> float:
        return (self.queued if self.began is None else self.began) + timeout_s


def _serve(calls: queue.SimpleQueue[_Call | None]) -> None:
    """A call thread's loop, until it takes None. A function of the queue alone, so that the
    thread holds no reference to its communicator, which can then be collected."""
    while (call := calls.get()) is not None:
        call.began = time.monotonic()
        try:
            call.done.set_result(call.run())
        except BaseException as exc:  # handed to the waiting caller, not lost in this thread
            call.done.set_exception(exc)


class _CallThread:
    """The thread that runs one communicator's MPI calls one after the other. Daemon: a call
    stuck in MPI after a timeout can never be joined and must not keep the process alive."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self.stopped = False
        self.timed_out = False  # a call outlived its caller's wait: the thread may be stuck
        self._last: _Call | None = None
        self._thread = threading.Thread(target=_serve, args=(self._calls,), name=f"sparta-mpi-{name}", daemon=True)
        self._thread.start()

    def submit(self, run: Callable[[], Any]) -> _Call:
        call = _Call(run)
        self._calls.put(call)
        self._last = call
        return call

    def close(self) -> None:
        """Let the thread end once the calls queued before have run (without waiting: the
        last reference to a communicator may well be dropped on its own thread)."""
        if not self.stopped:
            self._calls.put(None)
            self.stopped = True

    def join(self, since: float, timeout_s: float) -> bool:
        """Wait, after `close`, for the thread to end until `since + timeout_s`; False if it
        is still in a call then (a collective its peers never joined). Where a call already
        timed out and is still running, only until `since` plus the smaller of `timeout_s`
        and `_LATE_PEER_GRACE_S`: a peer that joined late has let the call end by then, a
        dead one never will."""
        late = self.timed_out and self._last is not None and not self._last.done.done()
        until = since + (min(timeout_s, _LATE_PEER_GRACE_S) if late else timeout_s)
        self._thread.join(max(0.0, until - time.monotonic()))
        return not self._thread.is_alive()


@dataclass
class _Group:
    """One MPI communicator and its call thread: what shutdown must release."""

    mpicomm: Any
    thread: _CallThread
    freed: bool = False


@dataclass
class _Session:
    """What the world communicator and every split of it share: whether this process
    finalizes MPI, and every group made, in creation order, to be freed before it does."""

    owns_mpi: bool
    groups: list[_Group] = field(default_factory=list)


class MPICommunicator(Communicator):
    """A group over MPI. `shutdown()` of a split (called by all its members: MPI_Comm_free
    is collective) stops its thread and frees it; the world's shuts down every split not
    yet shut down, in creation order, then finalizes MPI. A split dropped without shutdown
    stops its thread when collected; its MPI communicator is freed with the world's."""

    backend = "mpi"
    max_call_rows = _MAX_COUNT  # in units of at least a row (`_units`)
    native_reduce_dtypes = frozenset(
        {torch.float32, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}
    )

    def __init__(self, mpicomm: Any, config: CommConfig, name: str, session: _Session) -> None:
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise BackendUnavailableError(
                "the mpi engine needs MPI_THREAD_MULTIPLE but MPI was initialised with a lower thread "
                "level: leave mpi4py.rc.thread_level at its default ('multiple') and use an MPI built with it"
            )
        world_group = MPI.COMM_WORLD.Get_group()
        ranks = mpicomm.Get_group().Translate_ranks(list(range(mpicomm.Get_size())), world_group)
        super().__init__(mpicomm.Get_rank(), mpicomm.Get_size(), ranks, config, name)
        self.mpi = mpicomm
        self._MPI = MPI
        self._session = session
        self._group = _Group(mpicomm, _CallThread(name))
        session.groups.append(self._group)
        weakref.finalize(self, self._group.thread.close).atexit = False

    @classmethod
    def init_world(cls, launch: LaunchInfo, config: CommConfig) -> MPICommunicator:
        MPI: Any = import_engine(
            "mpi4py.MPI",
            "mpi",
            "mpi4py: pip install 'sparta[mpi]' (and an MPI library: apt-get install openmpi-bin libopenmpi-dev)",
        )
        return cls(MPI.COMM_WORLD, config, "world", _Session(owns_mpi=True))

    def shutdown(self) -> None:
        if self.mpi is not self._MPI.COMM_WORLD:
            self._release([self._group])
            return
        if self._release(self._session.groups) and self._session.owns_mpi and not self._MPI.Is_finalized():
            self._MPI.Finalize()
        self._session.owns_mpi = False

    def _release(self, groups: list[_Group]) -> bool:
        """Stop the groups' threads and free their communicators, in order; False where a
        thread is stuck in a call its peers never joined (then MPI_Comm_free and
        MPI_Finalize would wait for it forever: the job has failed, so leave them undone
        and let the launcher report it)."""
        for g in groups:
            g.thread.close()
        since = time.monotonic()  # one wait for all: each stuck thread would add its own
        stuck = [g for g in groups if not g.thread.join(since, self.config.timeout_s)]
        if stuck:
            log.warning("sparta mpi: %d call thread(s) still inside MPI at shutdown; aborting MPI at exit", len(stuck))
            # mpi4py would still call MPI_Finalize at exit, which with a thread stuck beside
            # a dead peer hangs now and then (1 in 15 runs of a 3-rank kill under
            # orte_enable_recovery). This asks it for MPI_Abort instead, after every
            # finally block and atexit handler has run: 0 hangs in 45.
            from mpi4py.run import set_abort_status

            set_abort_status(1)
            return False
        for g in groups:
            if not g.freed and g.mpicomm is not self._MPI.COMM_WORLD:
                g.mpicomm.Free()
            g.freed = True
        return True

    # ---------------------------------------------------------------- plumbing
    @staticmethod
    def _host(x: torch.Tensor) -> Any:
        return x.detach().cpu().numpy()

    def _run(
        self, call: Callable[[], Any], result: torch.Tensor, device: torch.device, op: str
    ) -> Handle[torch.Tensor]:
        """Queue ``call`` (which fills ``result``) on this communicator's thread. The closure
        holds the buffers, so they live until MPI is done with them even if the caller drops
        the handle."""
        queued = self._submit(call, op)

        def wait() -> torch.Tensor:
            self._wait(queued, op)
            return result.to(device)

        return Handle(wait)

    def _submit(self, call: Callable[[], Any], op: str) -> _Call:
        if self._group.thread.stopped:
            raise CollectiveError(f"{op}: this communicator was shut down; use one that is still open")
        return self._group.thread.submit(call)

    def _wait(self, call: _Call, op: str) -> Any:
        """The result of a call on this communicator's thread, within the timeout counted
        from when the thread began it (`_Call`); MPI's own errors come out as
        CollectiveError naming the operation."""
        timeout_s = self.config.timeout_s
        while True:
            try:
                return call.done.result(timeout=max(0.0, call.deadline(timeout_s) - time.monotonic()))
            except FutureTimeout:
                if call.done.done() or time.monotonic() < call.deadline(timeout_s):  # it ended, or began, meanwhile
                    continue
                self._group.thread.timed_out = True
                raise CollectiveTimeoutError(f"{op} did not complete within {timeout_s:g} s") from None
            except self._MPI.Exception as exc:
                raise engine_failure(exc, op) from exc

    def _units(self, counts: list[int]) -> tuple[int, list[int]]:
        """`counts` (bytes) as (unit bytes, counts in units). Bytes where their sum fits 32-bit
        MPI counts and displacements (MPI segments and pipelines those); past that, units of a
        divisor of their greatest common divisor (at least a row of the call, whose counts
        are whole rows) that fits an int itself, so one call moves up to 2**31 - 1 units."""
        limit = self.max_call_rows
        common = math.gcd(*counts)
        if sum(counts) <= limit or common <= 1:
            return 1, counts
        # the largest divisor of `common` within the limit, looked for a little way only
        first = -(-common // limit)
        unit = next((common // k for k in range(first, first + 4096) if common % k == 0), 1)
        return unit, [c // unit for c in counts]

    def _unit_type(self, unit: int) -> Any:
        """A committed MPI type of `unit` contiguous bytes (free it after the call, unless BYTE)."""
        return self._MPI.BYTE if unit == 1 else self._MPI.BYTE.Create_contiguous(unit).Commit()

    def _typed_call(self, units: tuple[int, ...], call: Callable[..., Any]) -> Callable[[], Any]:
        """`call(*types)` on the call thread with a type per unit, freed once MPI is done."""

        def run() -> Any:
            types = [self._unit_type(u) for u in units]
            try:
                return call(*types)
            finally:
                for t in types:
                    if t != self._MPI.BYTE:
                        t.Free()

        return run

    def _check_units(self, counts: list[int], op: str) -> tuple[int, list[int]]:
        """`_units` of `counts` (a gather's, a broadcast's: the same on every rank, so every
        rank raises alike where they are too many)."""
        unit, units = self._units(counts)
        if sum(units) > self.max_call_rows:
            raise InputError(
                f"{op}: the MPI engine moves at most {self.max_call_rows} units a call (32-bit MPI counts; a unit "
                f"is a size dividing every rank's bytes, here {unit}), asked for {sum(units)}; split the "
                "tensor into smaller calls"
            )
        return unit, units

    @staticmethod
    def _displs(counts: list[int]) -> list[int]:
        return [0, *accumulate(counts)][:-1]

    # ---------------------------------------------------------------- primitives
    def _all_to_all_bytes(self, buf: torch.Tensor, send: list[int], recv: list[int], op: str) -> Handle[torch.Tensor]:
        (su, send_units), (ru, recv_units) = self._units(send), self._units(recv)
        if max(sum(send_units), sum(recv_units)) > self.max_call_rows:
            # start_all_to_all refuses a part of more rows than this first (on every rank
            # where checks are on or the splits are exchanged), and a unit is a row at least,
            # unless `_units` found no divisor near the bound (rows of kilobytes, terabytes a
            # call): then only this rank knows, and its peers time out
            raise CollectiveError(
                f"{op}: the MPI engine moves at most {self.max_call_rows} units a call each way (32-bit MPI counts and "
                f"displacements); this rank would send {sum(send_units)} of {su} bytes and receive "
                f"{sum(recv_units)} of {ru}: split the exchange into smaller calls (its peers wait for this one "
                "until their timeout)"
            )
        src = self._host(buf)
        out = torch.empty(sum(recv), dtype=torch.uint8)
        send_spec, recv_spec = (send_units, self._displs(send_units)), (recv_units, self._displs(recv_units))

        def call(send_type: Any, recv_type: Any) -> None:
            self.mpi.Alltoallv([src, send_spec, send_type], [out.numpy(), recv_spec, recv_type])

        return self._run(self._typed_call((su, ru), call), out, buf.device, op)

    def _all_gather_bytes(self, buf: torch.Tensor, counts: list[int], op: str) -> Handle[torch.Tensor]:
        unit, units = self._check_units(counts, op)
        src = self._host(buf)
        out = torch.empty(sum(counts), dtype=torch.uint8)
        spec = (units, self._displs(units))

        def call(t: Any) -> None:
            self.mpi.Allgatherv([src, units[self.rank], t], [out.numpy(), spec, t])

        return self._run(self._typed_call((unit,), call), out, buf.device, op)

    def _broadcast_bytes(self, buf: torch.Tensor, src: int, op: str) -> Handle[torch.Tensor]:
        unit, units = self._check_units([buf.numel()], op)
        host = buf.cpu()

        def call(t: Any) -> None:
            self.mpi.Bcast([host.numpy(), units[0], t], root=src)

        return self._run(self._typed_call((unit,), call), host, buf.device, op)

    def _all_reduce(self, x: torch.Tensor, op: str, donate: bool = False) -> Handle[torch.Tensor]:
        # donate is not taken: the sum lands in a host buffer of its own (x may be on a GPU)
        src = self._host(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        return self._run(lambda: self.mpi.Allreduce(src, out.numpy(), op=self._MPI.SUM), out, x.device, op)

    def _split(self, groups: list[list[int]], mine: int | None, config: CommConfig) -> Communicator | None:
        MPI = self._MPI
        # One collective Split over the parent makes every group at once.
        # On this communicator's thread, after the calls queued before it: MPI orders the
        # collectives of one communicator by their issue order, which only one thread keeps.
        op = self._op(f"split into groups {groups}")
        try:
            sub = self._wait(
                self._submit(lambda: self.mpi.Split(MPI.UNDEFINED if mine is None else mine, self.rank), op), op
            )
        except CollectiveError as exc:
            self._break(str(exc))
            raise
        if sub == MPI.COMM_NULL:
            return None
        members = [self.ranks[r] for r in groups[mine]]  # type: ignore[index]
        return MPICommunicator(sub, config, f"{self.name}{members}", self._session)
