"""SparseEmbedding: a drop-in `nn.Embedding` whose table is sharded over the ranks of a
Communicator and whose lookups and gradients move only the rows a step touches."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from sparta.comm import Communicator, Handle
from sparta.comm.priority import PriorityQueue, TaskKey
from sparta.embedding.checks import agree_config, inspect_ids
from sparta.embedding.layout import SHARDINGS, ShardLayout
from sparta.embedding.lookup import Route, ShardedLookup, plan_route, rows_to_shard
from sparta.errors import ConfigError


class SparseEmbedding(nn.Module):
    """`nn.Embedding(num_embeddings, embedding_dim, padding_idx)`, sharded over `comm`.

    ids: integer tensor of any shape, different on every rank (data parallel).
    Returns `[*ids.shape, embedding_dim]`, equal to a single table's lookup.

    sharding: "row" (rank r holds a contiguous range of the vocabulary) or "column" (rank r
        holds `embedding_dim / world` columns of every row: balanced under skewed ids).
    comm: the Communicator of the ranks that share the table; None means one process.
    name: how error messages name the table (the model helper passes the module path).
    sparse: as `nn.Embedding(sparse=True)`: the shard's gradient is a sparse tensor of the
        touched rows, so SGD (or SparseAdam, Adagrad) updates those rows only, not the whole
        shard; a step then costs the batch's rows, whatever the vocabulary size.

    `self.weight` is this rank's shard (`[rows of the range, dim]` or `[num, dim / world]`);
    a standard optimizer over `parameters()` updates it, and its gradient is averaged over
    ranks as DDP would. `state_dict()` is local, as any module's: sharded, it holds this
    rank's shard under a key naming its part of the table (`weight.rows<r0>-<r1>.cols<c0>-<c1>`),
    so `if rank == 0: torch.save(model.state_dict(), ...)` saves rank 0's shard only. To save
    the whole table from one rank, every rank calls `sparta.embedding.full_state_dict(model)`
    (a collective: it writes `weight`, the full table in vocabulary order), then rank 0 saves
    it. `load_state_dict` takes a full `weight` written under any world size and sharding (an
    `nn.Embedding`'s too), or shard pieces that cover this rank's part (the merged
    `state_dict()`s of every rank). Every rank must run forward and backward together (they
    are collective).
    `last_route` (a lookup.Route) says which ids the last forward sent where, for logging.
    After `defer_gradients(queue, key)` the backward exchange is a task of that queue and
    the gradient lands in `weight.grad` at `finish_gradients()` (see there).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        sharding: str = "row",
        comm: Communicator | None = None,
        name: str | None = None,
        _weight: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        sparse: bool = False,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.sparse = bool(sparse)
        self.sharding, self.comm = sharding, comm
        self.table_name = name or f"SparseEmbedding({num_embeddings}, {embedding_dim})"
        world, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
        problem: ConfigError | None = None
        layout = None
        try:
            layout = ShardLayout(self.num_embeddings, self.embedding_dim, sharding, world, rank)
            self.padding_idx = _normalise_padding(padding_idx, self.num_embeddings)
            if _weight is not None and tuple(_weight.shape) != (self.num_embeddings, self.embedding_dim):
                raise ConfigError(
                    f"the pretrained table has shape {tuple(_weight.shape)}, expected "
                    f"({self.num_embeddings}, {self.embedding_dim}); pass a [num_embeddings, dim] tensor"
                )
        except ConfigError as exc:
            if comm is None:
                raise
            problem = exc
        seed = int(torch.randint(0, 2**40, (1,)))  # consumes the global RNG, as nn.Embedding's init does
        if comm is not None:
            pad = -1 if problem is not None or self.padding_idx is None else self.padding_idx
            shardings = SHARDINGS.index(sharding) if problem is None else -1
            values = [self.num_embeddings, self.embedding_dim, shardings, pad]
            names = ["num_embeddings", "embedding_dim", "sharding", "padding_idx", "seed"]
            seed = agree_config(comm, [*values, seed], names, problem, self.table_name)
        assert layout is not None
        self.layout = layout
        dtype = dtype or torch.get_default_dtype()
        shard = layout.cut(_weight).to(dtype) if _weight is not None else layout.seeded_shard(seed, dtype)
        self.weight = nn.Parameter(shard)
        self.last_route: Route | None = None
        self._queue: tuple[PriorityQueue, TaskKey] | None = None
        self._pending: tuple[Handle[torch.Tensor], Route] | None = None
        if _weight is None:
            self._zero_padding_row()

    @classmethod
    def from_pretrained(
        cls,
        embeddings: torch.Tensor,
        freeze: bool = True,
        padding_idx: int | None = None,
        sharding: str = "row",
        comm: Communicator | None = None,
        name: str | None = None,
        sparse: bool = False,
    ) -> SparseEmbedding:
        """Like `nn.Embedding.from_pretrained`: every rank passes the full `[num, dim]` table
        and keeps its shard. freeze=True stops the table from training."""
        if embeddings.dim() != 2:
            raise ConfigError(f"from_pretrained takes a 2-D [num, dim] table, got shape {tuple(embeddings.shape)}")
        num, dim = embeddings.shape
        emb = cls(
            num, dim, padding_idx, sharding, comm, name, _weight=embeddings, dtype=embeddings.dtype, sparse=sparse
        )
        emb.weight.requires_grad_(not freeze)
        return emb

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        pad += ", sparse=True" if self.sparse else ""
        world = self.comm.size if self.comm is not None else 1
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}, sharding={self.sharding!r}, world={world}"

    @torch.no_grad()
    def _zero_padding_row(self) -> None:
        if self.padding_idx is None:
            return
        r0, r1 = self.layout.row_range(self.layout.rank)
        if r0 <= self.padding_idx < r1:
            self.weight[self.padding_idx - r0].zero_()

    # ---------------------------------------------------------------- forward
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [*shape] (integers in 0..num_embeddings-1) -> [*shape, embedding_dim]."""
        error = inspect_ids(ids, self.num_embeddings, self.table_name)
        if self.comm is None:
            if error is not None:
                raise error
            return nn.functional.embedding(ids, self.weight, self.padding_idx, sparse=self.sparse)
        route = plan_route(ids, self.layout, self.comm, error, self.table_name)
        self.last_route = route
        defer = self._defer if self._queue is not None else None
        rows = ShardedLookup.apply(self.weight, route, self.layout, self.comm, self.padding_idx, defer, self.sparse)
        # An embedding lookup, not rows[inverse]: its backward sums repeated ids with a plain
        # index-add, where advanced indexing's backward goes through index_put(accumulate).
        return nn.functional.embedding(route.inverse.view(ids.shape), rows)

    # ------------------------------------------------------ queued gradients
    def defer_gradients(self, queue: PriorityQueue | None, key: TaskKey | None = None) -> None:
        """Exchange backward's rows as task `key` of `queue` (None: synchronously, the default).

        Backward then submits the rows and returns at once, so the rest of backward computes
        while they travel in the queue's agreed order; `finish_gradients()` waits for them
        and adds them to `weight.grad` (`sparta.parallel.DataParallel.finish` calls it).
        The round must list `key` (`queue.expect`); a lookup whose key is not awaited (a
        second lookup of the table in one round) exchanges its rows at once, as before.
        """
        if (queue is None) != (key is None):
            raise ConfigError(f"{self.table_name}.defer_gradients takes both a queue and a key, or neither")
        self._queue = (queue, key) if queue is not None and key is not None else None

    def _defer(self, grad: torch.Tensor, route: Route) -> bool:
        assert self._queue is not None
        queue, key = self._queue
        if self._pending is not None or not queue.expects(key):
            return False
        handle = queue.submit(key, grad, op="all_to_all", send_splits=route.send, recv_splits=route.recv)
        self._pending = (handle, route)
        return True

    def finish_gradients(self) -> None:
        """Wait for the deferred rows and add them to `weight.grad` (nothing if none pending)."""
        if self._pending is None:
            return
        (handle, route), self._pending = self._pending, None
        grad = rows_to_shard(handle.wait(), route, self.weight.shape, self.sparse)
        if self.weight.grad is None:
            self.weight.grad = grad
        else:
            self.weight.grad += grad

    # ------------------------------------------------------------ checkpoints
    def full_weight(self) -> torch.Tensor:
        """The whole `[num_embeddings, embedding_dim]` table on every rank (a collective)."""
        shard = self.weight.detach()
        if self.comm is None:
            return shard.clone()
        return self.layout.join(self.comm.all_gather(shard.contiguous()))  # type: ignore[arg-type]

    def shard_key(self) -> str:
        """This rank's state_dict key, without the module's prefix: `weight` when one process
        holds the whole table, else `weight.rows<r0>-<r1>.cols<c0>-<c1>` (its part of it)."""
        if self.comm is None:
            return "weight"
        (r0, r1), (c0, c1) = self.layout.row_range(self.layout.rank), self.layout.col_range(self.layout.rank)
        return f"weight.rows{r0}-{r1}.cols{c0}-{c1}"

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        destination[prefix + self.shard_key()] = self.weight if keep_vars else self.weight.detach()

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        key = prefix + "weight"
        pieces: dict[str, tuple[int, int, int, int]] = {}
        for name in state_dict:
            if not name.startswith(prefix) or name == key:
                continue
            match = _PIECE.fullmatch(name[len(prefix) :])
            if match is None:
                if strict:
                    unexpected_keys.append(name)
                continue
            pieces[name] = (int(match["r0"]), int(match["r1"]), int(match["c0"]), int(match["c1"]))
        if key in state_dict:
            table = state_dict[key]
            if tuple(table.shape) != (self.num_embeddings, self.embedding_dim):
                error_msgs.append(
                    f"{key}: the checkpoint's table has shape {tuple(table.shape)} but {self.table_name} is "
                    f"[{self.num_embeddings}, {self.embedding_dim}]; load a checkpoint of the same vocabulary and dim"
                )
                return
            with torch.no_grad():
                self.weight.copy_(self.layout.cut(table))
            return
        if not pieces:
            missing_keys.append(key)
            return
        problem = self._load_pieces({name: (state_dict[name], box) for name, box in pieces.items()})
        if problem:
            error_msgs.append(f"{key}: {problem}")

    def _load_pieces(self, pieces: dict[str, tuple[torch.Tensor, tuple[int, int, int, int]]]) -> str:
        """Copy this rank's part of the table from shard pieces (rows r0..r1, columns c0..c1
        each); returns what is wrong, or ""."""
        (r0, r1), (c0, c1) = self.layout.row_range(self.layout.rank), self.layout.col_range(self.layout.rank)
        shard = torch.empty_like(self.weight)
        covered = torch.zeros(shard.shape, dtype=torch.bool)
        for name, (tensor, (p0, p1, q0, q1)) in pieces.items():
            if tuple(tensor.shape) != (p1 - p0, q1 - q0) or p1 > self.num_embeddings or q1 > self.embedding_dim:
                return (
                    f"the piece {name} has shape {tuple(tensor.shape)}, which does not fit its key or "
                    f"{self.table_name}'s [{self.num_embeddings}, {self.embedding_dim}] table"
                )
            rows, cols = slice(max(p0, r0), min(p1, r1)), slice(max(q0, c0), min(q1, c1))
            if rows.start >= rows.stop or cols.start >= cols.stop:
                continue
            mine = (slice(rows.start - r0, rows.stop - r0), slice(cols.start - c0, cols.stop - c0))
            shard[mine] = tensor[rows.start - p0 : rows.stop - p0, cols.start - q0 : cols.stop - q0]
            covered[mine] = True
        if not bool(covered.all()):
            held = ", ".join(sorted(pieces))
            return (
                f"the checkpoint holds only the pieces {held} of {self.table_name}, not all of rows "
                f"{r0}..{r1 - 1}, columns {c0}..{c1 - 1} that this rank needs: it was saved from some ranks' "
                "state_dict(); save sparta.embedding.full_state_dict(model) (called on every rank) from one "
                "rank, or merge every rank's state_dict()"
            )
        with torch.no_grad():
            self.weight.copy_(shard)
        return ""


_PIECE = re.compile(r"weight\.rows(?P<r0>\d+)-(?P<r1>\d+)\.cols(?P<c0>\d+)-(?P<c1>\d+)")


def _normalise_padding(padding_idx: int | None, num_embeddings: int) -> int | None:
    if padding_idx is None:
        return None
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ConfigError(
            f"padding_idx={padding_idx} is outside the vocabulary of {num_embeddings} rows; "
            f"use -{num_embeddings} <= padding_idx < {num_embeddings}"
        )
    return padding_idx % num_embeddings
