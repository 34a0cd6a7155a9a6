"""Least-squares fits, profile files, the pipeline simulation and the degree choice (one process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparta.errors import ConfigError
from sparta.scheduling.chunks import PipelineDegrees
from sparta.scheduling.cost_model import CostModel, LayerShape
from sparta.scheduling.profiler import LinearFit, Profile, ProfileConfig
from sparta.scheduling.timeline import timeline

SHAPE = LayerShape(tokens=4096, top_k=2, d_model=512, d_ff=1024, ep_size=4)


def line(alpha: float, beta: float, ns: tuple[float, ...] = (1e3, 1e4, 1e5, 1e6)) -> LinearFit:
    return LinearFit.fit([(n, alpha + beta * n) for n in ns])


def profile(inter_beta: float, world_beta: float, compute_beta: float, alpha: float = 1e-4) -> Profile:
    """A synthetic profile: seconds per byte on the links, per row for the experts."""
    rows = (256.0, 1024.0, 4096.0)
    return Profile(
        {
            "all_to_all/world": line(alpha, world_beta),
            "all_to_all/inter": line(alpha, inter_beta),
            "all_to_all/intra": line(alpha, 1e-10),
            "expert_fwd/512x1024": line(1e-5, compute_beta, rows),
            "expert_bwd/512x1024": line(2e-5, 2 * compute_beta, rows),
        }
    )


def test_fit_recovers_a_line_and_reports_its_error() -> None:
    fit = line(2e-3, 5e-9)
    assert fit.alpha == pytest.approx(2e-3) and fit.beta == pytest.approx(5e-9)
    assert fit.rel_error < 1e-9 and fit(1e6) == pytest.approx(2e-3 + 5e-3)
    noisy = LinearFit.fit([(1, 1.0), (2, 2.5), (3, 2.9)])
    assert noisy.rel_error > 0.05
    with pytest.raises(Exception, match="two or more sizes"):
        LinearFit.fit([(1, 1.0), (1, 2.0)])


def test_interpolation_reads_the_samples_the_fit_misses() -> None:
    # a latency floor then bandwidth (a 4-rank all-gather on 8 ranks over 2 cores, seconds
    # vs bytes per rank): least squares through the origin misses the floor at 64 KiB
    fit = LinearFit.fit([(65536, 0.0105), (262144, 0.0123), (1048576, 0.0216), (4194304, 0.2286)])
    assert fit(65536) < 0.005
    assert fit.interpolate(65536) == pytest.approx(0.0105)
    assert fit.interpolate((262144 + 1048576) / 2) == pytest.approx((0.0123 + 0.0216) / 2)
    # beyond the samples, along the fit's slope from the nearest; never below 0
    assert fit.interpolate(2 * 4194304) == pytest.approx(0.2286 + fit.beta * 4194304)
    assert fit.interpolate(0) == pytest.approx(max(0.0105 - fit.beta * 65536, 0.0))
    # below the smallest size, never under that size's time in proportion (a steep slope
    # would take it to 0): a send across a slow link
    link = LinearFit.fit([(65536, 0.0079), (262144, 0.0439), (1048576, 0.2634)])
    assert link.interpolate(16384) == pytest.approx(0.0079 / 4)
    assert LinearFit(1.0, 2.0, 0.0, ()).interpolate(3) == 7.0  # no samples (published figures): the line


def test_profile_round_trips_through_json(tmp_path: Path) -> None:
    p = profile(1e-8, 2e-8, 1e-6)
    p.save(tmp_path / "p.json")
    q = Profile.load(tmp_path / "p.json")
    assert q.fits == p.fits
    with pytest.raises(ConfigError, match="no fit for 'all_gather/world'"):
        q.fit("all_gather", "world")


def simulate(degree: int, comm_s: float, compute_s: float) -> float:
    """End time of `degree` equal chunks, each `comm_s` each way and `compute_s` of compute."""
    return timeline([comm_s] * degree, [compute_s] * degree).end_s


def test_simulation_bounds() -> None:
    # one chunk: out, compute, back, nothing overlaps
    assert simulate(1, 2.0, 3.0) == pytest.approx(7.0)
    # many chunks approach the busier resource (network carries out + back: 4.0)
    assert simulate(64, 2.0 / 64, 3.0 / 64) == pytest.approx(4.0 + 2 * 3.0 / 64, rel=0.05)
    assert simulate(4, 1.0, 1.0) < simulate(1, 4.0, 4.0)


def test_tapered_chunks_shorten_a_compute_bound_pipeline() -> None:
    # compute-bound (2 s of transfers each way against 8 s of compute), 4 chunks: equal
    # ones expose the first transfer in (0.5) and the last one back (0.5)
    assert simulate(4, 0.5, 2.0) == pytest.approx(9.0)
    # sizes 1, 2, 2, 1 (taper 1): the ends are 1/6 of the rows each
    comm, compute = [2.0 * w / 6 for w in (1, 2, 2, 1)], [8.0 * w / 6 for w in (1, 2, 2, 1)]
    line = timeline(comm, compute)
    assert line.end_s == pytest.approx(8.0 + 2 * 2.0 / 6)
    assert len(line.network) == 8 and len(line.compute) == 4
    with pytest.raises(Exception, match="one of each per chunk"):
        timeline([1.0, 1.0], [1.0])


def test_plan_tapers_when_compute_dominates() -> None:
    # transfers a quarter of the compute, per-transfer latency small: tapered ends pay
    model = CostModel(profile(2e-9, 2e-9, 3.2e-5, alpha=1e-4))
    plan = model.plan(SHAPE, max_degree=6, hierarchical=False)
    assert plan.degrees.taper > 0 and plan.degrees.backward > 2
    flat = model.predict_degrees(SHAPE, PipelineDegrees(plan.degrees.forward, plan.degrees.backward), False)
    assert plan.forward_s + plan.backward_s < flat.forward_s + flat.backward_s
    # the plan's prediction is the simulation of its own tapered cut
    again = model.predict_degrees(SHAPE, plan.degrees, False)
    assert (again.forward_s, again.backward_s) == pytest.approx((plan.forward_s, plan.backward_s))


def test_plan_pipelines_when_comm_and_compute_balance() -> None:
    # 16 MiB per exchange at ~8 ns/byte = 0.13 s; 8192 rows at 16 us/row = 0.13 s
    model = CostModel(profile(8e-9, 1e-8, 1.6e-5))
    plan = model.plan(SHAPE)
    assert plan.degrees.forward > 1 and plan.degrees.backward > 1
    flat1 = model.predict(SHAPE, 1, hierarchical=False)
    assert plan.forward_s + plan.backward_s < (flat1.forward_s + flat1.backward_s) / 1.3
    assert plan.hierarchical  # its inter link is cheaper per byte than the flat exchange here
    # 2 forms x each degree's distinct cuts (tapers up to floor((r - 1) / 2) change it)
    assert len(plan.candidates) == 2 * (1 + 1 + 2 + 2 + 3 + 3 + 4 + 4)
    ranked = plan.ranked(3)
    assert ranked[0] == plan.choice and len(set(ranked)) == 3


def test_plan_keeps_one_chunk_when_latency_dominates() -> None:
    model = CostModel(profile(1e-13, 1e-13, 1e-9, alpha=0.05))
    plan = model.plan(SHAPE, hierarchical=False)
    assert (plan.degrees.forward, plan.degrees.backward, plan.hierarchical) == (1, 1, False)


def test_bad_values() -> None:
    with pytest.raises(ConfigError, match="top_k = 0"):
        LayerShape(tokens=1, top_k=0, d_model=1, d_ff=1, ep_size=1)
    with pytest.raises(ConfigError, match="bytes"):
        ProfileConfig(bytes=(8,))
    with pytest.raises(ConfigError, match="max_degree = 0"):
        CostModel(profile(1e-8, 1e-8, 1e-6)).plan(SHAPE, max_degree=0)


def test_whole_hierarchical_fit_is_preferred_over_its_steps() -> None:
    p = profile(1e-9, 8e-9, 1.6e-5)  # by its steps, hierarchical looks far cheaper...
    p.fits["all_to_all/hier"] = line(1e-4, 2e-8)  # ...but measured whole it is the slower
    assert not CostModel(p).plan(SHAPE).hierarchical


def test_hierarchical_intra_step_blocks_compute() -> None:
    # measured whole, the two-level exchange is mostly its intra-node step: that part runs on
    # the compute thread, so it cannot overlap compute and pipelining gains less
    fits = profile(1e-9, 1e-8, 1.6e-5).fits
    whole = {**fits, "all_to_all/hier": line(1e-4, 8e-9), "all_to_all/intra": line(1e-4, 6e-9)}
    blind = {k: v for k, v in whole.items() if k != "all_to_all/intra"}
    seen, unseen = (CostModel(Profile(f)).predict(SHAPE, 4, hierarchical=True) for f in (whole, blind))
    assert seen.forward_serial_s == pytest.approx(unseen.forward_serial_s)
    assert seen.forward_s > unseen.forward_s and seen.backward_s > unseen.backward_s


def test_latency_delays_a_transfer_without_holding_the_link() -> None:
    # one chunk: latency or not, out + compute + back
    assert timeline([2.0], [3.0], latency_s=0.5).end_s == pytest.approx(7.0)
    # two chunks of 1 s transfers, 0.5 s of it latency. Out 1 is issued when out 0 is in
    # (at 1.0) and arrives at 2.0 either way; back 0 (issued at 1.1) moves its data while
    # out 1's last bytes are in flight instead of queueing behind all of out 1
    held, released = timeline([1.0] * 2, [0.1] * 2), timeline([1.0] * 2, [0.1] * 2, latency_s=0.5)
    assert held.compute[1][0] == pytest.approx(2.0) and released.compute[1][0] == pytest.approx(2.0)
    assert held.end_s == pytest.approx(4.0) and released.end_s == pytest.approx(3.1)
    # the channel's busy spans exclude latency: the gaps a gradient piece can use grow
    busy = sum(e - b for b, e in released.network)
    assert busy == pytest.approx(4 * 0.5)


def test_dense_layers_on_the_pipeline_ends_overlap_the_transfers() -> None:
    # two micro-batches, 1 s each way, 1 s of experts, 0.5 s before and after each: before 1
    # runs while out 0 travels, after 0 while back 1 does; only before 0 and after 1 add
    line2 = timeline([1.0] * 2, [1.0] * 2, before_s=0.5, after_s=0.5)
    assert line2.end_s == pytest.approx(0.5 + 1.0 + 1.0 + 1.0 + 1.0 + 0.5)
    assert sorted(line2.compute)[:2] == [(0.0, 0.5), (0.5, 1.0)]
    # with nothing on the ends the replay is the plain pipeline's
    assert timeline([1.0] * 3, [0.4] * 3, before_s=0.0).end_s == pytest.approx(simulate(3, 1.0, 0.4))
    with pytest.raises(Exception, match="2 before and 3 after"):
        timeline([1.0] * 3, [0.4] * 3, before_s=[0.1, 0.1], after_s=0.0)


def test_microbatched_prediction_counts_the_dense_layers() -> None:
    rows = (256.0, 1024.0, 4096.0)
    fits = {
        **profile(1e-8, 2e-8, 1e-6).fits,
        "dense_fwd/pre": line(0.0, 1e-5, rows),
        "dense_bwd/pre": line(0.0, 2e-5, rows),
        "dense_fwd/post": line(0.0, 2e-5, rows),
        "dense_bwd/post": line(0.0, 4e-5, rows),
    }
    model = CostModel(Profile(fits))
    one = model.predict_microbatched(SHAPE, 1, False, "pre", "post")
    plain = model.predict(SHAPE, 1, False)
    dense_fwd, dense_bwd = 4096 * 3e-5, 4096 * 6e-5
    counts = fits["all_to_all/world"].alpha
    assert one.forward_s == pytest.approx(plain.forward_s + dense_fwd + counts)
    assert one.backward_s == pytest.approx(plain.backward_s + dense_bwd)
    # cut in four, most of the dense time hides behind the transfers (comm-bound here)
    four = model.predict_microbatched(SHAPE, 4, False, "pre", "post")
    assert four.forward_s < one.forward_s - dense_fwd / 2 and four.backward_s < one.backward_s - dense_bwd / 2
    # serially, each extra micro-batch pays the fixed costs again: counts, out and back, experts
    fixed = counts + 2 * fits["all_to_all/world"].alpha + fits["expert_fwd/512x1024"].alpha
    assert four.forward_serial_s == pytest.approx(one.forward_serial_s + 3 * fixed)
    with pytest.raises(ConfigError, match="microbatches = 0"):
        model.predict_microbatched(SHAPE, 0, False, "pre", "post")


def test_a_microbatched_choice_exchanges_each_microbatch_whole() -> None:
    from sparta.scheduling.tuner import Choice

    assert Choice(PipelineDegrees(1, 1), False, microbatches=4).microbatches == 4
    with pytest.raises(ConfigError, match="microbatches = 0"):
        Choice(PipelineDegrees(1, 1), False, microbatches=0)
    with pytest.raises(ConfigError, match="give PipelineDegrees"):
        Choice(PipelineDegrees(4, 4), False, microbatches=2)
