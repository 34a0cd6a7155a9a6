"""Communicator over torch.distributed: gloo for CPU tensors, nccl for CUDA tensors."""

from __future__ import annotations

import datetime
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sparta.comm.communicator import Communicator, require_world_parent
from sparta.comm.config import CommConfig
from sparta.comm.handle import Handle, engine_failure
from sparta.comm.launch import LaunchInfo
from sparta.errors import ConfigError

# torch 2.13 renamed all_gather_into_tensor (deprecating the old name); earlier torch has only that
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def process_group_backend(device: str | torch.device) -> str:
    """The torch.distributed backend for work on ``device``: gloo on CPU, and on CUDA nccl
    beside gloo, since a communicator moves small CPU tensors too (splits, input checks)."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


def cpu_problem(backend_config: str, ranks: list[int]) -> str | None:
    """Why a process group of ``backend_config`` (device:backend pairs, as
    `dist.get_backend_config` gives them) cannot carry a communicator's CPU tensors, or None."""
    if "cpu:" in backend_config:
        return None
    return (
        f"the process group over ranks {ranks} runs {backend_config!r} alone, and a Sparta communicator also "
        f"moves small CPU tensors (splits, input checks): create it with backend {process_group_backend('cuda')!r}"
    )


_WAIT_SLICE_S = 0.2  # how long Ctrl-C may wait to be seen; each slice that runs out costs one exception


def _wait_interruptibly(work: dist.Work, deadline: float) -> None:
    """`work.wait()` until `deadline` (`time.monotonic()` seconds), in slices of _WAIT_SLICE_S.

    Python runs signal handlers only between bytecodes, so one blocking wait of the whole
    timeout kept Ctrl-C (SIGINT's KeyboardInterrupt, a SIGTERM handler) out until the
    collective ended: 52 s of a 60 s timeout, measured on a rank whose peer never joined.
    A slice that runs out leaves the collective running (c10d's Work::wait only stops
    waiting), so waiting again is safe; an op that ends within a slice returns as soon as
    one blocking wait would. Raises RuntimeError as `work.wait` does (a failure, or
    "Operation timed out!" past `deadline`)."""
    while True:
        left = deadline - time.monotonic()
        try:
            # at least 1 ms: c10d reads a zero timeout as "wait forever"
            work.wait(datetime.timedelta(seconds=max(min(left, _WAIT_SLICE_S), 1e-3)))
            return
        except RuntimeError as exc:
            if work.is_completed():  # it failed, or ended just after the slice ran out
                break
            if time.monotonic() >= deadline or "timed out" not in str(exc):  # not a slice running out
                raise
    work.wait()  # returns at once, or raises the collective's own failure


@dataclass
class _Session:
    """The communicators of one world and the groups split from it."""

    members: weakref.WeakSet[TorchCommunicator] = field(default_factory=weakref.WeakSet)


class TorchCommunicator(Communicator):
    backend = "torch"
    native_reduce_dtypes = frozenset(
        {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.uint8}
    )

    def __init__(
        self, pg: dist.ProcessGroup, config: CommConfig, name: str, session: _Session, owns_world: bool = False
    ) -> None:
        ranks = dist.get_process_group_ranks(pg)
        problem = cpu_problem(dist.get_backend_config(pg), ranks)
        if problem is not None:  # every rank of the group has its backend: all raise alike
            raise ConfigError(problem)
        super().__init__(dist.get_rank(pg), dist.get_world_size(pg), ranks, config, name)
        self.pg: dist.ProcessGroup | None = pg
        self._session = session
        self._owns_world = owns_world
        session.members.add(self)

    @classmethod
    def wrap(cls, pg: dist.ProcessGroup, config: CommConfig) -> TorchCommunicator:
        """Over a process group the caller made and keeps (its own session: shutting it
        down is the caller's)."""
        ranks = dist.get_process_group_ranks(pg)
        return cls(pg, config, f"torch-group{list(ranks)}", _Session())

    @classmethod
    def init_world(cls, launch: LaunchInfo, config: CommConfig) -> TorchCommunicator:
        if dist.is_initialized():
            return cls(dist.group.WORLD, config, "world", _Session())
        timeout = datetime.timedelta(seconds=config.timeout_s)
        # One group serves both devices: collectives on CPU tensors go to gloo, on CUDA to nccl.
        backend = process_group_backend("cuda" if torch.cuda.is_available() else "cpu")
        if torch.cuda.is_available():
            torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
        if launch.size == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(
                backend,
                init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                rank=launch.rank,
                world_size=launch.size,
                timeout=timeout,
            )
        return cls(dist.group.WORLD, config, "world", _Session(), owns_world=True)

    def shutdown(self) -> None:
        """The world's (made by init_world) destroys every group of the world and lets go of
        their ProcessGroup objects: only the object's destructor joins gloo's worker
        threads, and one of those still running when the interpreter finalizes can abort
        the process (exit -6, "terminate called without an active exception") after a run
        that succeeded. Its communicators refuse every call after. A split's: nothing."""
        if not (self._owns_world and dist.is_initialized()):
            return
        dist.destroy_process_group()
        self._owns_world = False
        for comm in list(self._session.members):
            comm.pg = None
            comm._orphans.clear()
            comm._retire("its world was shut down (World.shutdown); start a new one with sparta.init()")

    def _run(self, start: Callable[[], dist.Work], result: torch.Tensor, op: str) -> Handle[torch.Tensor]:
        """Issue `start` (an async torch.distributed call that fills `result`); its errors,
        at issue or at wait, come out as CollectiveError naming the operation."""
        deadline = time.monotonic() + self.config.timeout_s  # from the start, as gloo's own timeout
        try:
            work = start()
        except RuntimeError as exc:
            raise engine_failure(exc, op) from exc

        def wait() -> torch.Tensor:
            try:
                if result.device.type == "cpu":
                    # the communicator's timeout, not the group's: a group made elsewhere
                    # (`dist.new_group`, `init_device_mesh`) has torch's 30 minutes by default
                    _wait_interruptibly(work, deadline)
                else:
                    # on CUDA wait() orders the current stream after the op and returns: the CPU
                    # must not block here; NCCL's watchdog aborts on the group's timeout
                    work.wait()
            except RuntimeError as exc:
                raise engine_failure(exc, op) from exc
            return result

        return Handle(wait)

    def _all_to_all_bytes(self, buf: torch.Tensor, send: list[int], recv: list[int], op: str) -> Handle[torch.Tensor]:
        out = torch.empty(sum(recv), dtype=torch.uint8, device=buf.device)
        return self._run(lambda: dist.all_to_all_single(out, buf, recv, send, group=self.pg, async_op=True), out, op)

    def _all_gather_bytes(self, buf: torch.Tensor, counts: list[int], op: str) -> Handle[torch.Tensor]:
        # One flat output: the list form copies through a flat buffer of its own on nccl.
        width = max(counts)
        out = torch.empty(len(counts) * width, dtype=torch.uint8, device=buf.device)
        if all(c == width for c in counts):  # the common case: the gathered buffer is the result
            return self._run(lambda: _gather_single(out, buf, group=self.pg, async_op=True), out, op)
        # the engines gather equal sizes only: pad to the largest and cut after
        padded = torch.zeros(width, dtype=torch.uint8, device=buf.device)
        padded[: buf.numel()] = buf
        gathered = self._run(lambda: _gather_single(out, padded, group=self.pg, async_op=True), out, op)
        return gathered.then(
            lambda flat: torch.cat([row[:c] for row, c in zip(flat.view(len(counts), width), counts, strict=True)])
        )

    def _broadcast_bytes(self, buf: torch.Tensor, src: int, op: str) -> Handle[torch.Tensor]:
        return self._run(lambda: dist.broadcast(buf, group_src=src, group=self.pg, async_op=True), buf, op)

    def _all_reduce(self, x: torch.Tensor, op: str, donate: bool = False) -> Handle[torch.Tensor]:
        y = x if donate else x.clone()
        return self._run(lambda: dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.pg, async_op=True), y, op)

    def _split(self, groups: list[list[int]], mine: int | None, config: CommConfig) -> Communicator | None:
        require_world_parent(
            self,
            dist.get_world_size(),
            "torch.distributed names a new group after how many groups each "
            "process has made, so every world rank must create every group",
        )
        # Every world rank creates every group, in the same order, so group names and
        # rendezvous keys agree; a rank outside a group gets NON_GROUP_MEMBER back.
        timeout = datetime.timedelta(seconds=config.timeout_s)
        try:
            made = [dist.new_group(g, timeout=timeout) for g in groups]
        except RuntimeError as exc:  # a late or lost rank: the store's wait or gloo's connect timed out
            raise engine_failure(exc, self._op(f"split into groups {groups}")) from exc
        if mine is None:
            return None
        return TorchCommunicator(made[mine], config, f"{self.name}{groups[mine]}", self._session)
