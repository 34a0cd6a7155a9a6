"""Worker of tests/scheduling/test_auto.py on 4 ranks (2 nodes x 2): the layer's timed
explicit schedule tuning and the gradient pieces' wait for the link, checked on real collectives."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dist"))  # the shared check runner

from runner import finish, run_checks, start  # noqa: E402

from sparta.comm import Exchange, HierarchicalAllToAll, PendingAllToAll, World  # noqa: E402
from sparta.comm.handle import Handle  # noqa: E402
from sparta.moe import MoELayer, tune_schedule  # noqa: E402
from sparta.parallel import DataParallel, ParallelDims, build_layout  # noqa: E402
from sparta.scheduling.chunks import PipelineDegrees  # noqa: E402
from sparta.scheduling.partition import GradientPartition  # noqa: E402
from sparta.scheduling.pipeline import pipelined_exchange  # noqa: E402

D_MODEL, D_FF, EXPERTS, TOKENS = 16, 32, 8, 24


def layer(world: World, degree: Any, hierarchical: bool = True) -> MoELayer:
    torch.manual_seed(0)
    hier = HierarchicalAllToAll.from_world(world) if hierarchical else None
    return MoELayer(D_MODEL, D_FF, EXPERTS, ep_size=world.size, comm=world.comm, exchange=hier, pipeline_degree=degree)


def check_tuned_plan_is_agreed_and_leaves_the_layer_as_it_was(world: World) -> None:
    """tune_schedule's timed trials pick the same plan and calibration on every rank, profile
    the router, and leave no trace: after apply_schedule the layer computes exactly what a
    layer built with the chosen degrees from the start computes (outputs and every gradient)."""
    x = torch.randn(TOKENS, D_MODEL, generator=torch.Generator().manual_seed(world.rank))
    tuned = layer(world, 1, hierarchical=False)
    hier = HierarchicalAllToAll.from_world(world)
    plan = tune_schedule(tuned, x, hierarchical=hier)
    assert all(p.grad is None for p in tuned.parameters()), "the trials left gradients behind"
    tuned.apply_schedule(plan, hierarchical=hier)
    assert tuned.degrees == plan.degrees and tuned.schedule_plan is plan
    mine = torch.tensor(
        [
            plan.degrees.forward,
            plan.degrees.backward,
            plan.degrees.taper,
            plan.hierarchical,
            plan.calibration.scale,
            plan.calibration.efficiency,
            *plan.router_s,
        ],
        dtype=torch.float64,
    )
    every = world.comm.all_gather(mine)
    assert all(torch.equal(t, mine) for t in every), f"ranks disagree on the plan: {every}"
    assert plan.router_s[0] > 0 and plan.router_s[1] > 0, plan.router_s
    assert 0.0 <= plan.calibration.efficiency <= 1.0 and plan.calibration.scale > 0
    y = tuned(x)
    y.square().sum().backward()
    fixed = layer(world, (plan.degrees.forward, plan.degrees.backward, plan.degrees.taper), plan.hierarchical)
    want = fixed(x)
    want.square().sum().backward()
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    for (name, p), q in zip(tuned.named_parameters(), fixed.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


class _Recorded(Exchange):
    """world.comm's all-to-all, each started one remembering that its wait has returned."""

    def __init__(self, world: World) -> None:
        self.comm, self.done = world.comm, []
        self.size, self.rank, self.ranks = world.comm.size, world.comm.rank, world.comm.ranks

    @property
    def where(self) -> str:
        return self.comm.where

    def start_all_to_all(
        self,
        x: torch.Tensor,
        send_splits: Sequence[int] | None = None,
        recv_splits: Sequence[int] | None = None,
        check: bool | None = None,
    ) -> PendingAllToAll:
        started = self.comm.start_all_to_all(x, send_splits, recv_splits, check)
        index = len(self.done)
        self.done.append(False)

        def wait() -> torch.Tensor:
            got = started.handle.wait()
            self.done[index] = True
            return got

        return replace(started, handle=Handle(wait))


class _Dense(torch.nn.Module):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.dense = torch.nn.Parameter(value.clone())


def check_pieces_leave_after_the_transfer_before_their_gap(world: World) -> None:
    """A piece planned for the gap after backward transfer 2 is released when that transfer
    is issued but sent only once it has completed; the averages are right."""
    g = torch.Generator().manual_seed(world.rank)
    counts = torch.full((world.size * 2,), 3)
    rows = torch.randn(int(counts.sum()), 4, generator=g)
    dense0 = torch.randn(64, generator=torch.Generator().manual_seed(99))  # replicated, as data parallelism keeps it

    def run(exchange: Any, dense: torch.Tensor, dp: DataParallel | None) -> None:
        y = pipelined_exchange(rows, counts, lambda r, c: r * 2.0, exchange, PipelineDegrees(1, 3))
        # dense after the exchange: its gradient is in before the exchange's backward starts
        loss = torch.tanh(y @ dense.view(4, 16)).square().sum()
        if dp is not None:
            dp.start()
        loss.backward()

    rows.requires_grad_()
    plain = dense0.clone().requires_grad_()
    run(world.comm, plain, None)
    want = world.comm.all_reduce(plain.grad, op="avg")

    model = _Dense(dense0)
    part = GradientPartition(pieces=(128, 128), gaps=(0, -1), exposed_s=0.0)
    recorded = _Recorded(world)
    dp = DataParallel(build_layout(ParallelDims(dp=world.size), world), "sparta", 1, False, partition=part,
                      openings=(2,))  # fmt: skip
    dp.wrap(model)
    sent_after: list[bool] = []
    assert dp.queue is not None
    submit = dp.queue.submit

    def checked_submit(key: Any, *args: Any, **kwargs: Any) -> Any:
        # transfers: the counts exchange, forward out 0 and back 0 (degree 1), then backward out 0, out 1, ...
        sent_after.append(key.name != "dense 0" or recorded.done[3 + 1])
        return submit(key, *args, **kwargs)

    dp.queue.submit = checked_submit  # type: ignore[method-assign]
    run(dp.watch(recorded), model.dense, dp)
    assert dp.release is not None and dp.release.released == 1, f"{dp.release.released} pieces released; want 1"
    dp.finish()
    dp.close()
    assert sent_after == [True, True], sent_after
    torch.testing.assert_close(model.dense.grad, want, rtol=1e-6, atol=1e-6)


CHECKS = [
    check_tuned_plan_is_agreed_and_leaves_the_layer_as_it_was,
    check_pieces_leave_after_the_transfer_before_their_gap,
]

if __name__ == "__main__":
    world, _ = start(ranks_per_node=2)
    finish(world, run_checks(world, CHECKS))
