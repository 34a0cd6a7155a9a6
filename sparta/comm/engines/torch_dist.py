"""Communicator over torch.distributed: gloo for CPU tensors, nccl for CUDA tensors."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from sparta.comm.communicator import CommConfig, Communicator, require_world_parent
from sparta.comm.handle import Handle, engine_failure
from sparta.comm.launch import LaunchInfo
from sparta.comm.shm import SharedMemoryAllToAll, group_token, host_identity, row_len
from sparta.comm.shm_rows import SharedRowGather, control_path, ordered_stores


class TorchCommunicator(Communicator):
    backend = "torch"
    native_reduce_dtypes = frozenset(
        {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.uint8}
    )

    def __init__(self, pg: dist.ProcessGroup, config: CommConfig, name: str, owns_world: bool = False) -> None:
        super().__init__(dist.get_rank(pg), dist.get_world_size(pg), dist.get_process_group_ranks(pg), config, name)
        self.pg = pg
        self._owns_world = owns_world
        self._shm: SharedMemoryAllToAll | None = None
        self._rows: SharedRowGather | None = None
        self._shm_decided = False

    @classmethod
    def wrap(cls, pg: dist.ProcessGroup, config: CommConfig) -> TorchCommunicator:
        ranks = dist.get_process_group_ranks(pg)
        return cls(pg, config, name=f"torch-group{list(ranks)}")

    @classmethod
    def init_world(cls, launch: LaunchInfo, config: CommConfig) -> TorchCommunicator:
        if dist.is_initialized():
            return cls(dist.group.WORLD, config, name="world")
        timeout = datetime.timedelta(seconds=config.timeout_s)
        # One group serves both devices: collectives on CPU tensors go to gloo, on CUDA to nccl.
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
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
        return cls(dist.group.WORLD, config, name="world", owns_world=True)

    def shutdown(self) -> None:
        if self._shm is not None:
            self._shm.close()
        if self._rows is not None:
            self._rows.close()
            self._rows = None
        if self._owns_world and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_world = False

    def _handle(self, work: dist.Work, result: torch.Tensor, op: str) -> Handle[torch.Tensor]:
        def wait() -> torch.Tensor:
            try:
                work.wait()
            except RuntimeError as exc:
                raise engine_failure(exc, op) from exc
            return result

        return Handle(wait)

    def _gather_rows(self, row: torch.Tensor, op: str) -> Handle[torch.Tensor]:
        # Every rank's row sent to each peer by gloo's pairwise all-to-all: for a few bytes it
        # answers in 335 us where gloo's all-gather takes 550 us (2 ranks, this machine).
        out = torch.empty(self.size * row.numel(), dtype=row.dtype)
        work = dist.all_to_all_single(out, row.repeat(self.size), group=self.pg, async_op=True)
        return self._handle(work, out.view(self.size, -1), op)

    @property
    def shared_memory(self) -> SharedMemoryAllToAll | None:
        """The shared-memory path of this group's CPU all-to-alls (``CommConfig.shared_memory``),
        or None: before the first CPU all-to-all, or where the ranks cannot share memory."""
        return self._shm

    @property
    def row_gather(self) -> SharedRowGather | None:
        """What synchronises the shared-memory all-to-alls when it is not gloo: the
        /dev/shm row gather (where every rank has a core of its own, on x86-64), or None."""
        return self._rows

    def _shared_memory(self) -> SharedMemoryAllToAll | None:
        """This group's shared-memory all-to-all, set up at its first CPU all-to-all (a
        collective, so every rank decides together), or None where the ranks do not share
        a host, a network namespace and /dev/shm, or (``shared_memory="auto"``) they
        outnumber the host's CPUs."""
        if not self._shm_decided:
            self._shm_decided = True
            if self.config.shared_memory != "off" and self.size > 1:
                op = self._op("all_to_all (shared-memory setup)")
                token = group_token()
                control = self._make_control_file(token)
                mine = [*host_identity(), os.cpu_count() or 1, token, int(control is not None)]
                rows = self._gather_rows(torch.tensor(mine, dtype=torch.int64), op).wait()
                hosts = {tuple(r[:4].tolist()) for r in rows}
                has_cores = self.size <= int(rows[0][4])
                if len(hosts) == 1 and int(rows[0][0]) != 0 and (has_cores or self.config.shared_memory == "on"):
                    gather = self._gather_rows
                    # Its waits spin: only where every rank has a core of its own.
                    if has_cores and all(rows[:, 6].tolist()):
                        self._rows = self._map_control_files([int(t) for t in rows[:, 5]], op)
                        gather = self._rows.gather if self._rows is not None else gather
                    self._shm = SharedMemoryAllToAll(self.rank, self.size, int(rows[0][5]), gather)
                if control is not None:
                    os.unlink(control)  # every rank that maps it has (see _map_control_files)
        return self._shm

    def _make_control_file(self, token: int) -> str | None:
        """This rank's file for `SharedRowGather` (made before the set-up collective, so that
        peers can map it after), or None where that gather cannot serve."""
        if not ordered_stores():
            return None
        path = control_path(token)
        try:
            SharedRowGather.create(path, row_len(self.size))
        except OSError:
            return None
        return path

    def _map_control_files(self, tokens: list[int], op: str) -> SharedRowGather | None:
        """Map every rank's control file; the gather serves only if every rank could (one
        more set-up collective, after which each owner may remove its file)."""
        paths = [control_path(t) for t in tokens]
        mapped: SharedRowGather | None
        try:
            mapped = SharedRowGather(self.rank, paths, row_len(self.size), self.config.timeout_s)
        except OSError:
            mapped = None
        flags = self._gather_rows(torch.tensor([int(mapped is not None)], dtype=torch.int64), op).wait()
        if mapped is not None and not all(flags.flatten().tolist()):
            mapped.close()
            mapped = None
        return mapped

    def _all_to_all_bytes(self, buf: torch.Tensor, send: list[int], recv: list[int], op: str) -> Handle[torch.Tensor]:
        if buf.device.type == "cpu" and (shm := self._shared_memory()) is not None:
            return shm.all_to_all(buf, send, recv, op)
        out = torch.empty(sum(recv), dtype=torch.uint8, device=buf.device)
        work = dist.all_to_all_single(out, buf, recv, send, group=self.pg, async_op=True)
        return self._handle(work, out, op)

    def _all_to_all_filled(
        self,
        fill: Callable[[torch.Tensor], None],
        device: torch.device,
        send: list[int],
        recv: list[int],
        op: str,
        borrow: bool,
    ) -> Handle[torch.Tensor]:
        if device.type == "cpu" and (shm := self._shared_memory()) is not None:
            return shm.all_to_all(fill, send, recv, op, borrow)
        return super()._all_to_all_filled(fill, device, send, recv, op, borrow)

    def _all_gather_bytes(self, buf: torch.Tensor, counts: list[int], op: str) -> Handle[torch.Tensor]:
        # gloo gathers equal sizes only: pad to the largest and cut after.
        width = max(counts)
        padded = torch.zeros(width, dtype=torch.uint8, device=buf.device)
        padded[: buf.numel()] = buf
        outs = [torch.empty(width, dtype=torch.uint8, device=buf.device) for _ in counts]
        work = dist.all_gather(outs, padded, group=self.pg, async_op=True)
        return self._handle(
            work, outs, op
        ).then(  # type: ignore[arg-type]
            lambda parts: torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)])
        )

    def _broadcast_bytes(self, buf: torch.Tensor, src: int, op: str) -> Handle[torch.Tensor]:
        work = dist.broadcast(buf, group_src=src, group=self.pg, async_op=True)
        return self._handle(work, buf, op)

    def _all_reduce(self, x: torch.Tensor, op: str) -> Handle[torch.Tensor]:
        y = x.clone()
        work = dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.pg, async_op=True)
        return self._handle(work, y, op)

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
        made = [dist.new_group(g, timeout=timeout) for g in groups]
        if mine is None:
            return None
        return TorchCommunicator(made[mine], config, name=f"{self.name}{groups[mine]}")
