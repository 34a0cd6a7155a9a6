"""The Communicator interface: one set of collectives over every engine.

Engines implement a handful of primitives on flat byte buffers and on reducible tensors
(`_all_to_all_bytes`, `_all_gather_bytes`, `_broadcast_bytes`, `_all_reduce`, `_split`);
this class gives them one validated, dtype-complete, shape-aware API, the agreement that
makes bad input raise on every rank (`agree`), and (from `health.Watched`) the broken state
after a failure. Every public operation takes `async_op=True` and then returns a `Handle`
whose `wait()` gives the result.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from sparta.comm import checks
from sparta.comm.config import CommConfig
from sparta.comm.dtypes import as_bytes, from_bytes, reduction_result, widened_for_reduction
from sparta.comm.exchange import Exchange, PendingAllToAll
from sparta.comm.handle import Handle
from sparta.comm.health import Watched
from sparta.errors import CollectiveError, InputError, SpartaError

if TYPE_CHECKING:
    import torch.distributed as dist


class Communicator(Watched, Exchange, abc.ABC):
    """A group of ranks and the collectives among them.

    Attributes: `rank` (this process's index in the group), `size` (ranks in the group),
    `ranks` (their ranks in the world, in group order), `backend` (engine name),
    `config` (CommConfig), `broken`. Tensors are split and gathered along dim 0 throughout.

    An async op may read its input until its handle's `wait()` returns (the MPI and Horovod
    engines read it from a thread of their own): leave the input unchanged until then.

    After a collective fails, times out or is interrupted, the ranks may disagree on which
    message comes next, so the communicator is broken: every later call raises CollectiveError saying why,
    instead of pairing messages wrongly. A handle dropped without `wait()` is waited at this
    communicator's next call, or at the world's shutdown (`finish_dropped`); its buffers
    live until then. If its collective failed, that call raises and the communicator is
    broken.
    """

    backend: str = "abstract"
    # dtypes the engine's reduction accepts; others are widened (see dtypes.py)
    native_reduce_dtypes: frozenset[torch.dtype] = frozenset()
    # whether a failed collective leaves every group of the world unusable (one background
    # loop or progress engine serves them all), or only its own group
    failures_span_world: bool = False
    # rows one call may send (or receive) per rank, where the engine has a bound (MPI's int
    # counts, which it counts in units of at least a row)
    max_call_rows: int | None = None

    def __init__(self, rank: int, size: int, ranks: Sequence[int], config: CommConfig, name: str) -> None:
        self.rank = rank
        self.size = size
        self.ranks = tuple(ranks)
        self.config = config
        self.name = name
        super().__init__()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, size={self.size})"

    @property
    def where(self) -> str:
        """How error messages name this rank and group."""
        return f"rank {self.rank} of group {self.name!r} (world ranks {list(self.ranks)})"

    def _op(self, op: str) -> str:
        return f"{op} on {self.where} [{self.backend}]"

    # ---------------------------------------------------------------- engine primitives
    @abc.abstractmethod
    def _all_to_all_bytes(self, buf: torch.Tensor, send: list[int], recv: list[int], op: str) -> Handle[torch.Tensor]:
        """Flat uint8 `buf` cut into `send` byte counts per rank; returns the received bytes."""

    @abc.abstractmethod
    def _all_gather_bytes(self, buf: torch.Tensor, counts: list[int], op: str) -> Handle[torch.Tensor]:
        """Every rank's flat uint8 buffer (rank r has counts[r] bytes), concatenated."""

    @abc.abstractmethod
    def _broadcast_bytes(self, buf: torch.Tensor, src: int, op: str) -> Handle[torch.Tensor]:
        """`buf` from group rank `src`, into a buffer of the same size on every rank."""

    @abc.abstractmethod
    def _all_reduce(self, x: torch.Tensor, op: str, donate: bool = False) -> Handle[torch.Tensor]:
        """Element-wise sum of a contiguous tensor of a native reduce dtype, into a new
        tensor: `x` may be the caller's own and must not change, unless `donate`, where the
        engine may sum into `x` itself and return it (saving a copy)."""

    @abc.abstractmethod
    def _split(self, groups: list[list[int]], mine: int | None, config: CommConfig) -> Communicator | None:
        """Sub-communicators for disjoint `groups` (group ranks); this rank's is `mine`."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release engine resources. Idempotent."""

    # ---------------------------------------------------------------- agreement
    def agree(self, error: SpartaError | None, op: str, failed: Sequence[int] | None = None) -> None:
        """Raise the same error on every rank of the group if any rank has one. Collective.

        Every rank calls it at the same point, before any data moves, with its own verdict:
        `error`, the exception it would raise (not raised), or None where its part is fine.
        If any rank has one, every rank raises an error of the lowest failing rank's kind
        (InputError, ConfigError, ...), `op` followed by each failing rank and its reason,
        instead of leaving its peers to hang in the next collective.

        failed: the group ranks with an error, when the caller has already carried one flag
        per rank on an exchange of its own (e.g. the counts of an all-to-all); then a healthy
        group pays nothing here and a failing one one all-gather of the reasons. Without it,
        one all-gather of one integer per rank finds them first.
        """
        if failed is None:
            failed = checks.failed_ranks(self._gather_ints([int(error is not None)], op))
        if failed:
            width = [checks.REASON_BYTES] * self.size
            reason = checks.encode_reason(error)
            reasons = self._issue(op, lambda: self._all_gather_bytes(reason, width, op)).wait()
            raise checks.agreed_error(reasons, failed, op) from error

    def agree_tensor(self, x: torch.Tensor, op: str, error: SpartaError | None = None, same_dim0: bool = True) -> None:
        """`agree` on `error`, and that every rank's `x` has the same dtype and shape (dim 0
        may differ unless `same_dim0`): otherwise InputError on every rank. One all-gather of
        five integers per rank (and the reasons, if some rank has an error). Collective."""
        rows = self._gather_ints(checks.meta_row(x, error is not None), op)
        self.agree(error, op, checks.failed_ranks(rows))
        checks.raise_if_inconsistent(rows, op, same_dim0)

    def _gather_ints(self, row: list[int], op: str) -> list[list[int]]:
        if self.size == 1:  # a group of one agrees with itself: no engine round trip
            self._refuse_if_broken(op)
            return [row]
        mine = torch.tensor(row, dtype=torch.int64)
        width = [len(row) * 8] * self.size
        got = self._issue(op, lambda: self._all_gather_bytes(as_bytes(mine), width, op)).wait()
        return from_bytes(got, torch.int64, (self.size, len(row))).tolist()

    def _settle(self, x: torch.Tensor, problem: str | None, op: str, check: bool | None) -> None:
        """Before data moves: `problem` raised on every rank and the tensors compared, or,
        with checks off, `problem` raised here only."""
        if self.config.check_inputs if check is None else check:
            self.agree_tensor(x, op, InputError(problem) if problem else None)
        elif problem is not None:
            raise InputError(f"{op}: {problem}")

    # ---------------------------------------------------------------- public collectives
    def start_all_to_all(
        self,
        x: torch.Tensor,
        send_splits: Sequence[int] | None = None,
        recv_splits: Sequence[int] | None = None,
        check: bool | None = None,
    ) -> PendingAllToAll:
        """Validate, settle the splits, and start the exchange (see `all_to_all`)."""
        name = self._op("all_to_all")
        x, problem = checks.as_tensor(x)
        send, problem = checks.send_splits_of(x, send_splits, self.size, problem)
        problem = problem or checks.splits_problem(recv_splits, self.size, None, "recv_splits")
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        if problem is None:  # in the verdict, so every rank raises
            problem = self._rows_problem(max(sum(send), 0 if recv_splits is None else sum(recv_splits)))
        checking = self.config.check_inputs if check is None else check
        # equal blocks with checks off: every rank sends n / size to each, as it receives
        # (torch's all_to_all_single without splits asks the same), so no split exchange
        even = send_splits is None and recv_splits is None and x.dim() > 0
        if checking or (recv_splits is None and not even):
            recv = self._exchange_splits(x, send, recv_splits, problem, name)
        elif problem is not None:
            raise InputError(f"{name}: {problem}")
        else:
            recv = list(send) if recv_splits is None else [int(s) for s in recv_splits]
        send_bytes, recv_bytes = [s * row_bytes for s in send], [s * row_bytes for s in recv]
        handle = self._issue(name, lambda: self._all_to_all_bytes(as_bytes(x), send_bytes, recv_bytes, name))
        shape = (sum(recv), *x.shape[1:])
        return PendingAllToAll(handle.then(lambda b: from_bytes(b, x.dtype, shape)), send, recv)

    def _exchange_splits(
        self, x: torch.Tensor, send: list[int], expected: Sequence[int] | None, problem: str | None, name: str
    ) -> list[int]:
        """All-to-all of [meta, rows I send you] rows; returns the recv splits.

        Carries every rank's meta row to every rank, so a local problem, or a dtype or row
        shape that differs, raises on every rank. When the caller gave recv_splits, or the
        group moves more rows in all than the engine's bound (`max_call_rows`), one more
        agreement spreads each rank's verdict (splits that differ from what is sent, a receive
        past the bound), so it raises on all ranks, not just the ones it concerns.
        """
        meta = checks.meta_row(x, problem is not None)
        table = torch.tensor([[*meta, send[r] if problem is None else 0] for r in range(self.size)], dtype=torch.int64)
        if self.size == 1:  # a group of one receives its own row: no engine round trip
            self._refuse_if_broken(name)
            rows = table.tolist()
        else:
            nbytes = [table.shape[1] * 8] * self.size
            got = self._issue(name, lambda: self._all_to_all_bytes(as_bytes(table), nbytes, nbytes, name)).wait()
            rows = from_bytes(got, torch.int64, tuple(table.shape)).tolist()
        self.agree(InputError(problem) if problem else None, name, checks.failed_ranks(rows))
        checks.raise_if_inconsistent(rows, name, same_dim0=False)
        incoming = [row[-1] for row in rows]
        problem = None if expected is None else checks.recv_problem(expected, incoming)
        # a receive past the engine's bound is known to its rank only now; every rank holds
        # every rank's meta row, so all of them take this agreement or none does: only a
        # group that moves more rows in all than the bound pays for it
        crowded = self.max_call_rows is not None and checks.total_rows(rows) > self.max_call_rows
        if crowded:
            problem = problem or self._rows_problem(sum(incoming))
        if expected is not None or crowded:
            self.agree(InputError(problem) if problem else None, name)
        return incoming

    def _rows_problem(self, most: int) -> str | None:
        """What is wrong with a rank sending or receiving `most` rows in one all-to-all."""
        if self.max_call_rows is None or most <= self.max_call_rows:
            return None
        return (
            f"the {self.backend} engine moves at most {self.max_call_rows} rows a call each way, and this rank's "
            f"part is {most}: split the exchange into smaller calls"
        )

    def all_gather(
        self,
        x: torch.Tensor,
        async_op: bool = False,
        sizes: Sequence[int] | None = None,
        check: bool | None = None,
    ) -> list[torch.Tensor] | Handle[list[torch.Tensor]]:
        """Every rank's `x`, as a list indexed by rank. Dim 0 may differ between ranks.

        sizes: every rank's dim 0 (1 for a 0-dim `x`), where the caller knows them; None
        exchanges them first (one small message, which also carries every rank's dtype,
        shape and verdict). With `sizes` and `check=False` nothing but the data moves: every
        rank must then pass the same dtype and trailing shape. None follows
        `CommConfig.check_inputs`, which with `sizes` also agrees that they are right (one
        more small collective: pass sizes where checks are off)."""
        name = self._op("all_gather")
        x, problem = checks.as_tensor(x)
        problem = problem or checks.splits_problem(sizes, self.size, None, "sizes")
        mine = (x.shape[0] if x.dim() else 1) if problem is None else 0
        if problem is None and sizes is not None and int(sizes[self.rank]) != mine:
            problem = f"sizes[{self.rank}] = {sizes[self.rank]} but this rank's tensor has {mine} rows along dim 0"
        if sizes is None or (self.config.check_inputs if check is None else check):
            table = self._gather_ints(checks.meta_row(x, problem is not None), name)  # the sizes, and the check
            self.agree(InputError(problem) if problem else None, name, checks.failed_ranks(table))
            checks.raise_if_inconsistent(table, name, same_dim0=False)
            dims0 = [row[3] for row in table]
            if sizes is not None:  # right here, then right on every rank: agreed, so all raise or none
                wrong = [r for r in range(self.size) if int(sizes[r]) != dims0[r]]
                why = [f"sizes[{r}] = {sizes[r]} but rank {r} has {dims0[r]} rows" for r in wrong[:1]]
                self.agree(InputError(why[0]) if why else None, name)
            per_row = table[0][4] * x.element_size()
        elif problem is not None:
            raise InputError(f"{name}: {problem}")
        else:
            dims0 = [int(d) for d in sizes]
            per_row = checks.meta_row(x, False)[4] * x.element_size()
        rest = tuple(x.shape[1:])
        counts = [d * per_row for d in dims0]
        shapes = [(d, *rest) if x.dim() > 0 else () for d in dims0]

        def unpack(buf: torch.Tensor) -> list[torch.Tensor]:
            parts = torch.split(buf, counts)
            return [from_bytes(p, x.dtype, s) for p, s in zip(parts, shapes, strict=True)]

        out = self._issue(name, lambda: self._all_gather_bytes(as_bytes(x), counts, name)).then(unpack)
        return out if async_op else out.wait()

    def all_reduce(
        self,
        x: torch.Tensor,
        op: str = "sum",
        async_op: bool = False,
        check: bool | None = None,
        donate: bool = False,
    ) -> torch.Tensor | Handle[torch.Tensor]:
        """Element-wise sum ("sum") or mean ("avg") over ranks; returns a new tensor.
        `check`: as for `all_to_all` (None follows `CommConfig.check_inputs`). `donate`: `x`
        is the caller's scratch, which the engine may sum into and return instead of a new
        tensor (the torch engine does, saving a copy of `x`; its contents are undefined
        after the call either way)."""
        name = self._op(f"all_reduce({op})")
        x, problem = checks.as_tensor(x)
        wide, problem = widened_for_reduction(x, op, problem, self.native_reduce_dtypes, self.backend)
        self._settle(x, problem, name, check)
        if self.size == 1:  # the reduction over one rank is its own tensor: no engine round trip
            self._ready(name)
            out = Handle.completed(reduction_result(wide if donate and wide is x else wide.clone(), x, op, self.size))
        else:
            out = self._issue(name, lambda: self._all_reduce(wide, name, donate and wide is x))
            out = out.then(lambda y: reduction_result(y, x, op, self.size))
        return out if async_op else out.wait()

    def reduce_scatter(
        self, x: torch.Tensor, op: str = "sum", async_op: bool = False, check: bool | None = None
    ) -> torch.Tensor | Handle[torch.Tensor]:
        """x: [size * m, *rest] on every rank; rank r gets the reduction of block r, [m, *rest].

        Built as an all-to-all followed by a local sum: it moves the same bytes as a ring
        reduce-scatter and needs nothing from the engine but all-to-all.
        """
        name = self._op(f"reduce_scatter({op})")
        x, problem = checks.as_tensor(x)
        problem = problem or checks.blocks_problem(x, self.size)
        wide, problem = widened_for_reduction(x, op, problem, self.native_reduce_dtypes, self.backend)
        self._settle(x, problem, name, check)
        m = x.shape[0] // self.size
        nbytes = [wide.numel() // self.size * wide.element_size()] * self.size
        handle = self._issue(name, lambda: self._all_to_all_bytes(as_bytes(wide), nbytes, nbytes, name))

        def finish(buf: torch.Tensor) -> torch.Tensor:
            blocks = from_bytes(buf, wide.dtype, (self.size, m, *wide.shape[1:]))
            return reduction_result(blocks.sum(0, dtype=wide.dtype), x, op, self.size)

        out = handle.then(finish)
        return out if async_op else out.wait()

    def broadcast(
        self, x: torch.Tensor, src: int = 0, async_op: bool = False, check: bool | None = None
    ) -> torch.Tensor | Handle[torch.Tensor]:
        """The tensor of group rank `src`, on every rank (shapes must agree). Returns a new tensor."""
        name = self._op(f"broadcast(src={src})")
        x, problem = checks.as_tensor(x)
        if problem is None and not 0 <= src < self.size:
            problem = f"src = {src} is not a rank of this group of {self.size}; use 0 <= src < {self.size}"
        self._settle(x, problem, name, check)
        buf = as_bytes(x).clone()
        out = self._issue(name, lambda: self._broadcast_bytes(buf, src, name))
        out = out.then(lambda b: from_bytes(b, x.dtype, tuple(x.shape)))
        return out if async_op else out.wait()

    def barrier(self, async_op: bool = False) -> None | Handle[torch.Tensor]:
        """Returns once every rank of the group has entered the barrier."""
        name = self._op("barrier")
        out = self._issue(name, lambda: self._all_reduce(torch.zeros(1, dtype=torch.int32), name))
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
        self._ready(self._op("split_groups"))
        clean = checks.disjoint_groups(groups, self.size)
        mine = next((i for i, g in enumerate(clean) if self.rank in g), None)
        try:
            child = self._split(clean, mine, config or self.config)
        except CollectiveError as exc:  # the groups' rendezvous failed: the ranks' group counts may differ
            self._break(str(exc))
            raise
        if child is not None:
            child._family = self._family
            self._family.members.add(child)
            if self.failures_span_world:
                child._health = self._health
        return child

    @classmethod
    def from_process_group(cls, pg: dist.ProcessGroup, config: CommConfig | None = None) -> Communicator:
        """Wrap an existing torch.distributed process group (e.g. one dimension of a DeviceMesh)."""
        from sparta.comm.engines.torch_dist import TorchCommunicator

        return TorchCommunicator.wrap(pg, config or CommConfig())


def require_world_parent(comm: Communicator, world_size: int, why: str) -> None:
    """For engines that can only build groups when every world rank takes part."""
    if comm.size != world_size:
        raise InputError(
            f"split on {comm.where} [{comm.backend}]: this engine splits only the world communicator "
            f"({why}); call world.comm.split_groups(...) on every rank with world ranks instead"
        )
