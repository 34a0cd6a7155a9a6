"""Inside an emulated cluster of 2 nodes x 2 ranks: shaped links are slower than loopback;
all-to-alls within and across nodes deliver every row; each node's ranks run on its CPUs.

Run by tests/scheduling/test_cluster.py (as root) through sparta_tools.cluster.
"""

from __future__ import annotations

import json
import os
import socket
import time

import torch
from runner import finish, run_checks, start

from sparta.comm import Communicator, World

MIB = 1


def timed_all_reduce(comm: Communicator, n: int) -> tuple[float, torch.Tensor]:
    x = torch.full((n,), float(comm.rank + 1))
    comm.all_reduce(x)  # warm-up: connections
    begin = time.perf_counter()
    y = comm.all_reduce(x)
    assert isinstance(y, torch.Tensor)
    return time.perf_counter() - begin, y


def check_links_are_shaped(world: World) -> None:
    intra, inter = world.node_comms()
    n = MIB * 2**18
    t_intra, y_intra = timed_all_reduce(intra, n)
    world.comm.barrier()
    t_inter, y_inter = timed_all_reduce(inter, n)
    assert torch.equal(y_intra, torch.full((n,), 3.0)) and torch.equal(y_inter, torch.full((n,), 3.0))
    # A ring all-reduce of 2 ranks sends half the buffer twice each way: 1 MiB per direction
    # per inter group, >= 84 ms at 100 Mbit/s even when the other group's transfer does not
    # overlap it (168 ms when both share the link the whole time), less the 256 KiB tbf lets
    # through at once (21 ms): >= 63 ms; loopback takes a few ms.
    assert t_inter > 0.055, f"inter-node all-reduce took {t_inter * 1e3:.1f} ms; the link is not shaped"
    assert t_intra < t_inter / 3, f"intra {t_intra * 1e3:.1f} ms vs inter {t_inter * 1e3:.1f} ms"


def check_all_to_all_across_and_within_nodes(world: World) -> None:
    """Ranks of different emulated nodes meet only over the shaped link: the world's
    all-to-all crosses it, a node's stays on its loopback; both deliver every row."""
    intra, _ = world.node_comms()
    x = torch.arange(2 * world.size, dtype=torch.float32) + 100 * world.rank
    mine = torch.arange(2 * world.rank, 2 * world.rank + 2, dtype=torch.float32)
    want = torch.cat([mine + 100 * s for s in range(4)])
    assert torch.equal(world.comm.all_to_all(x), want)
    node = world.rank // 2
    got = intra.all_to_all(torch.tensor([10.0 * world.rank, 10.0 * world.rank + 1]))
    assert got.tolist() == [20.0 * node + intra.rank, 20.0 * node + 10 + intra.rank]


def check_ranks_run_on_their_nodes_cpus(world: World) -> None:
    node = world.rank // int(os.environ["LOCAL_WORLD_SIZE"])
    want = json.loads(os.environ["SPARTA_TEST_NODE_CPUS"])[node]
    assert sorted(os.sched_getaffinity(0)) == want, f"node {node}: CPUs {os.sched_getaffinity(0)}, want {want}"


def check_host_name_resolves_to_the_nodes_address(world: World) -> None:
    """Horovod's process sets connect by host name: it must reach the node, not loopback."""
    node = world.rank // int(os.environ["LOCAL_WORLD_SIZE"])
    got = socket.gethostbyname(socket.gethostname())
    assert got == f"10.213.0.{node + 1}", f"node {node}: {socket.gethostname()} resolves to {got}"


if __name__ == "__main__":
    world, _ = start(ranks_per_node=2)
    checks = [
        check_links_are_shaped,
        check_all_to_all_across_and_within_nodes,
        check_ranks_run_on_their_nodes_cpus,
        check_host_name_resolves_to_the_nodes_address,
    ]
    finish(world, run_checks(world, checks))
