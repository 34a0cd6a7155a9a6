"""The planner and the trainer's MoE blocks over micro-batches (`MoESpec.overlap`), and
FSDP2's reduction on CUDA without a schedule, on hand-made cost tables (one process): the
simulator replays an overlapped block to the second a hand computation gives, the search
tries the counts the layout allows, and plan files carry the choice into `sparta train`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sparta.errors import ConfigError
from sparta.parallel import DecoderConfig, MoESpec, ParallelConfig, ParallelDims
from sparta.parallel.config_file import load_config
from sparta.planner import GIB, ModelCosts, PartCost, Plan, Space, Workload, model_fingerprint, search, simulate
from sparta.planner.plan_file import plan_overrides, write_plan
from sparta.planner.search import SearchResult
from sparta.scheduling.profiler import LinearFit

MODEL = DecoderConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=4, n_heads=4, d_ff=32)
MOE = MoESpec(num_experts=4, top_k=2)
WORK = Workload(MODEL, MOE, global_batch=8)
ROW_BYTES = MODEL.d_model * 4 * MOE.top_k  # what one token sends: top_k float32 rows


def per_32_tokens(seconds: float) -> LinearFit:
    return LinearFit(0.0, seconds / 32, 0.0, ())


def part(fwd: float, bwd: float, params: int = 1000) -> PartCost:
    """Seconds per 32 tokens (four sequences: a dp rank's batch at dp 2); 1 byte saved per token."""
    return PartCost(per_32_tokens(fwd), per_32_tokens(bwd), per_32_tokens(bwd / 2), 1.0, params)


def costs(exchange_s: float = 1.0, device_type: str = "cpu", all_reduce: LinearFit | None = None) -> ModelCosts:
    """Attention and the MoE layer each 1 s forward and 2 s backward at 32 tokens; an
    all-to-all of 32 tokens' rows ``exchange_s``, in proportion to its bytes; nothing else
    costs (the all-reduces: ``all_reduce``, else nothing)."""
    zero = LinearFit(0.0, 0.0, 0.0, ())
    comm = {f"all_to_all/g{g}": LinearFit(0.0, exchange_s / (32 * ROW_BYTES), 0.0, ()) for g in (2, 4)}
    comm |= {f"{op}/g{g}": all_reduce or zero for g in (2, 4) for op in ("all_reduce", "all_gather")}
    comm["p2p"] = zero
    return ModelCosts(
        parts={
            "embed": part(0.0, 0.0, params=0),
            "attention": part(1.0, 2.0),
            "mlp": part(1.0, 2.0),
            "moe": part(1.0, 2.0),
            "head": part(0.0, 0.0, params=0),
        },
        comm=comm,
        optimizer=zero,
        model=model_fingerprint(MODEL, MOE),
        hardware={"device": "test", "device_type": device_type, "torch": "x"},
        world=4,
    )


def moe_plan(overlap: int = 1, pp: int = 1, data_parallel: str = "sparta", **fields: object) -> Plan:
    moe = dataclasses.replace(MOE, overlap=overlap, **fields)
    split = ("layers.2",) if pp == 2 else ()
    config = ParallelConfig(moe=moe, microbatches=pp, split_points=split, data_parallel=data_parallel)
    return Plan(ParallelDims(pp=pp, dp=2, ep=2), config)


def test_blocks_over_micro_batches_replay_the_overlapped_pipeline() -> None:
    c = costs()
    # 32 tokens a rank. Whole, a block is attention 1 s, the MoE layer 1 s and its two
    # all-to-alls 1 s each forward (4 s); 2 + 2 + 1 + 1 s backward (6 s): 4 blocks, 40 s
    whole = simulate(c, WORK, moe_plan())
    assert whole.step_s == pytest.approx(40.0)
    # Over 2 micro-batches (attention 0.5 s, experts 0.5 s, 0.5 s each way), forward:
    #   thread:  attn0 0-0.5, attn1 0.5-1, experts0 1-1.5, experts1 1.5-2
    #   link:    out0 0.5-1, out1 1-1.5, back0 1.5-2, back1 2-2.5            -> 2.5 s
    # backward (experts 1 s each, the attention's backward 1 s after its rows return):
    #   thread:  experts0 0.5-1.5, experts1 1.5-2.5, attn0 2.5-3.5, attn1 3.5-4.5
    #   link:    out0 0-0.5, out1 0.5-1, back0 1.5-2, back1 2.5-3               -> 4.5 s
    two = simulate(c, WORK, moe_plan(2), trace=True)
    assert two.step_s == pytest.approx(4 * (2.5 + 4.5))
    assert [s.name for s in two.spans[0]][:2] == ["0F0", "0B0"]
    # the same activations and parameters: micro-batches change when, not what, is saved
    assert two.peak_bytes == pytest.approx(whole.peak_bytes)
    # with nothing to hide, the blocks take their compute, whatever the count
    free = simulate(costs(exchange_s=0.0), WORK, moe_plan(4))
    assert free.step_s == pytest.approx(4 * (2.0 + 4.0))
    # "auto": the tuner's counts (1, 2, 4 up to the 4 sequences) each priced, deduplicated
    # too (each rank its own node here: the ep group spans 2), the fastest taken
    tried = [simulate(c, WORK, moe_plan(m, dedup=d)).step_s for m in (1, 2, 4) for d in (False, True)]
    auto = simulate(c, WORK, moe_plan(pipeline_degree="auto"))
    assert auto.step_s == pytest.approx(min(tried))
    assert auto.step_s < whole.step_s
    # ... except where the trainer leaves blocks whole: under fsdp
    assert simulate(c, WORK, moe_plan(pipeline_degree="auto", data_parallel="fsdp")).step_s == pytest.approx(
        simulate(c, WORK, moe_plan(data_parallel="fsdp")).step_s
    )
    assert "overlap2" in moe_plan(2).describe() and "overlap" not in moe_plan().describe()


def test_ranks_sharing_a_hosts_cores_hide_no_exchange() -> None:
    # 4 ranks, 2 a host and a node, 1 core a host: rows move on the cores, across the link or not
    shared = dataclasses.replace(costs(), slots=1, ranks_per_host=2, ranks_per_node=2)
    for dims in (ParallelDims(dp=2, ep=2), ParallelDims(dp=4, ep=4)):  # ep within a node, across
        whole, two = (simulate(shared, WORK, dataclasses.replace(moe_plan(m), dims=dims)).step_s for m in (1, 2))
        assert two == pytest.approx(whole)  # per-token fits: the same work, in turn
    # so the search leaves the blocks whole there
    assert not _overlapped(search(shared, WORK, 4, GIB, ParallelConfig(moe=MOE)))


def test_overlap_the_trainer_refuses_is_refused_by_name() -> None:
    c = costs()
    with pytest.raises(ConfigError, match=r"overlap=8 cuts each block's batch into whole sequences, but a pipeline "):
        simulate(c, WORK, moe_plan(8))
    with pytest.raises(ConfigError, match=r"MoESpec.overlap=2: ep=1 keeps every expert on its rank"):
        simulate(c, WORK, dataclasses.replace(moe_plan(2), dims=ParallelDims(dp=2)))


def test_the_search_tries_block_counts_where_the_layout_lets_blocks_overlap(tmp_path: Path) -> None:
    # exchanges dear enough that hiding them wins: the fastest plan with ep > 1 overlaps
    # (those without an exchange win here: every rank computes all its tokens' rows anyway)
    c = costs(exchange_s=4.0)
    base = ParallelConfig(moe=MOE)
    result = search(c, WORK, 4, GIB, base)
    best = next(r for r in result.fits if r.plan.dims.ep > 1)
    assert best.plan.config.moe.overlap > 1, best.plan.describe()
    whole = next(r for r in result.fits if r.plan.dims.ep > 1 and r.plan.config.moe.overlap == 1)
    assert best.prediction.step_s < whole.prediction.step_s
    overlapped = [r.plan for r in result.fits + result.over_budget if r.plan.config.moe.overlap > 1]
    assert overlapped and all(p.dims.ep > 1 and not p.config.recompute for p in overlapped)
    sequences = {p.describe(): WORK.global_batch // (p.dims.dp * p.config.microbatches) for p in overlapped}
    assert all(p.config.moe.overlap <= sequences[p.describe()] for p in overlapped)
    # not searched: when the space says so, a router whose routing spans the batch, "auto"
    # (the tuner's), or an overlap the run sets itself (kept, and refused where it cannot run)
    assert not _overlapped(search(c, WORK, 4, GIB, base, Space(overlaps=(1,))))
    capacity = dataclasses.replace(MOE, capacity_factor=1.25)
    assert not _overlapped(search(c, dataclasses.replace(WORK, moe=capacity), 4, GIB, ParallelConfig(moe=capacity)))
    auto = dataclasses.replace(MOE, pipeline_degree="auto")
    assert not _overlapped(search(c, WORK, 4, GIB, ParallelConfig(moe=auto)))
    fixed = search(c, WORK, 4, GIB, ParallelConfig(moe=dataclasses.replace(MOE, overlap=2)))
    assert {r.plan.config.moe.overlap for r in fixed.fits} == {2}
    assert any(reason.startswith("MoESpec.overlap=2") for reason in fixed.rejected), fixed.rejected
    with pytest.raises(ConfigError, match=r"Space.overlaps=\(0,\) must be positive integers"):
        Space(overlaps=(0,))

    # the plan file carries the count into the run
    path = tmp_path / "plan.toml"
    write_plan(path, best, WORK, 4, c)
    assert f"moe.overlap = {best.plan.config.moe.overlap}" in path.read_text()
    run = tmp_path / "run.toml"
    run.write_text(
        "[model]\nvocab_size = 64\nseq_len = 8\nd_model = 16\nn_layers = 4\nn_heads = 4\nd_ff = 32\n"
        "[parallel.moe]\nnum_experts = 4\ntop_k = 2\n[train]\nglobal_batch = 8\n[data]\nsource = 'random'\n"
    )
    config = load_config(run, plan_overrides(path, WORK))
    assert config.parallel.moe.overlap == best.plan.config.moe.overlap
    assert config.dims == best.plan.dims
    path.write_text(path.read_text().replace("moe.overlap", "moe.top_k"))
    with pytest.raises(ConfigError, match="not a plan file written by `sparta plan`"):
        plan_overrides(path, WORK)


def _overlapped(result: SearchResult) -> list[Plan]:
    return [r.plan for r in result.fits + result.over_budget if r.plan.config.moe.overlap > 1]


def test_fsdp_reduces_during_the_last_backward_on_cuda_when_one_stage_runs_without_a_schedule() -> None:
    reduce_s = 40.0  # every reduce-scatter: longer than the last backward, so part of it sticks out
    slow = LinearFit(reduce_s, 0.0, 0.0, ())

    def sync(device_type: str, pp: int) -> float:
        c = costs(device_type=device_type, all_reduce=slow)
        if device_type == "cuda":  # NCCL's reduce-scatter is priced as an all-gather, never an all-reduce
            never = LinearFit(1e6, 0.0, 0.0, ())
            c = dataclasses.replace(c, comm=c.comm | {f"all_reduce/g{g}": never for g in (2, 4)})
        return simulate(c, WORK, moe_plan(pp=pp, data_parallel="fsdp")).sync_s

    last_backward = 4 * (2.0 + 2.0 + 2.0)  # one micro-batch: 4 blocks of attention, experts, exchanges
    reduce_all = 4 * reduce_s  # one reduction per unit: the 4 layers (embedding and head hold none here)
    assert sync("cpu", 1) == pytest.approx(reduce_all)  # gloo: inside the backward, after it
    # on its stream, beside it: each unit's as its backward ends, so the backward after the
    # first of the four hides the rest's
    assert sync("cuda", 1) == pytest.approx(reduce_all - last_backward * 3 / 4)
    assert sync("cuda", 2) == pytest.approx(reduce_all / 2)  # a schedule holds it to the end (2 layers a rank)


def test_two_level_exchanges_price_their_hops_inside_and_across_nodes(tmp_path: Path) -> None:
    # 4 ranks, 2 a node; dp4 ep4: each rank 2 sequences (16 tokens), its experts' group over
    # both nodes. An all-to-all inside a node (2 ranks 1 apart) moves 2048 bytes a second,
    # across (2 ranks 2 apart) 3840; the flat one over 4 ranks 1024
    row = MODEL.d_model * 4
    comm = dict(costs().comm)
    comm["all_to_all/g2"] = LinearFit(0.0, 1 / 2048, 0.0, ())
    comm["all_to_all/g2s2"] = LinearFit(0.0, 1 / 3840, 0.0, ())
    comm["all_to_all/g4"] = LinearFit(0.0, 1 / 1024, 0.0, ())
    c = dataclasses.replace(costs(), comm=comm, ranks_per_node=2)
    dims = ParallelDims(dp=4, ep=4)

    def step(**moe: object) -> float:
        return simulate(c, WORK, dataclasses.replace(moe_plan(**moe), dims=dims)).step_s

    pairs = 16 * MOE.top_k * row  # 2048 bytes of rows a rank sends each way
    compute = 4 * (0.5 + 0.5 + 1.0 + 1.0)  # 4 blocks: attention and experts at 16 tokens
    # flat: two all-to-alls of the pairs a pass, over 4 ranks
    assert step() == pytest.approx(compute + 4 * 2 * 2 * pairs / 1024)
    # hierarchical: each all-to-all inside (1 s), then across (2048 / 3840 s)
    assert step(hierarchical=True) == pytest.approx(compute + 4 * 2 * 2 * (1 + pairs / 3840))
    # dedup: 2 experts a node, so a token needs 2 (1 - C(2, 2) / C(4, 2)) = 5/3 nodes; across
    # go its 5/3 rows out, each 64 bytes + 2 x 2 weights and slots, and back (1 s together);
    # inside a row per pair each way (2 s)
    assert 16 * 5 / 3 * (row + 16 + row) == pytest.approx(3840)
    assert step(dedup=True) == pytest.approx(compute + 4 * 2 * (1 + 2))
    # "auto" tries it, whole and over micro-batches, where the groups span nodes: it wins here
    auto = step(pipeline_degree="auto")
    assert auto == pytest.approx(min(step(overlap=m, dedup=True) for m in (1, 2)))
    assert auto < min(step(overlap=m) for m in (1, 2))

    # the search tries it on layouts whose ep groups span the nodes, and no others
    result = search(c, WORK, 4, GIB, ParallelConfig(moe=MOE))
    deduplicated = [r.plan for r in result.fits if r.plan.config.moe.dedup]
    assert deduplicated and all(p.dims.ep == 4 for p in deduplicated)
    assert {p.config.moe.overlap for p in deduplicated} >= {1, 2}
    plain = search(c, WORK, 4, GIB, ParallelConfig(moe=MOE), Space(dedup=False))
    assert not any(r.plan.config.moe.dedup for r in plain.fits)
    path = tmp_path / "plan.toml"
    write_plan(path, next(r for r in result.fits if r.plan.config.moe.dedup), WORK, 4, c)
    assert "moe.dedup = true" in path.read_text() and "parallel.moe.dedup=true" in plan_overrides(path, WORK)

    # groups that lie unevenly over the nodes (3 ranks, then 1) have no two-level exchange
    uneven = dataclasses.replace(c, ranks_per_node=3)
    for asked in ("dedup", "hierarchical"):
        with pytest.raises(ConfigError, match=rf"MoESpec.{asked}: the expert-parallel groups of 4 ranks do not lie"):
            simulate(uneven, WORK, dataclasses.replace(moe_plan(**{asked: True}), dims=dims))
    with pytest.raises(ConfigError, match=r"Space.dedup=1 must be True or False"):
        Space(dedup=1)  # type: ignore[arg-type]
