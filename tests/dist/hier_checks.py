"""The two-level all-to-all against the flat one, on 4 ranks posed as 2 nodes x 2 ranks.

Run by tests/scheduling/test_hierarchical.py under torchrun, mpirun, horovodrun and
horovodrun-over-MPI.
"""

from __future__ import annotations

import torch
from comm_agreement_checks import engine_calls
from runner import finish, raises, run_checks, start

import sparta
from sparta.comm import HierarchicalAllToAll, World
from sparta.errors import ConfigError, InputError
from sparta.scheduling.trace import TracedExchange, Tracer

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


_BUILT: list[HierarchicalAllToAll] = []


def hier(world: World) -> HierarchicalAllToAll:
    """Built once (it is collective and makes groups), shared by the checks."""
    if not _BUILT:
        _BUILT.append(HierarchicalAllToAll.from_world(world))
    return _BUILT[0]


def payload(world: World, salt: int, dtype: torch.dtype, width: int = 3) -> tuple[torch.Tensor, list[int]]:
    """Uneven splits with zeros, rows unique to (source, destination, row)."""
    send = [(world.rank * 3 + 2 * d + salt) % 4 for d in range(world.size)]
    rows = sum(send)
    x = torch.arange(rows * width, dtype=torch.float32).view(rows, width) + 1000 * world.rank
    return (x.remainder(2).bool() if dtype == torch.bool else x.to(dtype)), send


def check_layout(world: World) -> None:
    h = hier(world)
    assert (h.num_nodes, h.local_size) == (2, 2), h
    assert h.grid == [[0, 1], [2, 3]], h.grid


def check_equals_flat_uneven(world: World) -> None:
    h = hier(world)
    for salt in range(4):
        for dtype in DTYPES:
            x, send = payload(world, salt, dtype)
            want = world.comm.all_to_all(x, send)
            assert isinstance(want, torch.Tensor)
            recv = [int(v) for v in world.comm.all_to_all(torch.tensor(send), check=False)]  # type: ignore[union-attr]
            assert torch.equal(h.all_to_all(x, send), want), (salt, dtype)
            assert torch.equal(h.all_to_all(x, send, recv, check=False), want)
            assert torch.equal(h.all_to_all(x, send, recv, async_op=True).wait(), want)  # type: ignore[union-attr]


def check_equal_default_splits_and_shapes(world: World) -> None:
    h = hier(world)
    x = torch.arange(8 * 2 * 5, dtype=torch.float64).view(8, 2, 5) + 100 * world.rank
    assert torch.equal(h.all_to_all(x), world.comm.all_to_all(x))


def check_empty(world: World) -> None:
    h = hier(world)
    x = torch.empty(0, 4)
    out = h.all_to_all(x, [0] * world.size)
    assert out.shape == (0, 4)
    # everything to rank 3, which is on the other node for ranks 0 and 1
    x = torch.full((2, 1), float(world.rank))
    out = h.all_to_all(x, [0, 0, 0, 2])
    want = torch.arange(4.0).repeat_interleave(2).view(-1, 1) if world.rank == 3 else torch.empty(0, 1)
    assert torch.equal(out, want), out


def check_autograd_matches_flat(world: World) -> None:
    h = hier(world)
    x, send = payload(world, 1, torch.float64)
    a = x.clone().requires_grad_()
    b = x.clone().requires_grad_()
    ya = sparta.comm.all_to_all(a, send, None, h)
    yb = sparta.comm.all_to_all(b, send, None, world.comm)
    assert torch.equal(ya, yb)
    w = torch.linspace(-1, 1, ya.shape[1], dtype=torch.float64)
    ((ya * w).sin().sum()).backward()
    ((yb * w).sin().sum()).backward()
    assert a.grad is not None and b.grad is not None
    assert torch.equal(a.grad, b.grad)


def check_interleaved_nodes(world: World) -> None:
    """Nodes {0, 2} and {1, 3}: source order differs from grid order, so the last
    permutation runs."""
    intra = world.comm.split_groups([[0, 2], [1, 3]])
    inter = world.comm.split_groups([[0, 1], [2, 3]])
    assert intra is not None and inter is not None
    h = HierarchicalAllToAll(world.comm, intra, inter)
    assert h.grid == [[0, 2], [1, 3]], h.grid
    for salt in range(3):
        x, send = payload(world, salt, torch.float32)
        assert torch.equal(h.all_to_all(x, send), world.comm.all_to_all(x, send)), salt


def check_bad_grid_raises_everywhere(world: World) -> None:
    same = world.comm.split_groups([[0, 1], [2, 3]])
    assert same is not None
    with raises(ConfigError, "both claim node"):
        HierarchicalAllToAll(world.comm, same, same)


def check_bad_splits_raise_everywhere(world: World) -> None:
    h = hier(world)
    with raises(InputError, "rank 2: send_splits sum to 4 but the tensor has 3 rows"):
        h.all_to_all(torch.ones(3), [1, 1, 1, 1] if world.rank == 2 else [3, 0, 0, 0])
    with raises(InputError, r"rank 1: recv_splits\[0\] = 5 but rank 0 sends 1 rows"):
        h.all_to_all(torch.ones(4), [1] * 4, [5, 1, 1, 1] if world.rank == 1 else [1] * 4)
    with raises(InputError, "rank 0 passed float32 but rank 3 passed bfloat16"):
        h.all_to_all(torch.ones(4, 2, dtype=torch.bfloat16 if world.rank == 3 else torch.float32))
    # and it still works
    x, send = payload(world, 2, torch.float32)
    assert torch.equal(h.all_to_all(x, send), world.comm.all_to_all(x, send))


def check_traced_steps(world: World) -> None:
    """Intra and inter steps through TracedExchange (any Exchange will do): the same rows
    as the flat exchange, each step (counts with every rank's check row, then rows)
    recorded on its own track."""
    intra, inter = world.node_comms()
    tracer = Tracer()
    h = HierarchicalAllToAll(world.comm, TracedExchange(intra, tracer, "intra"), TracedExchange(inter, tracer, "inter"))
    x, send = payload(world, 3, torch.float32)
    tracer.context = "rows"
    want = world.comm.all_to_all(x, send)
    with engine_calls(world.comm) as calls:
        assert torch.equal(h.all_to_all(x, send), want)
    assert calls == [], calls  # the check rides on the count steps: no round over the whole group
    assert [s.track for s in tracer.spans] == ["intra", "inter", "intra", "inter"], tracer.spans
    assert tracer.spans[-1].args["rows"] == want.shape[0]  # the inter step delivers every row


CHECKS = [
    check_layout,
    check_equals_flat_uneven,
    check_equal_default_splits_and_shapes,
    check_empty,
    check_autograd_matches_flat,
    check_interleaved_nodes,
    check_bad_grid_raises_everywhere,
    check_bad_splits_raise_everywhere,
    check_traced_steps,
]

if __name__ == "__main__":
    world, _ = start(ranks_per_node=2)
    finish(world, run_checks(world, CHECKS))
