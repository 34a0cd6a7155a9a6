"""Every Communicator operation on one engine, checked against locally computed oracles.

Run on 4 ranks by tests/test_comm_dist.py under torchrun, mpirun and horovodrun.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from runner import RESULTS_DIR, finish, raises, run_checks, start

import sparta
from sparta.comm import Communicator, World
from sparta.errors import ConfigError, InputError

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.bool, torch.complex64, torch.int8]
WIDTH = 3


def splits(src: int, size: int, salt: int) -> list[int]:
    """Rows src sends to each destination; includes zeros for every salt."""
    return [(src + 2 * dst + salt) % 3 for dst in range(size)]


def block(src: int, dst: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows src sends dst: small integers, exact in every dtype."""
    base = torch.arange(n * WIDTH, dtype=torch.float32).view(n, WIDTH) + 16 * src + 4 * dst
    if dtype == torch.bool:
        return base.remainder(2).bool()
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype)
    return base.to(dtype)


def payload(world: World, salt: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[int], torch.Tensor, list[int]]:
    r, n = world.rank, world.size
    send = splits(r, n, salt)
    x = torch.cat([block(r, d, send[d], dtype) for d in range(n)])
    recv = [splits(s, n, salt)[r] for s in range(n)]
    expect = torch.cat([block(s, r, recv[s], dtype) for s in range(n)])
    return x, send, expect, recv


def check_all_to_all_uneven(world: World) -> None:
    for salt in range(3):
        for dtype in DTYPES:
            x, send, expect, recv = payload(world, salt, dtype)
            assert torch.equal(world.comm.all_to_all(x, send), expect), (salt, dtype)
            handle = world.comm.all_to_all(x, send, recv, async_op=True)
            assert torch.equal(handle.wait(), expect)
            assert torch.equal(world.comm.all_to_all(x, send, recv, check=False), expect)


def check_all_to_all_empty(world: World) -> None:
    for dtype in DTYPES:
        x = torch.empty(0, WIDTH, dtype=dtype)
        out = world.comm.all_to_all(x, [0] * world.size)
        assert out.shape == (0, WIDTH) and out.dtype == dtype
    # only rank 0 receives anything; every other rank sends to it and receives nothing
    x = torch.full((1, 2), float(world.rank))
    send = [1] + [0] * (world.size - 1)
    out = world.comm.all_to_all(x, send)
    want = (
        torch.arange(world.size, dtype=torch.float32).view(-1, 1).expand(-1, 2)
        if world.rank == 0
        else torch.empty(0, 2)
    )
    assert torch.equal(out, want)


def check_all_to_all_equal_default(world: World) -> None:
    n = world.size
    x = torch.arange(2 * n, dtype=torch.float32) + 100 * world.rank
    out = world.comm.all_to_all(x)
    want = torch.cat(
        [torch.arange(2 * world.rank, 2 * world.rank + 2, dtype=torch.float32) + 100 * s for s in range(n)]
    )
    assert torch.equal(out, want)


def check_all_reduce(world: World) -> None:
    n, r = world.size, world.rank
    total = sum(range(n))
    for dtype in DTYPES:
        x = block(r, 0, 2, dtype)
        got = world.comm.all_reduce(x)
        if dtype == torch.bool:
            want = torch.stack([block(s, 0, 2, dtype) for s in range(n)]).any(0)
        else:
            want = sum(
                block(s, 0, 2, torch.float64 if not dtype.is_complex else torch.complex128) for s in range(n)
            ).to(dtype)
        assert torch.equal(got, want), (dtype, got, want)
        assert torch.equal(x, block(r, 0, 2, dtype)), "all_reduce changed its input"
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        got = world.comm.all_reduce(torch.full((5,), float(r), dtype=dtype), op="avg")
        assert torch.equal(got, torch.full((5,), total / n, dtype=dtype)), (dtype, got)
    handle = world.comm.all_reduce(torch.tensor([r], dtype=torch.int64), async_op=True)
    assert handle.wait().item() == total
    scalar = world.comm.all_reduce(torch.tensor(2.0))
    assert scalar.shape == () and scalar.item() == 2.0 * n
    # donated scratch: the torch engine sums into it (no copy), the others into their own buffer
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = block(r, 0, 3, dtype)
        got = world.comm.all_reduce(x, async_op=True, check=False, donate=True).wait()
        assert torch.equal(got, sum(block(s, 0, 3, torch.float64) for s in range(n)).to(dtype)), (dtype, got)
        if dtype != torch.bfloat16:  # (bfloat16 may be widened first: then a copy is summed)
            assert (got is x) == (world.backend == "torch"), (dtype, world.backend)


def check_all_gather_uneven(world: World) -> None:
    r, n = world.rank, world.size
    for dtype in DTYPES:
        got = world.comm.all_gather(block(r, r, r % 3, dtype))
        assert len(got) == n
        for s in range(n):
            assert torch.equal(got[s], block(s, s, s % 3, dtype)), (dtype, s)
    empty = world.comm.all_gather(torch.empty(0, 4))
    assert [t.shape for t in empty] == [torch.Size([0, 4])] * n
    handle = world.comm.all_gather(torch.tensor([r, r]), async_op=True)
    assert [t.tolist() for t in handle.wait()] == [[s, s] for s in range(n)]
    # sizes known: with check=False only the data moves, checked or not the same result
    sizes = [s % 3 for s in range(n)]
    for check in (False, True):
        got = world.comm.all_gather(block(r, r, r % 3, torch.float32), sizes=sizes, check=check)
        assert all(torch.equal(got[s], block(s, s, s % 3, torch.float32)) for s in range(n)), check
    scalars = world.comm.all_gather(torch.tensor(float(r)), sizes=[1] * n, check=False)
    assert [t.item() for t in scalars] == list(range(n)) and all(t.dim() == 0 for t in scalars)
    # a wrong entry raises on every rank before data moves: this rank's own locally, others' agreed
    for bad in ([3] * n, [*sizes[:-1], sizes[-1] + 1]):
        for check in (True, None):
            try:
                world.comm.all_gather(block(r, r, r % 3, torch.float32), sizes=bad, check=check)
            except InputError as exc:
                assert "sizes[" in str(exc), exc
            else:
                raise AssertionError(f"sizes={bad} did not raise")


def check_reduce_scatter(world: World) -> None:
    r, n = world.rank, world.size
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.complex64, torch.uint8):
        x = torch.stack([block(r, d, 2, dtype) for d in range(n)]).reshape(2 * n, WIDTH)
        got = world.comm.reduce_scatter(x)
        wide = torch.complex128 if dtype.is_complex else torch.float64
        want = sum(block(s, r, 2, wide) for s in range(n)).to(dtype)
        assert torch.equal(got, want), (dtype, got, want)
    avg = world.comm.reduce_scatter(torch.full((n, 2), float(r)), op="avg")
    assert torch.equal(avg, torch.full((1, 2), sum(range(n)) / n))
    handle = world.comm.reduce_scatter(torch.ones(n, dtype=torch.int32), async_op=True)
    assert handle.wait().tolist() == [n]


def check_broadcast(world: World) -> None:
    for src in range(world.size):
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
            x = block(world.rank, 0, 2, dtype)
            got = world.comm.broadcast(x, src=src)
            assert torch.equal(got, block(src, 0, 2, dtype)), (src, dtype)
    assert world.comm.broadcast(torch.tensor([world.rank]), src=1, async_op=True).wait().item() == 1


def check_barrier(world: World) -> None:
    """No rank leaves a barrier before every rank reached it: rank r arrives 50 ms x r late
    and leaves a mark first; past the barrier every mark is there."""
    marks = Path(os.environ[RESULTS_DIR])
    for form in ("sync", "async"):
        time.sleep(0.05 * world.rank)
        (marks / f"barrier-{form}-{world.rank}").touch()
        if form == "sync":
            world.comm.barrier()
        else:
            world.comm.barrier(async_op=True).wait()
        missing = [r for r in range(world.size) if not (marks / f"barrier-{form}-{r}").exists()]
        assert not missing, (form, missing)


def check_sub_communicators(world: World) -> None:
    r, n = world.rank, world.size
    pairs = world.comm.split_groups([[0, 1], [2, 3]])
    assert pairs is not None and pairs.size == 2 and pairs.rank == r % 2
    assert pairs.ranks == ((0, 1) if r < 2 else (2, 3))
    assert pairs.all_reduce(torch.tensor([r])).item() == (1 if r < 2 else 5)
    x = torch.arange(pairs.rank + 1, dtype=torch.float32)  # pair rank p sends [1, p] rows
    got = pairs.all_to_all(x, [1, pairs.rank])
    assert got.tolist() == ([0.0, 0.0] if pairs.rank == 0 else [1.0])
    gathered = pairs.all_gather(torch.tensor([r]))
    assert [t.item() for t in gathered] == list(pairs.ranks)
    # two fresh splits over the same ranks (dp and ep groups alike), their first calls in
    # flight at once: Horovod pairs ops by name, which must differ between the two
    a, b = world.comm.split_groups([[0, 1], [2, 3]]), world.comm.split_groups([[0, 1], [2, 3]])
    assert a is not None and b is not None
    first = a.all_reduce(torch.tensor([1.0 + r]), async_op=True, check=False)
    second = b.all_reduce(torch.tensor([10.0 * (r + 1)]), async_op=True, check=False)
    assert (second.wait().item(), first.wait().item()) == ((30.0, 3.0) if r < 2 else (70.0, 7.0))
    evens = world.comm.split([0, 2])
    if r in (0, 2):
        assert evens is not None and evens.ranks == (0, 2)
        assert evens.broadcast(torch.tensor([r]), src=1).item() == 2
    else:
        assert evens is None
    if world.backend == "mpi":
        solo = pairs.split_groups([[0], [1]])
        assert solo is not None and solo.size == 1 and solo.ranks == (r,)
        assert solo.all_reduce(torch.tensor([3.0])).item() == 3.0
    else:  # torch and Horovod build groups only from the whole world, and say so
        with raises(InputError, "splits only the world communicator"):
            pairs.split_groups([[0], [1]])
    layout = World(comm=world.comm, launcher=world.launcher, node_ranks=((0, 1), (2, 3)))
    intra, inter = layout.node_comms()
    assert intra.ranks == ((0, 1) if r < 2 else (2, 3))
    assert inter.ranks == ((0, 2) if r % 2 == 0 else (1, 3))
    assert inter.all_reduce(torch.tensor([1])).item() == 2
    assert (layout.node, layout.local_rank, layout.local_size, layout.num_nodes) == (r // 2, r % 2, 2, 2)
    assert n == 4


def check_from_process_group(world: World) -> None:
    """A Communicator over one dimension of a torch DeviceMesh (how the 3D trainer hands
    layers the group they shard over)."""
    from torch.distributed.device_mesh import init_device_mesh

    from sparta.comm import Communicator

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    ep = Communicator.from_process_group(mesh.get_group("ep"))
    dp = Communicator.from_process_group(mesh.get_group("dp"))
    r = world.rank
    assert ep.ranks == ((0, 1) if r < 2 else (2, 3)) and dp.ranks == ((0, 2) if r % 2 == 0 else (1, 3))
    got = ep.all_to_all(torch.tensor([10.0 * r, 10.0 * r + 1]))
    assert got.tolist() == [10.0 * (r - r % 2) + r % 2, 10.0 * (r - r % 2 + 1) + r % 2]
    assert dp.all_reduce(torch.tensor([float(r)])).item() == (2.0 if r % 2 == 0 else 4.0)


def check_autograd_all_to_all(world: World) -> None:
    """Gradient of a loss through the differentiable all-to-all equals one process's."""
    n, r = world.size, world.rank
    gen = torch.Generator().manual_seed(7)
    sends = [splits(s, n, 1) for s in range(n)]
    inputs = [torch.randn(sum(sends[s]), 4, generator=gen, dtype=torch.float64) for s in range(n)]
    weights = [torch.randn(sum(sends[s][d] for s in range(n)), 4, generator=gen, dtype=torch.float64) for d in range(n)]
    # single-process reference: route every row to its destination in one process
    ref_in = [t.clone().requires_grad_() for t in inputs]
    chunks = [torch.split(t, sends[s]) for s, t in enumerate(ref_in)]
    ref_loss = sum(((torch.cat([chunks[s][d] for s in range(n)]) * weights[d]).square().sum()) for d in range(n))
    ref_loss.backward()
    x = inputs[r].clone().requires_grad_()
    out = sparta.comm.all_to_all(x, sends[r], None, world.comm)
    loss = (out * weights[r]).square().sum()
    loss.backward()
    total = world.comm.all_reduce(loss.detach())
    assert torch.allclose(total, ref_loss.detach(), rtol=1e-12), (total, ref_loss)
    assert torch.allclose(x.grad, ref_in[r].grad, rtol=1e-12, atol=1e-12)


def check_bad_input_raises_everywhere(world: World) -> None:
    r, n = world.rank, world.size
    c = world.comm
    bad_rank = 1
    with raises(InputError, "rank 1: send_splits has 2 entries but the group has 4 ranks"):
        c.all_to_all(torch.ones(2), [1, 1] if r == bad_rank else [2, 0, 0, 0])
    with raises(InputError, r"send_splits\[0\] = -1 is negative"):
        c.all_to_all(torch.ones(0), [-1, 1, 0, 0] if r == bad_rank else [0] * n)
    with raises(InputError, "send_splits sum to 4 but the tensor has 3 rows"):
        c.all_to_all(torch.ones(3), [1, 1, 1, 1] if r == bad_rank else [3, 0, 0, 0])
    with raises(InputError, "rank 0 passed float32 but rank 1 passed int64"):
        c.all_to_all(torch.ones(n, dtype=torch.int64 if r == bad_rank else torch.float32))
    with raises(InputError, r"recv_splits\[0\] = 2 but rank 0 sends 1 rows"):
        c.all_to_all(torch.ones(n), [1] * n, [2, 0, 1, 1] if r == bad_rank else [1] * n)
    with raises(InputError, "tensor shapes disagree"):
        c.all_reduce(torch.ones(3 if r == bad_rank else 2))
    with raises(InputError, "tensor shapes disagree"):
        c.all_gather(torch.ones(2, 3 if r == bad_rank else 2))
    with raises(InputError, "dim 0 \\(5\\) is not divisible by the group size"):
        c.reduce_scatter(torch.ones(5))
    with raises(InputError, "src = 7 is not a rank of this group"):
        c.broadcast(torch.ones(1), src=7)
    with raises(InputError, "op='avg' needs a floating dtype"):
        c.all_reduce(torch.ones(2, dtype=torch.int64), op="avg")
    with raises(InputError, "cannot reduce dtype torch.uint64"):
        c.all_reduce(torch.ones(2, dtype=torch.uint64))
    with raises(InputError, "unknown reduction op 'max'"):
        c.all_reduce(torch.ones(2), op="max")
    with raises(InputError, "rank 1: takes a torch.Tensor, got list"):
        c.all_reduce([1.0] if r == bad_rank else torch.ones(1))  # type: ignore[arg-type]
    with raises(InputError, "rank 1: unknown reduction op 'max'"):
        c.all_reduce(torch.ones(2), op="max" if r == bad_rank else "sum")
    with raises(InputError, "groups must be disjoint"):
        c.split_groups([[0, 1], [1, 2]])
    # past an engine's bound on one call (MPI's 32-bit counts; set low here, on every engine,
    # to be reached): the one rank over it is refused on all, before any row moves
    c.max_call_rows = 64
    try:
        with raises(InputError, r"rank 1: the \w+ engine moves at most 64 rows a call each way, and this rank's "
                                r"part is 80"):  # fmt: skip
            c.all_to_all(torch.ones(80 if r == bad_rank else n), [80, 0, 0, 0] if r == bad_rank else [1] * n)
        # past the bound in bytes, MPI counts in units of a divisor of every count (a row at
        # least): more bytes than the bound go through whole; only a call of more units than it
        # (odd byte counts) is refused, on every rank
        rows = (torch.arange(24.0 * n) + 1000 * r).view(6 * n, 4)  # 96 n bytes
        want = torch.cat([(torch.arange(24.0 * n) + 1000 * s).view(6 * n, 4)[6 * r : 6 * r + 6] for s in range(n)])
        with engine_calls(c) as calls:
            assert torch.equal(c.all_to_all(rows), want)
        assert calls == [A2A, GATHER, A2A], calls  # 6 n^2 rows in all, past 64: the receives agreed on first
        # a receive past the bound, which its rank learns only from the exchanged splits:
        # refused on every rank before any row moves, checked or not
        for check in (True, False):
            past = rf"rank 1: the \w+ engine moves at most 64 rows a call each way, and this rank's part is {33 * n}"
            with engine_calls(c) as calls, raises(InputError, past):
                c.all_to_all(torch.ones(33), [33 if s == bad_rank else 0 for s in range(n)], check=check)
            assert calls == [A2A, GATHER, GATHER], (check, calls)  # the splits, the verdicts, the reason
        ones = torch.ones(1000, dtype=torch.uint8)
        assert torch.equal(c.broadcast(torch.full((1000,), r, dtype=torch.uint8), src=1), ones)
        gathered = c.all_gather(rows)
        assert all(torch.equal(g, (torch.arange(24.0 * n) + 1000 * s).view(6 * n, 4)) for s, g in enumerate(gathered))
        if c.backend == "mpi":
            with raises(InputError, r"the MPI engine moves at most 64 units a call .* here 1\), asked for 133"):
                c.all_gather(torch.ones(33 + (r == 0), dtype=torch.uint8))
    finally:
        del c.max_call_rows  # the engine's own bound again
    # and the communicator still works after all of that
    assert c.all_reduce(torch.tensor([1.0])).item() == n


@contextmanager
def engine_calls(comm: Communicator) -> Iterator[list[str]]:
    """The engine primitives `comm` runs inside the block, in order (the engine's own calls
    run unchanged; this only records their names)."""
    calls: list[str] = []
    names = ("_all_to_all_bytes", "_all_gather_bytes", "_broadcast_bytes", "_all_reduce")
    for name in names:
        real = getattr(comm, name)
        setattr(comm, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    try:
        yield calls
    finally:
        for name in names:
            delattr(comm, name)


A2A, GATHER, REDUCE = "_all_to_all_bytes", "_all_gather_bytes", "_all_reduce"


def check_agreement_rides_on_exchanged_data(world: World) -> None:
    """The input agreement costs no round of its own where a collective exchanges sizes
    anyway (all-to-all without recv_splits, all-gather), one small all-gather elsewhere,
    and a round for the reasons only when some rank has one; bad input moves no data."""
    c, r, n = world.comm, world.rank, world.size
    x, send, expect, recv = payload(world, 1, torch.float32)
    with engine_calls(c) as calls:
        assert torch.equal(c.all_to_all(x, send), expect)
    assert calls == [A2A, A2A], calls  # splits with everyone's dtype, shape and verdict; rows
    with engine_calls(c) as calls:
        assert torch.equal(c.all_to_all(x, send, recv, check=False), expect)
    assert calls == [A2A], calls
    # equal blocks: checked, the splits go round with the verdicts; unchecked, only the rows
    blocks = torch.arange(2 * n, dtype=torch.float32) + 100 * r
    want = torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + 100 * s for s in range(n)])
    for check, rounds in ((True, [A2A, A2A]), (False, [A2A])):
        with engine_calls(c) as calls:
            assert torch.equal(c.all_to_all(blocks, check=check), want), check
        assert calls == rounds, (check, calls)
    with engine_calls(c) as calls:
        assert torch.equal(c.all_to_all(x, send, recv), expect)
    assert calls == [A2A, GATHER, A2A], calls  # every rank's verdict on the recv_splits it was given
    with engine_calls(c) as calls:
        assert [t.item() for t in c.all_gather(torch.tensor([r]))] == list(range(n))
    assert calls == [GATHER, GATHER], calls
    with engine_calls(c) as calls:
        assert c.all_reduce(torch.tensor([1.0])).item() == n
        assert c.all_reduce(torch.tensor([1.0]), check=False).item() == n
    assert calls == [GATHER, REDUCE, REDUCE], calls
    with engine_calls(c) as calls, raises(InputError, "rank 0 passed float32 but rank 1 passed int64"):
        c.all_to_all(torch.ones(n, dtype=torch.int64 if r == 1 else torch.float32))
    assert calls == [A2A], calls  # found on the split exchange: no rows moved
    with engine_calls(c) as calls, raises(InputError, r"rank 2: send_splits\[1\] = -3 is negative"):
        c.all_to_all(torch.ones(n), [1, -3, 5, 1] if r == 2 else [1] * n)
    assert calls == [A2A, GATHER], calls  # flags on the split exchange, then the reasons
    with engine_calls(c) as calls, raises(InputError, "rank 3: op='avg' needs a floating dtype"):
        c.all_reduce(torch.ones(2, dtype=torch.int64 if r == 3 else torch.float32), op="avg")
    assert calls == [GATHER, GATHER], calls


def check_agree_names_every_failing_rank(world: World) -> None:
    """`Communicator.agree`: one error on every rank, of the failing rank's kind, each failing
    rank's reason, ranks with the same reason together; a flag carried by the caller's own
    exchange makes a healthy round free."""
    c, r = world.comm, world.rank
    c.agree(None, "nothing wrong")
    mine = ConfigError(f"table {r} is too big") if r in (1, 3) else None
    with raises(ConfigError, r"^my layer: rank 1: table 1 is too big; rank 3: table 3 is too big\. Every rank"):
        c.agree(mine, "my layer")
    same = InputError("ids out of range") if r != 0 else None
    with raises(InputError, r"my layer: ranks \[1, 2, 3\]: ids out of range\."):
        c.agree(same, "my layer")
    flags = c.all_to_all(torch.tensor([int(same is not None)] * world.size), check=False)
    with engine_calls(c) as calls, raises(InputError, r"ranks \[1, 2, 3\]: ids out of range"):
        c.agree(same, "my layer", failed=[s for s, f in enumerate(flags.tolist()) if f])
    assert calls == [GATHER], calls  # only the reasons
    with engine_calls(c) as calls:
        c.agree(None, "my layer", failed=[])
    assert calls == [], calls


def check_dropped_handle_is_waited_at_the_next_call(world: World) -> None:
    """A handle dropped without wait() keeps the communicator in step: its collective is
    waited at the next call on that communicator, whose results stay right."""
    c, r, n = world.comm, world.rank, world.size
    for _ in range(2):
        dropped = c.all_reduce(torch.full((3,), float(r)), async_op=True)
        del dropped
        x, send, expect, recv = payload(world, 2, torch.float32)
        unwaited = c.all_to_all(x, send, recv, async_op=True, check=False)
        del unwaited
        assert c._orphans, "the dropped handles were not kept to be waited"
        assert c.all_reduce(torch.tensor([float(r)])).item() == sum(range(n))
        assert not c._orphans
        assert torch.equal(c.all_to_all(x, send), expect)
    assert c.broken is None


CHECKS = [
    check_all_to_all_uneven,
    check_all_to_all_empty,
    check_all_to_all_equal_default,
    check_all_reduce,
    check_all_gather_uneven,
    check_reduce_scatter,
    check_broadcast,
    check_barrier,
    check_sub_communicators,
    check_from_process_group,
    check_autograd_all_to_all,
    check_bad_input_raises_everywhere,
    check_agreement_rides_on_exchanged_data,
    check_agree_names_every_failing_rank,
    check_dropped_handle_is_waited_at_the_next_call,
]

# only the torch engine wraps process groups
TORCH_ONLY = [check_from_process_group]

if __name__ == "__main__":
    world, _ = start()
    finish(world, run_checks(world, [c for c in CHECKS if world.backend == "torch" or c not in TORCH_ONLY]))
