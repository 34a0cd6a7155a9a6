"""Every Communicator operation on one engine, checked against locally computed oracles.

Run on 4 ranks by tests/test_comm_dist.py under torchrun, mpirun and horovodrun.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from comm_agreement_checks import (
    check_agree_names_every_failing_rank,
    check_agreement_rides_on_exchanged_data,
    check_bad_input_raises_everywhere,
)
from comm_payloads import DTYPES, WIDTH, block, payload, splits
from runner import RESULTS_DIR, finish, raises, run_checks, start

import sparta
from sparta.comm import Communicator, World
from sparta.errors import InputError


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
