"""Communicator over MPI through mpi4py.

CPU tensors are handed to MPI as zero-copy numpy views; CUDA tensors are staged through
host memory (a CUDA-aware MPI could take device pointers, but mpi4py cannot tell us whether
the library is one). Non-blocking MPI calls plus polling let a stuck collective raise
CollectiveTimeoutError instead of hanging.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from sparta.comm.communicator import CommConfig, Communicator
from sparta.comm.engines import import_engine
from sparta.comm.handle import Handle, poll_until_done
from sparta.comm.launch import LaunchInfo
from sparta.errors import CollectiveTimeoutError, InputError

_MAX_COUNT = 2**31 - 1  # MPI-3 counts are C ints


@dataclass
class _Session:
    """State shared by the world communicator and every split of it."""

    owns_mpi: bool
    broken: bool = False


class MPICommunicator(Communicator):
    backend = "mpi"
    native_reduce_dtypes = frozenset(
        {torch.float32, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}
    )

    def __init__(self, mpicomm: Any, config: CommConfig, name: str, session: _Session) -> None:
        from mpi4py import MPI

        world_group = MPI.COMM_WORLD.Get_group()
        ranks = mpicomm.Get_group().Translate_ranks(list(range(mpicomm.Get_size())), world_group)
        super().__init__(mpicomm.Get_rank(), mpicomm.Get_size(), ranks, config, name)
        self.mpi = mpicomm
        self._MPI = MPI
        self._session = session
        # (request, buffers) of non-blocking operations not yet known complete. MPI writes
        # into and reads from the buffers until the request completes, so they must outlive
        # a Handle that the caller drops without waiting (freeing them crashes the process).
        self._in_flight: list[tuple[Any, tuple[Any, ...]]] = []

    @classmethod
    def init_world(cls, launch: LaunchInfo, config: CommConfig) -> MPICommunicator:
        MPI: Any = import_engine(
            "mpi4py.MPI",
            "mpi",
            "mpi4py: pip install 'sparta[mpi]' (and an MPI library: apt-get install openmpi-bin libopenmpi-dev)",
        )
        return cls(MPI.COMM_WORLD, config, "world", _Session(owns_mpi=True))

    def shutdown(self) -> None:
        MPI = self._MPI
        # After a timed-out collective MPI_Finalize would wait for it forever; the job has
        # failed anyway, so leave without finalizing and let the launcher report it.
        if self._session.owns_mpi and not self._session.broken and not MPI.Is_finalized():
            MPI.Finalize()
        self._session.owns_mpi = False

    # ---------------------------------------------------------------- plumbing
    @staticmethod
    def _host(x: torch.Tensor) -> Any:
        return x.detach().cpu().numpy()

    def _handle(
        self, req: Any, result: torch.Tensor, device: torch.device, op: str, keep: tuple[Any, ...]
    ) -> Handle[torch.Tensor]:
        self._in_flight = [(r, bufs) for r, bufs in self._in_flight if not r.Test()]
        self._in_flight.append((req, (result, *keep)))

        def wait() -> torch.Tensor:
            try:
                poll_until_done(req.Test, self.config.timeout_s, lambda: op)
            except CollectiveTimeoutError:
                self._session.broken = True
                raise
            return result.to(device)

        return Handle(wait)

    def _check_counts(self, counts: list[int], op: str) -> None:
        if max(counts, default=0) > _MAX_COUNT or sum(counts) > _MAX_COUNT:
            raise InputError(
                f"{op}: the MPI engine moves at most {_MAX_COUNT} bytes per peer and per call "
                f"(32-bit MPI counts), asked for {max(counts)}; split the tensor into smaller calls"
            )

    @staticmethod
    def _displs(counts: list[int]) -> list[int]:
        return [0, *accumulate(counts)][:-1]

    # ---------------------------------------------------------------- primitives
    def _all_to_all_bytes(self, buf: torch.Tensor, send: list[int], recv: list[int], op: str) -> Handle[torch.Tensor]:
        self._check_counts(send + recv, op)
        src = self._host(buf)
        out = torch.empty(sum(recv), dtype=torch.uint8)
        B = self._MPI.BYTE
        req = self.mpi.Ialltoallv([src, (send, self._displs(send)), B], [out.numpy(), (recv, self._displs(recv)), B])
        return self._handle(req, out, buf.device, op, (src,))

    def _all_gather_bytes(self, buf: torch.Tensor, counts: list[int], op: str) -> Handle[torch.Tensor]:
        self._check_counts(counts, op)
        src = self._host(buf)
        out = torch.empty(sum(counts), dtype=torch.uint8)
        B = self._MPI.BYTE
        req = self.mpi.Iallgatherv([src, B], [out.numpy(), (counts, self._displs(counts)), B])
        return self._handle(req, out, buf.device, op, (src,))

    def _broadcast_bytes(self, buf: torch.Tensor, src: int, op: str) -> Handle[torch.Tensor]:
        self._check_counts([buf.numel()], op)
        host = buf.cpu()
        req = self.mpi.Ibcast([host.numpy(), self._MPI.BYTE], root=src)
        return self._handle(req, host, buf.device, op, ())

    def _all_reduce(self, x: torch.Tensor, op: str) -> Handle[torch.Tensor]:
        src = self._host(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        req = self.mpi.Iallreduce(src, out.numpy(), op=self._MPI.SUM)
        return self._handle(req, out, x.device, op, (src,))

    def _split(self, groups: list[list[int]], mine: int | None, config: CommConfig) -> Communicator | None:
        MPI = self._MPI
        # One collective Split over the parent makes every group at once.
        sub = self.mpi.Split(MPI.UNDEFINED if mine is None else mine, self.rank)
        if sub == MPI.COMM_NULL:
            return None
        members = [self.ranks[r] for r in groups[mine]]  # type: ignore[index]
        return MPICommunicator(sub, config, f"{self.name}{members}", self._session)
