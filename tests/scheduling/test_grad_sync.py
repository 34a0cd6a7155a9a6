"""PartitionedAllReduce in a world of one: no helper thread, so a backward that raises leaves
nothing behind, and the next step sends its pieces after the transfers before their gaps.
(Its averages on real ranks: tests/dist/sched_pipeline_checks.py and tests/scheduling/auto_checks.py.)"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import sparta
from sparta.comm import World
from sparta.scheduling import GradientPartition, PartitionedAllReduce, PipelineDegrees, pipelined_exchange


class Boom(torch.autograd.Function):
    """Identity forward; its backward raises, as a failing layer's would."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in backward")


@pytest.fixture(scope="module")
def world() -> World:
    return sparta.init(backend="torch")


def test_backward_that_raises_leaves_no_thread_and_the_next_step_sends_its_pieces(world: World) -> None:
    g = torch.Generator().manual_seed(0)
    counts = torch.full((2,), 3)
    rows = torch.randn(6, 4, generator=g).requires_grad_()
    dense = torch.randn(64, generator=g).requires_grad_()

    def loss(exchange: Any, fail: bool) -> torch.Tensor:
        y = pipelined_exchange(rows, counts, lambda r, c: r * 2.0, exchange, PipelineDegrees(1, 3))
        y = Boom.apply(y) if fail else y
        return torch.tanh(y @ dense.view(4, 16)).square().sum()

    loss(world.comm, fail=False).backward()
    want = dense.grad.clone()  # the average over a world of one is the gradient itself
    dense.grad = None

    # piece 0 waits for backward transfer 2 (of 3), piece 1 goes at finish()
    part = GradientPartition(pieces=(128, 128), gaps=(0, -1), exposed_s=0.0)
    with PartitionedAllReduce(world.comm, [dense], part, openings=(2,)) as sync:
        before = set(threading.enumerate())
        sync.start()
        with pytest.raises(RuntimeError, match="boom in backward"):
            loss(sync.watch(world.comm), fail=True).backward()
        assert set(threading.enumerate()) == before, threading.enumerate()
        assert sync._next == 0  # it raised before the exchange's backward: no piece left

        dense.grad = None
        sync.start()
        loss(sync.watch(world.comm), fail=False).backward()
        assert sync._next == 1, "the piece planned for the gap did not go during backward"
        sync.finish()
        assert set(threading.enumerate()) == before
    torch.testing.assert_close(dense.grad, want, rtol=0, atol=0)
