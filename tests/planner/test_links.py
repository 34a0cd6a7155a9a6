"""Where the planner's collectives cross a node's link (one process, hand-made costs): a
pipeline hop between ranks of two nodes is priced on a measured pair that crosses them."""

from __future__ import annotations

import pytest

from sparta.parallel import DecoderConfig, ParallelConfig, ParallelDims
from sparta.planner import ModelCosts, PartCost, Plan, Workload, model_fingerprint, simulate
from sparta.scheduling.profiler import LinearFit

MODEL = DecoderConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=4, n_heads=4, d_ff=32)
WORK = Workload(MODEL, None, global_batch=8)


def const(seconds: float) -> LinearFit:
    return LinearFit(seconds, 0.0, 0.0, ())


def costs(ranks_per_node: int, across_s: float = 0.5) -> ModelCosts:
    """A layer: 1 s forward, 2 s backward; a send between neighbours 0 s, between ranks 2
    apart (across 2-rank nodes) ``across_s``; nothing else costs."""
    part = PartCost(const(0.5), const(1.0), const(0.5), 1.0, 1000)
    free = PartCost(const(0.0), const(0.0), const(0.0), 0.0, 0)
    zero = const(0.0)
    comm = {f"{op}/g{g}": zero for g in (2, 4) for op in ("all_reduce", "all_gather", "all_to_all")}
    comm |= {"p2p": zero, "p2p/s2": const(across_s)}
    return ModelCosts(
        parts={"embed": free, "attention": part, "mlp": part, "head": free},
        comm=comm,
        optimizer=zero,
        model=model_fingerprint(MODEL, None),
        hardware={"device": "test", "device_type": "cpu", "torch": "x"},
        world=4,
        ranks_per_node=ranks_per_node,
    )


def test_a_pipeline_hop_across_a_nodes_link_is_priced_on_a_pair_that_crosses_it() -> None:
    plan = Plan(ParallelDims(pp=4), ParallelConfig(schedule="GPipe", split_points=("layers.1", "layers.2", "layers.3")))
    # one micro-batch through 4 one-layer stages: 4 x 1 s forward, 4 x 2 s backward
    assert simulate(costs(ranks_per_node=4), WORK, plan).step_s == pytest.approx(12.0)
    # nodes of 2 ranks: the hop from stage 1 to 2 crosses the link, forward and backward
    assert simulate(costs(ranks_per_node=2), WORK, plan).step_s == pytest.approx(12.0 + 2 * 0.5)
    # two replicas a pipeline rank (dp2): both pairs of the hop 0 -> 1 cross, as all the
    # measured pairs did, so the figure is the pair's own
    dp2 = Plan(ParallelDims(pp=2, dp=2), ParallelConfig(schedule="GPipe", split_points=("layers.2",)))
    c = costs(ranks_per_node=2)
    assert c.hop(64.0, 0, 2, 2) == pytest.approx(0.5) and c.hop(64.0, 0, 1, 1) == 0.0
    # 2 layers a stage: 2 s on each stage forward and 4 s backward, a hop each way between
    assert simulate(c, WORK, dp2).step_s == pytest.approx(2 * 2.0 + 0.5 + 2 * 4.0 + 0.5)


def test_sends_across_a_link_queue_on_it() -> None:
    # pp2 dp2 over two nodes, 2 micro-batches: a stage takes 2 s forward, 4 s backward, and a
    # hop across the link 3 s, longer than the stage, so the second waits for the first:
    #   stage 0: F0 0-2, F1 2-4; the link: F0 2-5, F1 5-8 (not 4-7)
    #   stage 1: F0 5-7, F1 8-10, B0 10-14, B1 14-18; the link back: 14-17, 18-21
    #   stage 0: B0 17-21, B1 21-25
    plan = Plan(ParallelDims(pp=2, dp=2), ParallelConfig(schedule="GPipe", microbatches=2, split_points=("layers.2",)))
    assert simulate(costs(ranks_per_node=2, across_s=3.0), WORK, plan).step_s == pytest.approx(25.0)
