"""The cost model corrected by timed steps, the tuner's fall-back to r=1, router profiling
(one process: a world of one agrees timings with itself)."""

from __future__ import annotations

import time

import pytest
import torch

import sparta
from sparta.errors import ConfigError, InputError
from sparta.scheduling.chunks import PipelineDegrees
from sparta.scheduling.cost_model import Calibration, CostModel, LayerShape
from sparta.scheduling.profiler import LinearFit, Profile, ProfileConfig, Profiler
from sparta.scheduling.tuner import UNPIPELINED, Choice, OnlineTuner

SHAPE = LayerShape(tokens=4096, top_k=2, d_model=512, d_ff=1024, ep_size=4)


def balanced_profile() -> Profile:
    """Comm and compute about equal per chunk, 20 ms latency per all-to-all."""
    return Profile(
        {
            "all_to_all/world": LinearFit(0.02, 8e-9, 0.0, ()),
            "expert_fwd/512x1024": LinearFit(0.0, 1.6e-5, 0.0, ()),
            "expert_bwd/512x1024": LinearFit(0.0, 3.2e-5, 0.0, ()),
        }
    )


def test_fit_recovers_scale_and_efficiency_from_synthetic_steps() -> None:
    truth = Calibration(scale=1.3, efficiency=0.6)
    model = CostModel(balanced_profile())
    points = []
    for r in (1, 2, 4, 8):
        p = model.predict(SHAPE, r, hierarchical=False)
        overlapped, serial = p.forward_s + p.backward_s, p.forward_serial_s + p.backward_serial_s
        # oracle: the formula written out, not Calibration.__call__
        points.append((overlapped, serial, 1.3 * (serial - 0.6 * (serial - overlapped))))
    fit = Calibration.fit(points)
    assert fit.scale == pytest.approx(1.3, rel=1e-9) and fit.efficiency == pytest.approx(0.6, rel=1e-9)
    assert fit.rel_error < 1e-9
    assert fit(*points[2][:2]) == pytest.approx(points[2][2], rel=1e-9)
    assert truth(2.0, 4.0) == pytest.approx(1.3 * (4.0 - 0.6 * 2.0))
    # r=1 overlaps nothing: serial == overlapped
    one = model.predict(SHAPE, 1, hierarchical=False)
    assert one.forward_s == pytest.approx(one.forward_serial_s)
    assert one.backward_s == pytest.approx(one.backward_serial_s)


def test_fit_clamps_efficiency_and_handles_one_kind_of_point() -> None:
    # measured faster than even perfect overlap: efficiency stays at 1, scale takes the rest
    over = Calibration.fit([(1.0, 1.0, 1.0), (1.0, 2.0, 0.5)])
    assert over.efficiency == 1.0 and over.rel_error > 0.1
    only_serial = Calibration.fit([(2.0, 2.0, 3.0)])
    assert (only_serial.scale, only_serial.efficiency) == (pytest.approx(1.5), 1.0)
    with pytest.raises(InputError, match="overlapped <= serial"):
        Calibration.fit([(3.0, 2.0, 1.0)])
    with pytest.raises(ConfigError, match="efficiency = 1.5"):
        Calibration(1.0, 1.5)


def test_no_measured_overlap_plans_one_chunk() -> None:
    profile = balanced_profile()
    assert CostModel(profile).plan(SHAPE, hierarchical=False).degrees.forward > 1
    # the same fits, but steps showed the pipeline hides nothing: chunks only add latency
    plan = CostModel(profile, Calibration(scale=2.0, efficiency=0.0)).plan(SHAPE, hierarchical=False)
    assert plan.degrees == PipelineDegrees(1, 1)
    one = CostModel(profile).predict(SHAPE, 1, hierarchical=False)
    assert plan.forward_s == pytest.approx(2.0 * one.forward_s)
    assert plan.ranked(2)[0] == plan.choice and plan.ranked(2)[1].degrees == PipelineDegrees(2, 2)


def test_tuner_keeps_the_baseline_unless_clearly_beaten() -> None:
    world = sparta.init(backend="torch")
    piped = Choice(PipelineDegrees(4, 4), hierarchical=False)
    # piped's two timed trials: medians (mean of the two) 0.99 and 0.95 against r=1's 1.0;
    # the warm-up round (100 s) is not counted
    for trials, want in (((0.98, 1.0), UNPIPELINED), ((0.9, 1.0), piped)):
        tuner = OnlineTuner(world.comm, [piped, UNPIPELINED], trials=2, baseline=UNPIPELINED, margin=0.03, warmup=1)
        left = iter(trials)
        for round_ in range(3):
            assert tuner.chosen is None and tuner.current == piped
            tuner.observe(100.0 if round_ == 0 else next(left))
            tuner.observe(100.0 if round_ == 0 else 1.0)
        assert tuner.chosen == want and tuner.current == want
        assert tuner.measured == {piped: pytest.approx(sum(trials) / 2), UNPIPELINED: 1.0}
    with pytest.raises(ConfigError, match="baseline"):
        OnlineTuner(world.comm, [piped], baseline=UNPIPELINED)
    with pytest.raises(ConfigError, match="margin = 1.0"):
        OnlineTuner(world.comm, [piped], margin=1.0)


def test_router_profile_and_its_time_in_the_plan() -> None:
    world = sparta.init(backend="torch")
    gate = torch.nn.Linear(256, 64, bias=False)

    def route(x: torch.Tensor) -> torch.Tensor:
        return torch.topk(torch.softmax(gate(x), dim=-1), 2, dim=-1).values

    profiler = Profiler(world.comm, {}, ProfileConfig(rows=(16, 32768), repeats=3, warmup=1))
    fits = profiler.router("topk", route, d_model=256).fits
    assert set(fits) == {"router_fwd/topk", "router_bwd/topk"}
    # 2048 times the tokens take longer (a generous oracle on a shared machine)
    assert all(len(f.samples) == 2 and f.samples[1][1] > 2 * f.samples[0][1] > 0 for f in fits.values())
    model = CostModel(balanced_profile() | Profile(fits))
    fwd, bwd = model.router(SHAPE, "topk")
    assert fwd == pytest.approx(fits["router_fwd/topk"](SHAPE.tokens)) and bwd > 0
    assert model.plan(SHAPE, router="topk").router_s == (fwd, bwd)
    assert CostModel(balanced_profile()).plan(SHAPE).router_s == (0.0, 0.0)


def test_back_to_back_samples_time_one_run_of_several_queued() -> None:
    """`ProfileConfig.back_to_back`: each sample runs the operation that many times before
    one wait for the device and reports their mean, so a 5 ms operation still reads 5 ms."""
    world = sparta.init(backend="torch")
    calls = []

    def run() -> None:
        calls.append(1)
        time.sleep(0.005)

    profiler = Profiler(world.comm, {}, ProfileConfig(repeats=3, warmup=1, back_to_back=4))
    seconds = profiler.time(run)
    assert len(calls) == 1 + 3 * 4  # the warm-up, then 3 samples of 4
    assert 0.005 <= seconds < 0.010
    with pytest.raises(ConfigError, match="back_to_back = 0"):
        ProfileConfig(back_to_back=0)
