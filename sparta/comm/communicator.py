"""The Communicator interface: one set of collectives over every engine.

Engines implement a handful of primitives on flat byte buffers and on reducible tensors
(`_all_to_all_bytes`, `_all_gather_bytes`, `_broadcast_bytes`, `_all_reduce`, `_split`);
this class gives them one validated, dtype-complete, shape-aware API. Every public
operation takes `async_op=True` and then returns a `Handle` whose `wait()` gives the result.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from sparta.comm import checks
from sparta.comm.checks import Finding, Problem
from sparta.comm.dtypes import as_bytes, dtype_code, from_bytes, reduction_dtype
from sparta.comm.handle import Handle
from sparta.errors import ConfigError, InputError

if TYPE_CHECKING:
    import torch.distributed as dist

REDUCE_OPS = ("sum", "avg")
SHARED_MEMORY_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class CommConfig:
    """How a communicator behaves.

    timeout_s: a collective that has not completed after this many seconds raises
        CollectiveTimeoutError naming the rank, the operation and the group.
    check_inputs: before each collective, exchange a tiny row of metadata (shapes, dtypes,
        local problems) so that bad input raises the same error on every rank instead of
        hanging. Costs one small extra message per collective; turn it off in tuned runs.
    shared_memory: how the torch engine moves the all-to-all of CPU tensors when every rank
        of the group is on one host (and one network namespace): "on" through /dev/shm
        (sparta.comm.shm) instead of gloo's loopback TCP; "off" through gloo; "auto" (the
        default) through /dev/shm unless the group has more ranks than the host has CPUs.
        Measured on 2 CPUs (benchmarks/moe_layer.py, sparta_dropless vs sparta_tcp): an
        expert-parallel MoE layer on 2 ranks is 3-8% faster through /dev/shm, on 4 ranks 5%
        slower, as its copies then wait for a core where gloo's were done in the kernel
        in the background. MPI has its own shared-memory path; CUDA tensors always go
        through the engine (nccl).
    """

    timeout_s: float = 300.0
    check_inputs: bool = True
    shared_memory: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"CommConfig.timeout_s = {self.timeout_s} must be > 0 seconds")
        if self.shared_memory not in SHARED_MEMORY_MODES:
            raise ConfigError(f"CommConfig.shared_memory = {self.shared_memory!r}; choose one of {SHARED_MEMORY_MODES}")


class Communicator(abc.ABC):
    """A group of ranks and the collectives among them.

    Attributes: `rank` (this process's index in the group), `size` (ranks in the group),
    `ranks` (their ranks in the world, in group order), `backend` (engine name),
    `config` (CommConfig). Tensors are split and gathered along dim 0 throughout.
    """

    backend: str = "abstract"
    # dtypes the engine's reduction accepts; others are widened (see dtypes.py)
    native_reduce_dtypes: frozenset[torch.dtype] = frozenset()

    def __init__(self, rank: int, size: int, ranks: Sequence[int], config: CommConfig, name: str) -> None:
        self.rank = rank
        self.size = size
        self.ranks = tuple(ranks)
        self.config = config
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, size={self.size})"

    @property
    def where(self) -> str:
        """How error messages name this rank and group."""
        return f"rank {self.rank} of group {self.name!r} (world ranks {list(self.ranks)})"

    # ---------------------------------------------------------------- engine primitives
    @abc.abstractmethod
    def _all_to_all_bytes(self, buf: torch.Tensor, send: list[int], recv: list[int], op: str) -> Handle[torch.Tensor]:
        """Flat uint8 `buf` cut into `send` byte counts per rank; returns the received bytes."""

    def _all_to_all_filled(
        self,
        fill: Callable[[torch.Tensor], None],
        device: torch.device,
        send: list[int],
        recv: list[int],
        op: str,
        borrow: bool,
    ) -> Handle[torch.Tensor]:
        """`_all_to_all_bytes` of the `sum(send)` bytes `fill` writes into the flat uint8
        buffer it is handed (`borrow`: see `all_to_all_fill`); engines with a buffer of
        their own override it."""
        buf = torch.empty(sum(send), dtype=torch.uint8, device=device)
        fill(buf)
        return self._all_to_all_bytes(buf, send, recv, op)

    @abc.abstractmethod
    def _all_gather_bytes(self, buf: torch.Tensor, counts: list[int], op: str) -> Handle[torch.Tensor]:
        """Every rank's flat uint8 buffer (rank r has counts[r] bytes), concatenated."""

    @abc.abstractmethod
    def _broadcast_bytes(self, buf: torch.Tensor, src: int, op: str) -> Handle[torch.Tensor]:
        """`buf` from group rank `src`, into a buffer of the same size on every rank."""

    @abc.abstractmethod
    def _all_reduce(self, x: torch.Tensor, op: str) -> Handle[torch.Tensor]:
        """Element-wise sum of a contiguous tensor of a native reduce dtype, into a new
        tensor: `x` may be the caller's own and must not change."""

    @abc.abstractmethod
    def _split(self, groups: list[list[int]], mine: int | None, config: CommConfig) -> Communicator | None:
        """Sub-communicators for disjoint `groups` (group ranks); this rank's is `mine`."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release engine resources (the world's engine, a group's shared memory). Idempotent."""

    # ---------------------------------------------------------------- helpers
    def _op(self, op: str) -> str:
        return f"{op} on {self.where} [{self.backend}]"

    def _agree(self, x: torch.Tensor, finding: Finding, op: str, same_dim0: bool, same_rest: bool = True) -> None:
        """Raise on every rank if any rank found a problem or shapes disagree."""
        if not self.config.check_inputs:
            if finding.problem != Problem.NONE:
                raise InputError(f"{op}: {finding.message()}")
            return
        row = torch.tensor([checks.meta_row(x, finding)], dtype=torch.int64)
        rows = self._all_gather_bytes(as_bytes(row), [checks.META_LEN * 8] * self.size, op).wait()
        checks.raise_if_any(
            from_bytes(rows, torch.int64, (self.size, checks.META_LEN)), op, self.rank, same_dim0, same_rest
        )

    @staticmethod
    def _require_tensor(x: Any, op: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise InputError(f"{op} takes a torch.Tensor, got {type(x).__name__}")
        if dtype_code(x.dtype) == 0:
            raise InputError(f"{op}: dtype {x.dtype} cannot be communicated; cast to a standard dtype")
        return x

    def _check_op(self, op: str) -> None:
        if op not in REDUCE_OPS:
            raise InputError(f"unknown reduction op {op!r}; use one of {REDUCE_OPS}")

    # ---------------------------------------------------------------- public collectives
    def all_to_all(
        self,
        x: torch.Tensor,
        send_splits: Sequence[int] | None = None,
        recv_splits: Sequence[int] | None = None,
        async_op: bool = False,
        check: bool | None = None,
    ) -> torch.Tensor | Handle[torch.Tensor]:
        """Rows `x[sum(send_splits[:r]) : sum(send_splits[:r+1])]` go to rank r.

        x: [n, *rest]. send_splits: rows per destination rank (None = n / size each).
        recv_splits: rows per source rank; None exchanges them first (one small message).
        Returns [sum(recv_splits), *rest], rows ordered by source rank. `check=False` skips
        the metadata exchange when the caller knows all ranks agree (default: config).
        """
        out, _, _ = self._start_all_to_all(x, send_splits, recv_splits, check)
        return out if async_op else out.wait()

    def all_to_all_fill(
        self,
        fill: Callable[[torch.Tensor], None],
        shape: Sequence[int],
        dtype: torch.dtype,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        async_op: bool = False,
        check: bool | None = None,
        device: torch.device | str = "cpu",
        borrow: bool = False,
    ) -> torch.Tensor | Handle[torch.Tensor]:
        """`all_to_all` of the rows that `fill` writes into the empty `[n, *rest]` tensor
        (`shape`, `dtype`, `device`) it is handed, on this thread, before the exchange
        starts. Where the engine moves the rows through shared memory (the torch engine's
        CPU all-to-all on one host) that tensor lies there, so the rows are written once
        instead of written and then copied in; elsewhere it is an ordinary tensor. `fill`
        must write every row, keep no reference to the tensor and start no collective.

        `borrow=True` may return, instead of a tensor of its own, a view of the engine's
        buffer (shared memory, where all the rows come from one rank), saving the copy out.
        It is valid only until this rank's next all-to-all on this communicator has run
        its fill: read it, or read it in that fill, and drop it; never keep or write it."""
        like = torch.empty(tuple(shape), dtype=dtype, device="meta")
        out, _, _ = self._start_all_to_all(like, send_splits, recv_splits, check, fill, torch.device(device), borrow)
        return out if async_op else out.wait()

    def _start_all_to_all(
        self,
        x: torch.Tensor,
        send_splits: Sequence[int] | None,
        recv_splits: Sequence[int] | None,
        check: bool | None,
        fill: Callable[[torch.Tensor], None] | None = None,
        device: torch.device | None = None,
        borrow: bool = False,
    ) -> tuple[Handle[torch.Tensor], list[int], list[int]]:
        """Validate, settle the splits, and launch; returns (handle, send, recv splits).
        With `fill`, `x` is a meta tensor of the shape and dtype `fill` writes on `device`."""
        name = self._op("all_to_all")
        x = self._require_tensor(x, name)
        rows = x.shape[0] if x.dim() > 0 else 0
        if x.dim() == 0:
            finding, send = Finding(Problem.ZERO_DIM), [0] * self.size
        elif send_splits is None:
            finding = Finding(Problem.NOT_DIVISIBLE, rows, self.size) if rows % self.size else OK_
            send = [rows // self.size] * self.size
        else:
            send = [int(s) for s in send_splits]
            finding = checks.check_splits(send, self.size, rows)
        if finding == OK_:
            finding = checks.check_splits(recv_splits, self.size, None, recv=True)
        if recv_splits is None or (self.config.check_inputs if check is None else check):
            recv = self._exchange_splits(x, send, recv_splits, finding, name)
        else:
            if finding != OK_:
                raise InputError(f"{name}: {finding.message()}")
            recv = [int(s) for s in recv_splits]
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        rest = tuple(x.shape[1:])
        send_bytes, recv_bytes = [s * row_bytes for s in send], [s * row_bytes for s in recv]
        if fill is None:
            handle = self._all_to_all_bytes(as_bytes(x), send_bytes, recv_bytes, name)
        else:
            assert device is not None
            shape = tuple(x.shape)
            handle = self._all_to_all_filled(
                lambda b: fill(from_bytes(b, x.dtype, shape)), device, send_bytes, recv_bytes, name, borrow
            )
        return handle.then(lambda b: from_bytes(b, x.dtype, (sum(recv), *rest))), send, recv

    def _exchange_splits(
        self, x: torch.Tensor, send: list[int], expected: Sequence[int] | None, finding: Finding, name: str
    ) -> list[int]:
        """All-to-all of [meta, rows I send you] rows; returns the recv splits.

        Carries every rank's meta row to every rank, so a local problem raises everywhere.
        When the caller gave recv_splits, a second tiny gather spreads each rank's verdict
        on them, so a mismatch between two ranks raises on all ranks, not just those two.
        """
        ok = finding == OK_
        meta = checks.meta_row(x, finding)
        table = torch.tensor([meta + [send[r] if ok else 0] for r in range(self.size)], dtype=torch.int64)
        width = checks.META_LEN + 1
        got = self._all_to_all_bytes(as_bytes(table), [width * 8] * self.size, [width * 8] * self.size, name).wait()
        got = from_bytes(got, torch.int64, (self.size, width))
        checks.raise_if_any(got[:, : checks.META_LEN], name, self.rank, same_dim0=False)
        incoming = got[:, checks.META_LEN].tolist()
        if expected is not None:
            verdict = next(
                (
                    Finding(Problem.RECV_MISMATCH, r, int(expected[r]), incoming[r])
                    for r in range(self.size)
                    if int(expected[r]) != incoming[r]
                ),
                OK_,
            )
            self._agree(x, verdict, name, same_dim0=False)
        return incoming

    def all_gather(self, x: torch.Tensor, async_op: bool = False) -> list[torch.Tensor] | Handle[list[torch.Tensor]]:
        """Every rank's `x`, as a list indexed by rank. Dim 0 may differ between ranks."""
        name = self._op("all_gather")
        x = self._require_tensor(x, name)
        row = torch.tensor([checks.meta_row(x, OK_)], dtype=torch.int64)
        metas = self._all_gather_bytes(as_bytes(row), [checks.META_LEN * 8] * self.size, name).wait()
        table = from_bytes(metas, torch.int64, (self.size, checks.META_LEN))
        checks.raise_if_any(table, name, self.rank, same_dim0=False)
        dims0 = table[:, 6].tolist()
        rest = tuple(x.shape[1:])
        per_row = int(table[0, 7]) * x.element_size()
        counts = [d * per_row for d in dims0]
        shapes = [(d, *rest) if x.dim() > 0 else () for d in dims0]

        def unpack(buf: torch.Tensor) -> list[torch.Tensor]:
            parts = torch.split(buf, counts)
            return [from_bytes(p, x.dtype, s) for p, s in zip(parts, shapes, strict=True)]

        out = self._all_gather_bytes(as_bytes(x), counts, name).then(unpack)
        return out if async_op else out.wait()

    def all_reduce(
        self, x: torch.Tensor, op: str = "sum", async_op: bool = False
    ) -> torch.Tensor | Handle[torch.Tensor]:
        """Element-wise sum ("sum") or mean ("avg") over ranks; returns a new tensor."""
        name = self._op(f"all_reduce({op})")
        x = self._require_tensor(x, name)
        self._check_op(op)
        self._agree(x, OK_, name, same_dim0=True)
        wide = self._reduce_prep(x, op, name)
        out = self._all_reduce(wide, name).then(lambda y: self._reduce_finish(y, x, op))
        return out if async_op else out.wait()

    def reduce_scatter(
        self, x: torch.Tensor, op: str = "sum", async_op: bool = False
    ) -> torch.Tensor | Handle[torch.Tensor]:
        """x: [size * m, *rest] on every rank; rank r gets the reduction of block r, [m, *rest].

        Built as an all-to-all followed by a local sum: it moves the same bytes as a ring
        reduce-scatter and needs nothing from the engine but all-to-all.
        """
        name = self._op(f"reduce_scatter({op})")
        x = self._require_tensor(x, name)
        self._check_op(op)
        rows = x.shape[0] if x.dim() > 0 else 0
        finding = (
            Finding(Problem.ZERO_DIM)
            if x.dim() == 0
            else (Finding(Problem.NOT_DIVISIBLE, rows, self.size) if rows % self.size else OK_)
        )
        self._agree(x, finding, name, same_dim0=True)
        wide = self._reduce_prep(x, op, name)
        m = rows // self.size
        nbytes = wide.numel() // self.size * wide.element_size()
        handle = self._all_to_all_bytes(as_bytes(wide), [nbytes] * self.size, [nbytes] * self.size, name)

        def finish(buf: torch.Tensor) -> torch.Tensor:
            blocks = from_bytes(buf, wide.dtype, (self.size, m, *wide.shape[1:]))
            return self._reduce_finish(blocks.sum(0, dtype=wide.dtype), x, op)

        out = handle.then(finish)
        return out if async_op else out.wait()

    def _reduce_prep(self, x: torch.Tensor, op: str, name: str) -> torch.Tensor:
        if op == "avg" and not (x.is_floating_point() or x.is_complex()):
            raise InputError(f"{name}: op='avg' needs a floating dtype, got {x.dtype}; use op='sum' and divide")
        dt = reduction_dtype(x.dtype, self.native_reduce_dtypes, self.backend)
        y = torch.view_as_real(x.contiguous()) if x.is_complex() else x
        return y.to(dt).contiguous()

    def _reduce_finish(self, y: torch.Tensor, like: torch.Tensor, op: str) -> torch.Tensor:
        if op == "avg":
            y = y / self.size
        if like.is_complex():
            return torch.view_as_complex(y.to(torch.view_as_real(like).dtype).contiguous())
        if like.dtype == torch.bool:
            return y != 0
        return y.to(like.dtype)

    def broadcast(self, x: torch.Tensor, src: int = 0, async_op: bool = False) -> torch.Tensor | Handle[torch.Tensor]:
        """The tensor of group rank `src`, on every rank (shapes must agree). Returns a new tensor."""
        name = self._op(f"broadcast(src={src})")
        x = self._require_tensor(x, name)
        finding = OK_ if 0 <= src < self.size else Finding(Problem.BAD_SRC, src, self.size)
        self._agree(x, finding, name, same_dim0=True)
        buf = as_bytes(x).clone()
        out = self._broadcast_bytes(buf, src, name).then(lambda b: from_bytes(b, x.dtype, tuple(x.shape)))
        return out if async_op else out.wait()

    def barrier(self, async_op: bool = False) -> None | Handle[torch.Tensor]:
        """Returns once every rank of the group has entered the barrier."""
        out = self._all_reduce(torch.zeros(1, dtype=torch.int32), self._op("barrier"))
        if async_op:
            return out
        out.wait()
        return None

    # ---------------------------------------------------------------- groups
    def split(self, ranks: Sequence[int], config: CommConfig | None = None) -> Communicator | None:
        """A sub-communicator of the given group ranks; None on ranks not in it.

        Called by every rank of this communicator, with the same `ranks`. `config` (default:
        this communicator's) lets a group have its own timeout.
        """
        return self.split_groups([list(ranks)], config)

    def split_groups(self, groups: Sequence[Sequence[int]], config: CommConfig | None = None) -> Communicator | None:
        """Disjoint groups at once (e.g. expert-parallel groups); returns this rank's.

        `groups` are lists of this communicator's ranks, the same on every rank; a rank in
        none of them gets None. Called by every rank of this communicator.
        """
        clean = [sorted({int(r) for r in g}) for g in groups]
        seen: set[int] = set()
        for g in clean:
            if not g:
                raise InputError("split_groups: an empty group; every group needs at least one rank")
            bad = [r for r in g if not 0 <= r < self.size]
            if bad:
                raise InputError(f"split_groups: ranks {bad} are not in this group of {self.size} (0..{self.size - 1})")
            if seen & set(g):
                raise InputError(
                    f"split_groups: rank(s) {sorted(seen & set(g))} appear in two groups; groups must be disjoint"
                )
            seen |= set(g)
        mine = next((i for i, g in enumerate(clean) if self.rank in g), None)
        return self._split(clean, mine, config or self.config)

    @classmethod
    def from_process_group(cls, pg: dist.ProcessGroup, config: CommConfig | None = None) -> Communicator:
        """Wrap an existing torch.distributed process group (e.g. one dimension of a DeviceMesh)."""
        from sparta.comm.engines.torch_dist import TorchCommunicator

        return TorchCommunicator.wrap(pg, config or CommConfig())


OK_ = checks.OK


def require_world_parent(comm: Communicator, world_size: int, why: str) -> None:
    """For engines that can only build groups when every world rank takes part."""
    if comm.size != world_size:
        raise InputError(
            f"split on {comm.where} [{comm.backend}]: this engine splits only the world communicator "
            f"({why}); call world.comm.split_groups(...) on every rank with world ranks instead"
        )
