"""The simulator on hand-made cost tables (one process, no launch): small schedules replayed to
the second a hand computation gives, and each layout's collectives, sharding and memory
entering where the trainer puts them."""

from __future__ import annotations

import dataclasses

import pytest

from sparta.parallel import ParallelConfig, ParallelDims, schedule_actions
from sparta.planner import (
    Plan,
    Prediction,
    simulate,
)
from sparta.planner.replay import replay
from sparta.planner.stage_cost import StageCost

from .cost_tables import MODEL, WORK, costs, plan


def test_the_simulator_replays_small_schedules_exactly() -> None:
    c = costs()  # two layers per stage: F = 1 s, B = 2 s per micro-batch
    # 1F1B, 2 stages, 4 micro-batches, worked by hand from the action lists:
    # rank 0: F0 0-1, F1 1-2, B0 4-6, F2 6-7, B1 7-9, F3 9-10, B2 10-12, B3 13-15
    # rank 1: F0 1-2, B0 2-4, F1 4-5, B1 5-7, F2 7-8, B2 8-10, F3 10-11, B3 11-13
    assert schedule_actions("1F1B", 2, 4)[1][:4] == ["1F0", "1B0", "1F1", "1B1"]
    p = simulate(c, WORK, plan(2, "1F1B", 4, ("layers.2",)), trace=True)
    assert p.step_s == pytest.approx(15.0) and p.sync_s == 0 and p.optimizer_s == 0
    starts = {s.name: (s.start_s, s.end_s) for s in p.spans[0]}
    assert starts["0B0"] == (4.0, 6.0) and starts["0F3"] == (9.0, 10.0) and starts["0B3"] == (13.0, 15.0)
    # activations: 1F1B holds two micro-batches on rank 0, GPipe all four (same time at 2 stages)
    tokens = 8 // 4 * MODEL.seq_len
    per_mb = 2 * 2 * tokens  # two layers x two parts x 1 byte per token
    gpipe = simulate(c, WORK, plan(2, "GPipe", 4, ("layers.2",)))
    assert gpipe.step_s == pytest.approx(15.0)
    params = (2 * 2 * 1000) * 16  # two layers x two parts x 1000 parameters x (param, grad, 2 moments)
    assert p.peak_bytes[0] == pytest.approx(params + 2 * per_mb)
    assert gpipe.peak_bytes[0] == pytest.approx(params + 4 * per_mb)
    # one stage: forward then backward of every micro-batch, 4 x (2 + 4) s
    assert simulate(c, WORK, plan(1, "1F1B", 4, ())).step_s == pytest.approx(24.0)
    # recomputing both stages: every backward runs its stage's forward again (B = 3 s), so
    # (4 + 1) x (1 + 3) s; the stage keeps only its blocks' inputs (16 tokens x 16 x 4 bytes each)
    recomputed = Plan(ParallelDims(pp=2), ParallelConfig(microbatches=4, split_points=("layers.2",), recompute=(0, 1)))
    r = simulate(c, WORK, recomputed)
    assert r.step_s == pytest.approx(20.0)
    inputs = 2 * tokens * MODEL.d_model * 4
    assert r.peak_bytes[0] == pytest.approx(params + 2 * inputs + 2 * tokens)  # + one block's, recomputing


def test_zero_bubble_passes_cost_their_measured_split() -> None:
    # ZBV, both stages on one rank: no bubble, so the step is every action's seconds. Per
    # stage and micro-batch F = 1 s, B = 2 s of which the input half 1 s: 8 x (1 + 2) s; with
    # torch's split measured at 1.5 B, I and W take half as long again: 8 x (1 + 3) s
    zbv = plan(1, "ZBVZeroBubble", 4, ("layers.2",), spr=2)
    c = costs()
    assert simulate(c, WORK, zbv).step_s == pytest.approx(24.0)
    slow = {k: dataclasses.replace(p, zero_bubble=1.5) for k, p in c.parts.items()}
    assert simulate(dataclasses.replace(c, parts=slow), WORK, zbv).step_s == pytest.approx(32.0)
    # schedules that do not split the backward do not pay it
    gpipe = plan(1, "GPipe", 4, ())
    assert simulate(dataclasses.replace(c, parts=slow), WORK, gpipe).step_s == simulate(c, WORK, gpipe).step_s


def test_ranks_sharing_a_host_share_its_speed() -> None:
    # 2 ranks on a host that computes one at full speed: when both compute, each runs at half.
    # GPipe, 2 stages, 2 micro-batches of 32 tokens (stage F = 2 s, B = 4 s), worked by hand:
    # r0 F0 0-2 alone; r0 F1 and r1 F0 together 2-6; r1 F1 6-8, B0 8-12 alone; r0 B0 and r1 B1
    # together 12-20; r0 B1 20-24 alone. With a core each: 18 s.
    shared = dataclasses.replace(costs(), slots=1, ranks_per_host=2)
    gpipe = plan(2, "GPipe", 2, ("layers.2",))
    assert simulate(costs(), WORK, gpipe).step_s == pytest.approx(18.0)
    assert simulate(shared, WORK, gpipe).step_s == pytest.approx(24.0)
    # dp2 on that host: both replicas always compute together, at half speed: 2 x (4 + 8) s
    assert simulate(shared, WORK, plan(1, "1F1B", 1, (), dp=2)).pipeline_s == pytest.approx(24.0)
    # tp2 there: the compute is shared, the collectives are not (measured with both ranks at them).
    # Per block forward 1 s of compute at half speed + two 0.25 s all-reduces, backward 2 s + 0.5 s:
    # 4 x (2 + 0.5) + 4 x (4 + 0.5), the head's backward all-reduce of its input gradient (its
    # vocabulary split over tp), then the two scalar all-reduces over the world
    tp_shared = dataclasses.replace(costs(comm_s=0.25), slots=1, ranks_per_host=2)
    assert simulate(tp_shared, WORK, plan(1, "1F1B", 1, (), tp=2)).step_s == pytest.approx(28.0 + 0.25 + 0.5)


def test_a_rank_in_its_collectives_shares_a_node_with_the_computing_ones() -> None:
    # GPipe, 2 stages on 2 ranks of a host that computes one at full speed, 2 micro-batches.
    # Stage 0: F 2 s of compute then 2 s in its collectives, B 2 s; stage 1: F 6 s, B 2 s.
    # Worked by hand: r0 F0 computes 0-2, waits 2-4; r0 F1 and r1 F0 compute together at half
    # speed 4-8 (r1 has 4 s left); r0 F1 waits 8-10.
    #   across nodes (the wait is the link's): r1 alone 8-12, F1 12-18, B0 18-20; both B at
    #   half 20-24; r0 B1 24-26.
    #   on one node (the wait takes the cores too): r1 at half 8-10, alone 10-13, F1 13-19,
    #   B0 19-21; both B 21-25; r0 B1 25-27.
    def stage(fwd: float, comm: float) -> StageCost:
        return StageCost(fwd, 2.0, 2.0, 2.0, comm, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)

    def finish(one_node: bool) -> float:
        _, free, _ = replay(
            schedule_actions("GPipe", 2, 2),
            [stage(2.0, 2.0), stage(6.0, 0.0)],
            {0: 0, 1: 1},
            {(0, 1): (0.0, None), (1, 0): (0.0, None)},
            zero_bubble=False,
            unshard={},
            trace=False,
            share=1.0,
            waits_compete=one_node,
        )
        return max(free.values())

    assert finish(False) == pytest.approx(26.0)
    assert finish(True) == pytest.approx(27.0)


def test_collectives_enter_where_the_layout_puts_them() -> None:
    c = costs(comm_s=0.25)
    base = simulate(c, WORK, plan(1, "1F1B", 1, ())).step_s  # no group of more than one rank
    assert base == pytest.approx(4 * 2.0 + 4 * 4.0)  # 64 tokens: 2 s forward, 4 s backward per block
    # tp2: each block's compute halves, two all-reduces forward and two backward per block;
    # the head's vocabulary split over tp adds one backward (its input gradient); then the
    # step's two scalar all-reduces over the world (the clip's norm, the loss)
    tp = simulate(c, WORK, plan(1, "1F1B", 1, (), tp=2)).step_s
    assert tp == pytest.approx(4 * (1.0 + 2 * 0.25) + 4 * (2.0 + 2 * 0.25) + 0.25 + 2 * 0.25)
    # dp2: the gradients fill one 25 MiB bucket, sent once the backward has made it: all of
    # the all-reduce shows. In buckets of a quarter of them the backward (16 s) hides all but
    # the last one's share
    assert simulate(c, WORK, plan(1, "1F1B", 1, (), dp=2)).sync_s == pytest.approx(0.25)
    quarter_mib = 4 * 2 * 1000 * 4 / 4 / 2**20  # 4 blocks of two 1000-parameter halves, float32
    quarter = Plan(ParallelDims(dp=2), ParallelConfig(schedule="1F1B", split_points=(), bucket_mb=quarter_mib))
    assert simulate(c, WORK, quarter).sync_s == pytest.approx(0.25 / 4)
    # DDP takes torch's own 25 MiB buckets whatever bucket_mb says: one bucket here
    ddp = Plan(quarter.dims, dataclasses.replace(quarter.config, data_parallel="ddp"))
    assert simulate(c, WORK, ddp).sync_s == pytest.approx(0.25)
    # under a zero-bubble schedule the weight passes set .grad by hand: no bucket goes during
    # the backward, and the whole all-reduce shows however small the buckets
    zb = Plan(ParallelDims(pp=2, dp=2), ParallelConfig(schedule="ZBVZeroBubble", stages_per_rank=2, microbatches=2,
                                                       split_points=("layers.1", "layers.2", "layers.3"),
                                                       bucket_mb=quarter_mib))  # fmt: skip
    assert simulate(c, WORK, zb).sync_s == pytest.approx(0.25)


def test_fsdp_gathers_each_unit_where_a_traced_step_does() -> None:
    # every collective 0.25 s; four layer units that reshard after forward, and the head
    # (1000 parameters here) that does not. Counts as traced steps of the trainer show them
    # (FSDP::all_gather per unit): m + 1 per resharding unit over m micro-batches, one under
    # a zero-bubble schedule (kept gathered), one for the head
    c = costs(comm_s=0.25)
    c.parts["head"] = dataclasses.replace(c.parts["head"], params=1000)

    def extra(schedule: str, pp: int, spr: int = 1) -> tuple[float, float]:
        split = tuple(f"layers.{i}" for i in range(4 // (pp * spr), 4, 4 // (pp * spr)))

        def run(strategy: str) -> Prediction:
            config = ParallelConfig(
                schedule=schedule, microbatches=4, stages_per_rank=spr, split_points=split, data_parallel=strategy
            )
            return simulate(c, WORK, Plan(ParallelDims(pp=pp, dp=2), config))

        fsdp, sparta = run("fsdp"), run("sparta")
        return fsdp.pipeline_s - sparta.pipeline_s, fsdp.sync_s

    for schedule in ("1F1B", "GPipe", "Interleaved1F1B"):
        gathered, sync = extra(schedule, 1, 2 if schedule == "Interleaved1F1B" else 1)
        assert gathered == pytest.approx((4 + 1) * 4 * 0.25 + 0.25), schedule
        # the reductions after the last backward, not overlapped: one per unit, as FSDP2
        # reduce-scatters them (the four layers and the head)
        assert sync == pytest.approx(5 * 0.25)
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble"):
        assert extra(schedule, 1, 2)[0] == pytest.approx(4 * 0.25 + 0.25), schedule
    # two stages: stage 1's gathers wait on stage 0's, which are fewer per stage
    assert extra("GPipe", 2)[0] < extra("GPipe", 1)[0]


def test_fsdp_holds_its_units_whole_where_a_schedule_defers_their_reduction() -> None:
    # 4 layer units of 2000 parameters (two 1000-parameter halves). Under fsdp over dp2 the
    # AdamW state halves (16 bytes a parameter over dp), but torch's schedules keep every
    # unit gathered and its gradient whole until the step's reduction: 8 bytes a parameter
    # more; so does one stage over several micro-batches. One stage and one micro-batch: only
    # the unit at hand is whole. "sparta" keeps each bucket's flat buffer: 4 bytes a parameter
    c = costs()
    layers = 4 * 2000

    def peak(strategy: str, pp: int, microbatches: int = 2) -> float:
        split = ("layers.2",) if pp == 2 else ()
        config = ParallelConfig(schedule="GPipe", microbatches=microbatches, split_points=split,
                                data_parallel=strategy)  # fmt: skip
        return simulate(c, WORK, Plan(ParallelDims(pp=pp, dp=2), config)).peak_bytes[0]

    per_rank = layers / 2  # pp2: two layers a pipeline rank
    assert peak("sparta", 2) - peak("fsdp", 2) == pytest.approx(20 * per_rank - 16 * per_rank / 2 - 8 * per_rank)
    assert peak("sparta", 1) - peak("fsdp", 1) == pytest.approx(20 * layers - 16 * layers / 2 - 8 * layers)
    assert peak("sparta", 1, 1) - peak("fsdp", 1, 1) == pytest.approx(20 * layers - 16 * layers / 2 - 8 * 2000)
