"""Two-level all-to-all: inside each node first, then between nodes (the "2DH" scheme).

A flat all-to-all over N nodes x L ranks sends N*L messages per rank, (N-1)*L of them over
the slow inter-node link, each small when the payload is spread thin. The two-level form
moves the same rows in two exchanges:

1. intra-node: rank (n, l) sends to its node peer (n, l') every row bound for any rank of
   local index l', i.e. for (0, l'), (1, l'), ... (N-1, l');
2. inter-node: rank (n, l) now holds, from each node peer, the rows bound for (n', l) on every
   node n', and sends them to (n', l) in one message per node.

Each rank sends L small messages on the fast link and N larger ones on the slow link. Row
order is restored by local block permutations, so the result equals the flat all-to-all's:
rows ordered by source rank, within a source in the order that source sent them.

    hier = HierarchicalAllToAll.from_world(world)          # collective; reuse it
    y = hier.all_to_all(x, send_splits)                     # same as world.comm.all_to_all
    y = sparta.comm.all_to_all(x, send, recv, hier)         # differentiable, backward = reverse
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from sparta.comm import checks
from sparta.comm.communicator import Communicator
from sparta.comm.exchange import Exchange, PendingAllToAll
from sparta.errors import ConfigError, InputError

if TYPE_CHECKING:
    from sparta.comm.world import World


class HierarchicalAllToAll(Exchange):
    """`comm` seen as a grid of nodes x local ranks, with a two-level all-to-all over it.

    comm: the group the all-to-all spans (e.g. the world or an expert-parallel group).
    intra: this rank's node peers within `comm`; inter: the ranks of `comm` with this rank's
    local index, one per node, ordered by node (any Exchange over those ranks: a
    Communicator, or one wrapped by `sparta.scheduling.TracedExchange`). Building it is
    collective over `comm` (one small all-gather checks that the groups form a full grid)
    and raises ConfigError on every rank if they don't.

    An Exchange (`size`, `rank`, `ranks`, `where`, `all_to_all`, `start_all_to_all`) over
    `comm`'s ranks; `num_nodes` (N) and `local_size` (L) describe the grid.
    """

    def __init__(self, comm: Communicator, intra: Exchange, inter: Exchange) -> None:
        self.comm, self.intra, self.inter = comm, intra, inter
        self.rank, self.size, self.ranks = comm.rank, comm.size, comm.ranks
        self.num_nodes, self.local_size = inter.size, intra.size
        mine = torch.tensor(
            [intra.ranks[0], intra.rank, inter.rank, inter.ranks[0], intra.size, inter.size],
            dtype=torch.int64,
        )
        table = torch.stack(comm.all_gather(mine)).tolist()  # type: ignore[arg-type]
        self.grid = _grid(table, comm.size, self.where)
        # position of each comm rank in the grid, as (node, local)
        self.position = {self.grid[n][lo]: (n, lo) for n in range(self.num_nodes) for lo in range(self.local_size)}
        # node-major order of the grid is comm-rank order in the usual layout; skip the last
        # permutation then
        self._rank_major = all(self.grid[n][lo] == n * self.local_size + lo for n, lo in self.position.values())

    @classmethod
    def from_world(cls, world: World) -> HierarchicalAllToAll:
        """Over the whole world, nodes as `world.node_ranks` describes them. Collective."""
        intra, inter = world.node_comms()
        return cls(world.comm, intra, inter)

    @property
    def where(self) -> str:
        return f"{self.comm.where} (hierarchical)"

    def __repr__(self) -> str:
        return f"HierarchicalAllToAll({self.comm!r}, nodes={self.num_nodes}, local={self.local_size})"

    def start_all_to_all(
        self,
        x: torch.Tensor,
        send_splits: Sequence[int] | None = None,
        recv_splits: Sequence[int] | None = None,
        check: bool | None = None,
    ) -> PendingAllToAll:
        """`Communicator.all_to_all`'s contract over `comm`: x [n, *rest] split by `send_splits`
        (rows per destination rank of `comm`), received rows [sum(recv), *rest] ordered by
        source rank. The intra-node step runs before this returns (it crosses only the
        node's loopback); the inter-node step, the slow one, travels until the handle is
        waited: that is the part worth overlapping."""
        name = f"hierarchical all_to_all on {self.where} [{self.comm.backend}]"
        check = self.comm.config.check_inputs if check is None else check
        x, problem = checks.as_tensor(x)
        send, problem = checks.send_splits_of(x, send_splits, self.size, problem)
        send = send if problem is None else [0] * self.size  # a bad input sends nothing while all agree
        problem = problem or checks.splits_problem(recv_splits, self.size, None, "recv_splits")
        if problem is not None and recv_splits is not None and not check:  # no step carries it to the peers
            raise InputError(f"{name}: {problem}")
        n_nodes, local = self.num_nodes, self.local_size
        grid = self.grid
        s_mat = torch.tensor([[send[grid[n][lo]] for lo in range(local)] for n in range(n_nodes)], dtype=torch.int64)
        # Each rank's meta row (dtype, shape, verdict) rides on both count steps, so that after
        # the second every rank holds every rank's: the check needs no round of its own.
        meta = torch.tensor(checks.meta_row(x, problem is not None), dtype=torch.int64)
        # c1[ls, :n_nodes]: rows node peer ls sends me, bound for (n', my local index); then its meta
        c1_in = torch.cat([s_mat.t(), meta.expand(local, -1)], 1)
        c1 = self.intra.all_to_all(c1_in, [1] * local, [1] * local, check=False)
        assert isinstance(c1, torch.Tensor)
        if recv_splits is not None and not check:
            recv = [int(s) for s in recv_splits]
        else:
            # c2[ns, :local]: rows (ns, ls) sends me (the inter peers know them after step 1);
            # then the metas of node ns's ranks
            node_metas = c1[:, n_nodes:].reshape(1, -1).expand(n_nodes, -1)
            c2_in = torch.cat([c1[:, :n_nodes].t(), node_metas], 1)
            c2 = self.inter.all_to_all(c2_in, [1] * n_nodes, [1] * n_nodes, check=False)
            assert isinstance(c2, torch.Tensor)
            metas = c2[:, local:].reshape(n_nodes, local, -1)
            rows = [metas[self.position[r]].tolist() for r in range(self.size)]
            self.comm.agree(InputError(problem) if problem else None, name, checks.failed_ranks(rows))
            checks.raise_if_inconsistent(rows, name, same_dim0=False)
            recv = [int(c2[self.position[r]]) for r in range(self.size)]
            if recv_splits is not None:
                mismatch = checks.recv_problem(recv_splits, recv)
                self.comm.agree(InputError(mismatch) if mismatch else None, name)
        c2_list = [[recv[grid[n][lo]] for lo in range(local)] for n in range(n_nodes)]
        c1_list = c1[:, :n_nodes].tolist()

        step1_in = _reorder(x, send, [grid[n][lo] for lo in range(local) for n in range(n_nodes)])
        intra_send = s_mat.sum(0).tolist()
        intra_recv = [sum(row) for row in c1_list]
        got = self.intra.all_to_all(step1_in, intra_send, intra_recv, check=False)
        assert isinstance(got, torch.Tensor)
        # blocks arrive as (ls, n'); the inter step wants them as (n', ls)
        sizes1 = [c1_list[ls][n] for ls in range(local) for n in range(n_nodes)]
        step2_in = _reorder(got, sizes1, [ls * n_nodes + n for n in range(n_nodes) for ls in range(local)])
        inter_send = [sum(c1_list[ls][n] for ls in range(local)) for n in range(n_nodes)]
        inter_recv = [sum(row) for row in c2_list]
        h2 = self.inter.start_all_to_all(step2_in, inter_send, inter_recv, check=False).handle
        if self._rank_major:
            return PendingAllToAll(h2, send, recv)
        sizes2 = [c2_list[n][lo] for n in range(n_nodes) for lo in range(local)]
        by_source = [n * local + lo for n, lo in (self.position[r] for r in range(self.size))]
        return PendingAllToAll(h2.then(lambda out: _reorder(out, sizes2, by_source)), send, recv)


def _reorder(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """Blocks of `x` (dim 0 cut into `sizes`) concatenated in `order` (block indices)."""
    if order == sorted(order):
        return x
    parts = torch.split(x, sizes)
    return torch.cat([parts[b] for b in order])


def _grid(table: list[list[int]], size: int, where: str) -> list[list[int]]:
    """grid[node][local] = comm rank, from every rank's (node id, intra rank, inter rank,
    inter id, intra size, inter size); ConfigError (on every rank: all hold the same table)
    if the intra and inter groups don't tile `comm` as nodes x local ranks."""
    sizes = {(row[4], row[5]) for row in table}
    if len(sizes) != 1:
        raise ConfigError(
            f"hierarchical all-to-all on {where}: groups of different sizes {sorted(sizes)} as "
            "(ranks per node, nodes); it needs the same number of ranks on every node: use the flat all-to-all"
        )
    local, nodes = sizes.pop()
    if local * nodes != size:
        raise ConfigError(
            f"hierarchical all-to-all on {where}: {nodes} nodes x {local} ranks != {size} ranks; "
            "intra and inter must be the node groups and the same-local-index groups of this communicator"
        )
    grid = [[-1] * local for _ in range(nodes)]
    for rank, (_, lo, n, *_rest) in enumerate(table):
        if grid[n][lo] != -1:
            raise ConfigError(
                f"hierarchical all-to-all on {where}: ranks {grid[n][lo]} and {rank} both claim node {n}, "
                f"local {lo}; build intra and inter with World.node_comms()"
            )
        grid[n][lo] = rank
    for n in range(nodes):
        if len({table[grid[n][lo]][0] for lo in range(local)}) != 1:
            raise ConfigError(
                f"hierarchical all-to-all on {where}: inter rank {n} is not one node on every group; "
                "build intra and inter with World.node_comms()"
            )
    for lo in range(local):
        if len({table[grid[n][lo]][3] for n in range(nodes)}) != 1:
            raise ConfigError(
                f"hierarchical all-to-all on {where}: local rank {lo} spans several inter groups; "
                "build intra and inter with World.node_comms()"
            )
    return grid
