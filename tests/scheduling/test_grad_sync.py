"""GapRelease, the policy deciding when each gradient piece leaves (no communication), and
DataParallel(partition=...) sending those pieces in a world of one: no helper thread, so a
backward that raises leaves nothing behind, and the next step sends its pieces after the
transfers before their gaps. (Averages on real ranks: tests/dist/sched_pipeline_checks.py and
tests/scheduling/auto_checks.py.)"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import sparta
from sparta.comm import Handle, World
from sparta.errors import ConfigError, InputError
from sparta.parallel import DataParallel, Layout, ParallelDims, build_layout
from sparta.scheduling import GapRelease, GradientPartition, PipelineDegrees, pipelined_exchange
from sparta.scheduling.grad_sync import _Transfer


class Boom(torch.autograd.Function):
    """Identity forward; its backward raises, as a failing layer's would."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in backward")


def test_release_waits_for_gradients_gap_and_the_transfer_before_it() -> None:
    # three gradients of 4, 6 and 2 elements (ready order) cut 3 | 5 | 4: pieces cross them
    release = GapRelease(GradientPartition(pieces=(12, 20, 16), gaps=(0, 1, -1), exposed_s=0.0), openings=(1, 2))
    release.bind([4, 6, 2], element_size=4)
    assert [release.spans(k) for k in range(3)] == [[(0, 0, 3)], [(0, 3, 4), (1, 0, 4)], [(1, 4, 6), (2, 0, 2)]]
    sent: list[int] = []
    release.start(sent.append)
    release.ready(0)
    assert sent == []  # gap 0 opens after the first backward transfer
    first, second = _Transfer(Handle.completed(torch.zeros(1))), _Transfer(Handle.completed(torch.zeros(1)))
    release.issued("fwd out 0", first)  # forward transfers open no gap
    release.issued("bwd out 0", first)
    assert sent == []  # released, but the transfer before the gap is still in flight
    first.done = True
    release.completed()
    assert sent == [0]
    release.ready(1)
    release.issued("bwd out 1", second)
    assert sent == [0]  # piece 1's gap opened, its transfer not done
    release.ready(2)
    release.finish()  # waits for that transfer, then sends the rest (piece 2 had no gap)
    assert sent == [0, 1, 2] and release.released == 3
    with pytest.raises(InputError, match="without start"):
        release.finish()


def test_release_refuses_pieces_that_do_not_cover_the_gradients() -> None:
    with pytest.raises(ConfigError, match="openings has 0 entries"):
        GapRelease(GradientPartition((8,), (0,), 0.0), openings=())
    release = GapRelease(GradientPartition((8,), (-1,), 0.0), openings=())
    with pytest.raises(ConfigError, match="must sum to the dense parameters' 240 bytes"):
        release.bind([60], element_size=4)
    with pytest.raises(InputError, match="before bind"):
        release.start(lambda k: None)
    release.bind([2], element_size=4)
    release.start(lambda k: None)
    with pytest.raises(InputError, match=r"gradients \[0\] \(ready order\) are not in"):
        release.finish()


@pytest.fixture(scope="module")
def world() -> World:
    return sparta.init(backend="torch")


@pytest.fixture(scope="module")
def layout(world: World) -> Layout:
    return build_layout(ParallelDims(dp=1), world)


class Dense(torch.nn.Module):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.dense = torch.nn.Parameter(value.clone())


def test_backward_that_raises_leaves_no_thread_and_the_next_step_sends_its_pieces(world: World, layout: Layout) -> None:
    g = torch.Generator().manual_seed(0)
    counts = torch.full((2,), 3)
    rows = torch.randn(6, 4, generator=g).requires_grad_()
    model = Dense(torch.randn(64, generator=g))

    def loss(exchange: Any, fail: bool) -> torch.Tensor:
        y = pipelined_exchange(rows, counts, lambda r, c: r * 2.0, exchange, PipelineDegrees(1, 3))
        y = Boom.apply(y) if fail else y
        return torch.tanh(y @ model.dense.view(4, 16)).square().sum()

    loss(world.comm, fail=False).backward()
    want = model.dense.grad.clone()  # the average over a world of one is the gradient itself
    model.dense.grad = None

    # piece 0 waits for backward transfer 2 (of 3), piece 1 goes at finish()
    part = GradientPartition(pieces=(128, 128), gaps=(0, -1), exposed_s=0.0)
    dp = DataParallel(layout, "sparta", 1, False, partition=part, openings=(2,))
    assert dp.wrap(model) is model
    before = set(threading.enumerate())
    dp.start()
    with pytest.raises(RuntimeError, match="boom in backward"):
        loss(dp.watch(world.comm), fail=True).backward()
    assert set(threading.enumerate()) == before, threading.enumerate()
    assert dp.release is not None and dp.release.released == 0  # it raised before the exchange's backward

    model.dense.grad = None
    dp.start()
    loss(dp.watch(world.comm), fail=False).backward()
    assert dp.release.released == 1, "the piece planned for the gap did not go during backward"
    dp.finish()
    assert set(threading.enumerate()) == before
    assert dp.queue is not None and [k.name for k, _ in dp.queue.issue_log] == ["dense 0", "dense 1"]
    dp.close()
    torch.testing.assert_close(model.dense.grad, want, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="needs partition="):
        DataParallel(layout, "sparta", 1, False).watch(world.comm)
    with pytest.raises(ConfigError, match="needs microbatches=1"):
        DataParallel(layout, "sparta", 2, False, partition=part, openings=(2,))


def test_second_backward_in_a_one_microbatch_step_raises(layout: Layout) -> None:
    """A bucket leaves once its micro-batches are in: a backward beyond them would be lost."""
    model = Dense(torch.ones(3))
    dp = DataParallel(layout, "sparta", 1, False)
    dp.wrap(model)
    dp.start()
    model.dense.sum().backward()
    with pytest.raises(InputError, match=r"dense received gradients from 2 backward passes .* microbatches=1"):
        model.dense.sum().backward()
    dp.close()
    accumulate = DataParallel(layout, "sparta", 2, False, queue=False)
    model.dense.grad = None
    accumulate.wrap(model)
    accumulate.start()
    model.dense.sum().backward()
    (2 * model.dense).sum().backward()
    accumulate.finish()
    accumulate.close()
    torch.testing.assert_close(model.dense.grad, torch.full((3,), 1.5))  # (1 + 2) / 2 micro-batches
    with pytest.raises(InputError, match="without start"):
        accumulate.finish()
