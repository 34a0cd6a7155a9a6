"""The distributed lookup of a sharded table: route unique ids to owners, rows back, and the
gradients of touched rows only to their owners in backward.

Forward, per rank (n ids, u of them unique, world w):
    row sharding:    unique ids, grouped by owner -> all-to-all ids -> owners gather their
                     rows -> all-to-all rows back -> [u, dim] in unique-id order
    column sharding: the u unique ids go to every rank -> each gathers its dim/w columns
                     -> all-to-all back -> [w, u, dim/w] -> [u, dim]
The caller expands `[u, dim]` to `[*ids.shape, dim]` by indexing with the inverse map, so
autograd sums the gradient of repeated ids into one row per unique id on the sender, and
only those rows travel. Each rank divides its gradient by the world size before sending,
so the owner's sum over ranks is what DDP's averaged all-reduce would give the row.
Backward either exchanges the rows at once, or hands them to a `defer` function (a
PriorityQueue task, see SparseEmbedding.defer_gradients) so that autograd goes on while
they travel; `rows_to_shard` then turns the arrived rows into the shard's gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sparta.comm import Communicator
from sparta.embedding.checks import exchange_id_counts
from sparta.embedding.layout import ShardLayout
from sparta.errors import InputError


@dataclass
class Route:
    """Where this step's ids go.

    unique: [u] sorted unique ids of this rank; inverse: [n] index of each id in `unique`.
    send: ids this rank sends to each rank; recv: ids each rank sends here.
    served: [sum(recv)] the ids this rank looks up for others, as rows of its own shard.
    """

    unique: torch.Tensor
    inverse: torch.Tensor
    send: list[int]
    recv: list[int]
    served: torch.Tensor


# defer(rows to send, route) -> True if it took over the exchange (the shard's gradient comes later)
Defer = Callable[[torch.Tensor, Route], bool]


def rows_to_shard(got: torch.Tensor, route: Route, shard_shape: torch.Size, sparse: bool = False) -> torch.Tensor:
    """The shard's gradient from the rows every rank sent here (summed where ids repeat):
    dense, or with `sparse` a sparse COO tensor holding the touched rows only, so that an
    optimizer that takes sparse gradients (SGD, SparseAdam, Adagrad) updates those rows and
    no others, as with `nn.Embedding(sparse=True)`."""
    if sparse:
        return torch.sparse_coo_tensor(route.served.unsqueeze(0), got, shard_shape)
    shard_grad = torch.zeros(shard_shape, dtype=got.dtype, device=got.device)
    return shard_grad.index_add_(0, route.served, got)


def plan_route(
    ids: torch.Tensor, layout: ShardLayout, comm: Communicator, error: InputError | None, table: str
) -> Route:
    """Exchange the ids (two all-to-alls: counts with the agreed checks, then the ids).
    `error`: what is wrong with this rank's ids (inspect_ids), raised on every rank."""
    if error is not None:
        # This rank's ids are unusable: its verdict alone makes every rank raise.
        exchange_id_counts(comm, [0] * comm.size, error, table)
        raise AssertionError("unreachable: exchange_id_counts raises on a bad rank")
    unique, inverse = torch.unique(ids.reshape(-1).long(), sorted=True, return_inverse=True)
    if layout.sharding == "row":
        # Sorted ids are already grouped by owner, so no permutation is needed.
        owner = torch.bucketize(unique, layout.row_boundaries(unique.device), right=True)
        send = torch.bincount(owner, minlength=comm.size).tolist()
        outgoing = unique
    else:
        send = [unique.numel()] * comm.size
        outgoing = unique.repeat(comm.size)
    recv = exchange_id_counts(comm, send, None, table)
    served = comm.all_to_all(outgoing, send, recv, check=False)
    assert isinstance(served, torch.Tensor)
    served = served - layout.row_range(comm.rank)[0]
    return Route(unique, inverse, send, recv, served)


class ShardedLookup(torch.autograd.Function):
    """shard [rows, cols] -> [u, dim]: the unique ids' full rows (see module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        shard: torch.Tensor,
        route: Route,
        layout: ShardLayout,
        comm: Communicator,
        padding_idx: int | None,
        defer: Defer | None,
        sparse: bool,
    ) -> torch.Tensor:
        ctx.route, ctx.layout, ctx.comm, ctx.padding_idx, ctx.defer = route, layout, comm, padding_idx, defer
        ctx.sparse = sparse
        ctx.shard_shape = shard.shape
        rows = comm.all_to_all(shard[route.served], route.recv, route.send, check=False)
        assert isinstance(rows, torch.Tensor)
        if layout.sharding == "row":
            return rows
        u = route.unique.numel()
        # rows arrive grouped by source rank, i.e. by column block: [w, u, dim/w] -> [u, dim]
        return rows.view(comm.size, u, layout.shard_dim).transpose(0, 1).reshape(u, layout.embedding_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None, None, None]:
        route, layout, comm = ctx.route, ctx.layout, ctx.comm
        grad = grad / comm.size
        if ctx.padding_idx is not None:
            grad = grad.masked_fill((route.unique == ctx.padding_idx).unsqueeze(1), 0)
        if layout.sharding == "column":
            u = route.unique.numel()
            grad = grad.view(u, comm.size, layout.shard_dim).transpose(0, 1).reshape(comm.size * u, layout.shard_dim)
        grad = grad.contiguous()
        if ctx.defer is not None and ctx.defer(grad, route):
            return None, None, None, None, None, None, None
        got = comm.all_to_all(grad, route.send, route.recv, check=False)
        assert isinstance(got, torch.Tensor)
        return rows_to_shard(got, route, ctx.shard_shape, ctx.sparse), None, None, None, None, None, None
