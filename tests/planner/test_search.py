"""The search on hand-made cost tables (one process, no launch): it finds the known best plan,
weighs recomputation, sharding and head stages, its plan files round-trip into `sparta
train`'s overrides, and bad input is refused by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from sparta.cli import main as sparta_main
from sparta.errors import ConfigError
from sparta.parallel import MoESpec, ParallelConfig, ParallelDims
from sparta.parallel.config_file import load_config
from sparta.planner import (
    GIB,
    ModelCosts,
    Plan,
    Space,
    Workload,
    layouts,
    search,
    simulate,
    stage_layers,
)
from sparta.planner.plan_file import plan_overrides, write_plan
from sparta.planner.search import FSDP_ALONE, SPARSE_ALONE
from sparta.scheduling.profiler import LinearFit

from .cost_tables import MODEL, WORK, costs, part, plan


def test_the_search_finds_the_known_best_plan() -> None:
    # collectives so dear that the one layout without any (four pipeline stages) must win,
    # with its most micro-batches (the bubble shrinks) on a schedule with the least bubble
    c = costs(comm_s=100.0)
    result = search(c, WORK, world=4, memory_bytes=GIB, base=ParallelConfig())
    best = result.best
    assert (best.plan.dims.pp, best.plan.dims.dp, best.plan.dims.tp) == (4, 1, 1), best.plan.describe()
    assert best.plan.config.split_points == ("layers.1", "layers.2", "layers.3")
    assert best.prediction.step_s == min(r.prediction.step_s for r in result.fits)
    # 1F1B with 8 micro-batches of 8 tokens, 0.25 s forward, 0.5 s backward per stage: (8 + 3) x 0.75 s
    one_f_one_b = [r for r in result.fits if r.plan.config.schedule == "1F1B" and r.plan.dims.pp == 4]
    # (plus the step's two scalar all-reduces over the world, which every plan pays)
    assert min(r.prediction.step_s for r in one_f_one_b) == pytest.approx(11 * 0.75 + 2 * 100)
    assert best.prediction.step_s <= 11 * 0.75 + 2 * 100
    assert result.rejected, "the searched space holds schedules that cannot run (e.g. 1F1B with 1 micro-batch)"
    assert not [r for r in result.fits if r.plan.dims.dp == 1 and r.plan.config.data_parallel == "fsdp"]
    assert result.rejected[FSDP_ALONE] > 0 and any(r.plan.config.data_parallel == "fsdp" for r in result.fits)
    # a budget only recomputation meets: stage-aware, the first stages of 1F1B (more micro-batches
    # in flight there) recompute first
    heavy = costs(comm_s=100.0, saved=200.0, groups=(2,))  # activations outweigh a block's input
    no_recompute = simulate(heavy, WORK, plan(2, "1F1B", 8, ("layers.2",)))
    budget = (no_recompute.peak_bytes[0] + no_recompute.peak_bytes[1]) / 2
    staged = search(heavy, WORK, 2, budget, ParallelConfig(), Space(schedules=("1F1B",)))
    chosen = [r for r in staged.fits if r.plan.dims.pp == 2 and r.plan.config.microbatches == 8]
    assert chosen and chosen[0].plan.config.recompute == (0,), [r.plan.describe() for r in chosen]
    # a budget under every plan's peak: refused, naming the smallest plan and what it needs
    smallest = min(r.prediction.max_peak_bytes for r in result.fits)
    tight = search(c, WORK, world=4, memory_bytes=smallest / 2, base=ParallelConfig())
    with pytest.raises(ConfigError, match=rf"needs {smallest / GIB:.3f} GiB per rank; raise --memory"):
        _ = tight.best


def test_the_search_shards_the_tables_where_their_reduction_costs_more_than_their_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # all-reduces priced by the byte (0.1 ms), every all-to-all 10 ms; the token and position
    # tables 1,152 parameters. Sharded over dp4 they leave the reduction (4,608 bytes: 0.4608 s)
    # and exchange counts, ids and rows forward and rows backward, per table (8 x 10 ms)
    c = costs(comm_s=0.01)
    tables = (MODEL.vocab_size + MODEL.seq_len) * MODEL.d_model
    c.parts["embed"] = dataclasses.replace(c.parts["embed"], params=tables)
    c.comm.update({f"all_reduce/g{g}": LinearFit(0.0, 1e-4, 0.0, ()) for g in (2, 4)})
    result = search(c, WORK, world=4, memory_bytes=GIB, base=ParallelConfig(), space=Space(schedules=("1F1B",)))
    dp4 = {
        r.plan.config.embedding: r
        for r in result.fits
        if r.plan.dims.dp == 4 and r.plan.config.data_parallel == "sparta" and r.plan.config.microbatches == 1
    }
    assert dp4["sparse"].prediction.step_s - dp4["dense"].prediction.step_s == pytest.approx(-tables * 4e-4 + 8 * 0.01)
    assert result.fits.index(dp4["sparse"]) < result.fits.index(dp4["dense"])
    assert result.rejected[SPARSE_ALONE] > 0  # pp4 dp1: nothing to shard
    assert not [r for r in result.fits if r.plan.dims.dp == 1 and r.plan.config.embedding == "sparse"]
    # the plan file carries the choice into `sparta train`
    path, run = tmp_path / "plan.toml", tmp_path / "run.toml"
    write_plan(path, dp4["sparse"], WORK, 4, c)
    run.write_text(
        "[model]\nvocab_size = 64\nseq_len = 8\nd_model = 16\nn_layers = 4\nn_heads = 4\nd_ff = 32\n"
        "[train]\nglobal_batch = 8\n[data]\nsource = 'random'\n"
    )
    assert load_config(run, plan_overrides(path, WORK)).parallel.embedding == "sparse"
    with pytest.raises(ConfigError, match=r"Space.embeddings=\('rows',\): choose from"):
        Space(embeddings=("rows",))
    # and `sparta plan` names its own flag
    costs_path = tmp_path / "costs.json"
    c.save(costs_path)
    cli = ["plan", "--config", str(run), "--costs", str(costs_path), "--world", "4", "--memory", "1", "--any-hardware"]
    assert sparta_main([*cli, "--embeddings", "dense,rows"]) == 2
    assert "sparta plan: --embeddings dense,rows: choose from dense, sparse" in capsys.readouterr().err
    assert sparta_main([*cli, "--embeddings", "sparse", "--top", "1"]) == 0
    best, summary = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "sparse-embedding" in best["plan"] and summary["rejected"][SPARSE_ALONE] > 0
    # a CUDA run planned on a machine without one: --any-hardware plans it, no fingerprint asked
    gpu_run = tmp_path / "gpu.toml"
    gpu_run.write_text(run.read_text().replace("[train]\n", "[train]\ndevice = 'cuda'\n"))
    gpu_cli = ["plan", "--config", str(gpu_run), "--costs", str(costs_path), "--world", "4", "--memory", "1"]
    assert sparta_main([*gpu_cli, "--any-hardware", "--top", "1"]) == 0
    capsys.readouterr()
    assert sparta_main(gpu_cli) == 2  # measured on "test" hardware: refused here, and on a GPU
    if not torch.cuda.is_available():
        assert "train.device is 'cuda' but this machine has no GPU" in capsys.readouterr().err


def test_bad_input_is_refused_by_name(tmp_path: Path) -> None:
    c = costs()
    other = Workload(dataclasses.replace(MODEL, d_model=32), None, 8)
    with pytest.raises(ConfigError, match=r"measured for another model \(\{'d_model': \(16, 32\)\}"):
        search(c, other, 4, GIB, ParallelConfig())
    with pytest.raises(ConfigError, match=r"lack groups of \[8\] ranks.*launch of 8 ranks"):
        search(c, WORK, 8, GIB, ParallelConfig())
    no_p2p = dataclasses.replace(c, comm={k: f for k, f in c.comm.items() if not k.startswith("p2p")})
    with pytest.raises(ConfigError, match=r"no point-to-point fits, which the pipeline layouts of 4 ranks use"):
        search(no_p2p, WORK, 4, GIB, ParallelConfig())
    with pytest.raises(ConfigError, match=r"other hardware \(\{'device': \('test', 'H100'\)\}"):
        c.check(MODEL, None, {"device": "H100", "device_type": "cpu", "torch": "x"})
    # a world no layout divides the batch over: every layout refused, with the reason
    odd = costs(groups=(5,))  # 5 ranks: 5 stages > 4 layers, tp5 splits no head, dp5 no batch of 8
    with pytest.raises(ConfigError, match=r"no plan of this model runs on these ranks \(1 x global_batch=8 does not"):
        _ = search(odd, WORK, 5, GIB, ParallelConfig()).best
    with pytest.raises(ConfigError, match="not a costs file written by sparta plan"):
        ModelCosts.load(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match=r"split_points=\('layers.9',\) do not cut 4 layers into 2"):
        simulate(c, WORK, plan(2, "1F1B", 2, ("layers.9",)))


def test_the_search_chooses_recomputation_itself_and_only_expert_splits_the_trainer_takes() -> None:
    """A run file's own recompute list is no plan's (it named stages of its own layout); and
    tp goes only where the trainer can split the experts' hidden units (rows of 16 bytes)."""
    moe = MoESpec(num_experts=4, top_k=2)
    result = search(costs(moe=moe), Workload(MODEL, moe, 8), 4, GIB, ParallelConfig(moe=moe, recompute=(0,)))
    assert result.fits and not [r for r in result.fits if r.plan.config.recompute]
    plain = search(costs(moe=moe), Workload(MODEL, moe, 8), 4, GIB, ParallelConfig(moe=moe, tensor_parallel=False))
    assert plain.fits and {r.plan.dims.tp for r in plain.fits} == {1}  # no tp plan: nothing would split
    odd = dataclasses.replace(MODEL, d_ff=8)  # tp2: 4 units, rows of 16 bytes; tp4: 2 units, 8 bytes
    tps = {d.tp for d in layouts(4, Workload(odd, moe, 8))}
    assert tps == {1, 2}, tps
    assert {d.tp for d in layouts(4, Workload(odd, dataclasses.replace(moe, expert_tp=False), 8))} == {1, 2, 4}


def test_plans_the_trainer_will_not_recompute_stay_over_budget_not_rejected() -> None:
    """Over budget, a plan is tried with recomputation; where the trainer refuses that (the
    sigmoid router moves its bias in the forward), the plan is kept as it is, over budget."""
    counts = {}
    for router in ("topk", "sigmoid"):
        moe = MoESpec(num_experts=4, top_k=2, router=router)
        result = search(costs(moe=moe), Workload(MODEL, moe, 8), 4, 1.0, ParallelConfig(moe=moe))
        assert not result.fits
        counts[router] = (len(result.over_budget), sum(result.rejected.values()))
        recomputing = [r for r in result.over_budget if r.plan.config.recompute]
        assert bool(recomputing) == (router == "topk"), router
    assert counts["sigmoid"] == counts["topk"], counts


def test_a_plan_file_round_trips_into_the_run_config(tmp_path: Path) -> None:
    moe = MoESpec(num_experts=4, top_k=2)
    c = costs(moe=moe)
    work = Workload(MODEL, moe, 8)
    result = search(c, work, 4, GIB, ParallelConfig(moe=moe))
    path = tmp_path / "plan.toml"
    write_plan(path, result.best, work, 4, c)
    run = tmp_path / "run.toml"
    run.write_text(
        "[model]\nvocab_size = 300\nseq_len = 8\nd_model = 16\nn_layers = 4\nn_heads = 4\nd_ff = 32\n"
        "[parallel.moe]\nnum_experts = 4\ntop_k = 2\n[train]\nglobal_batch = 8\n[data]\nsource = 'random'\n"
    )
    with pytest.raises(ConfigError, match=r"made for another model: \{'vocab_size': \(64, 300\)\}"):
        plan_overrides(path, Workload(dataclasses.replace(MODEL, vocab_size=300), moe, 8))
    run.write_text(run.read_text().replace("vocab_size = 300", "vocab_size = 64"))
    config = load_config(run, plan_overrides(path, work))
    assert config.dims == result.best.plan.dims
    assert config.parallel.schedule == result.best.plan.config.schedule
    assert config.parallel.split_points == result.best.plan.config.split_points
    (tmp_path / "junk.toml").write_text("[parallel]\npp = 2\n")
    with pytest.raises(ConfigError, match="not a plan file written by `sparta plan`"):
        plan_overrides(tmp_path / "junk.toml", work)


def test_published_figures_give_costs_by_link_and_a_narrower_space() -> None:
    from sparta.planner import Hardware, analytic_costs, model_flops_per_step

    hw = Hardware("toy", peak_flops=1e12, gemm_efficiency=0.5, memory_bytes=2**30, memory_bw=1e11,
                  intra_bw=1e10, inter_bw=1e9, devices_per_node=4, latency_s=1e-5)  # fmt: skip
    c = analytic_costs(hw, MODEL, None, world=8)
    # a block's MLP: 4 d d_ff FLOPs per token at half of 1 TFLOP/s; backward twice that
    assert c.parts["mlp"].fwd(100) == pytest.approx(100 * 4 * 16 * 32 / 0.5e12)
    assert c.parts["mlp"].bwd(100) == pytest.approx(2 * c.parts["mlp"].fwd(100))
    # a ring all-reduce of 1 MB: over NVLink inside a node of 4, over the network when the
    # group's 2 ranks lie 4 apart (a dp group behind tp4)
    assert c.collective("all_reduce", 2, 1e6) == pytest.approx(1e-5 + 1e6 / 1e10)
    assert c.collective("all_reduce", 2, 1e6, stride=4) == pytest.approx(1e-5 + 1e6 / 1e9)
    assert c.collective("p2p", 2, 1e6, stride=4) == pytest.approx(1e6 / 1e9)
    # a pipeline hop across nodes: each GPU's own NIC carries its pair at full rate (measured
    # links are one a node, shared by its ranks' sends, and scaled so)
    assert c.hop(1e6, 3, 4, 1) == pytest.approx(1e6 / 1e9)
    assert dataclasses.replace(c, link_per_rank=False).hop(1e6, 3, 4, 1) == pytest.approx(1e6 / 4 / 1e9)
    # what a block keeps for backward: no s x s attention scores (the trainer's attention is
    # SDPA), and the MLP's rows by its own width: 6.5d + heads and 2d + 2 d_ff elements
    assert c.parts["attention"].saved_bytes_per_token == (13 * 16 / 2 + 4) * hw.element_bytes
    assert c.parts["mlp"].saved_bytes_per_token == (2 * 16 + 2 * 32) * hw.element_bytes
    assert model_flops_per_step(MODEL, None, 8) == 3 * 8 * 8 * (
        4 * (8 * 16**2 + 4 * 8 * 16 + 4 * 16 * 32) + 2 * 16 * 64
    )
    narrow = search(c, WORK, 8, 2**30, ParallelConfig(), Space(schedules=("GPipe",), max_microbatches=2, max_tp=2))
    assert narrow.fits and all(r.plan.dims.tp <= 2 and r.plan.config.microbatches <= 2 for r in narrow.fits)
    assert {r.plan.config.schedule for r in narrow.fits} == {"GPipe", "1F1B"}  # 1F1B: one stage, pp1
    with pytest.raises(ConfigError, match=r"Space.schedules: \['Nope'\] unknown"):
        Space(schedules=("Nope",))


def test_measured_group_shapes_are_those_a_layout_can_form() -> None:
    from sparta.planner.measure import group_shapes, strided_groups

    # 8 ranks: dp groups behind tp2 and tp4, pipeline hops 2 and 4 ranks apart, all measured
    assert group_shapes(8, (2, 4, 8)) == [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1)]
    assert strided_groups(8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert strided_groups(8, 4, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert strided_groups(8, 2, 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for g, s in group_shapes(12, (2, 3, 4, 6, 12)):
        assert sorted(r for group in strided_groups(12, g, s) for r in group) == list(range(12)), (g, s)
    with pytest.raises(ConfigError, match=r"group sizes \[3\] do not divide the launch's 8 ranks"):
        group_shapes(8, (2, 3))


def test_experts_are_timed_split_only_where_the_trainer_can_split_them() -> None:
    """measure_costs times moe/tp{t} and moe/ep{e}tp{t} only where tp cuts d_ff into the
    16-byte rows sparta.moe.experts.check_ff_split demands (else the measure would raise)."""
    from sparta.planner.measure import _ep_tp_pairs
    from sparta.planner.parts import experts_split

    moe = MoESpec(num_experts=4, top_k=2)
    aligned = dataclasses.replace(MODEL, d_ff=32)  # 16 or 8 float32 units: 64- or 32-byte rows
    assert experts_split(aligned, 2) and experts_split(aligned, 4)
    assert _ep_tp_pairs(8, (2, 4, 8), aligned, moe) == [(2, 2), (2, 4), (4, 2)]
    odd = dataclasses.replace(MODEL, d_ff=36)  # 18 units over 2: 72-byte rows
    assert not experts_split(odd, 2) and _ep_tp_pairs(8, (2, 4, 8), odd, moe) == []
    assert _ep_tp_pairs(8, (2, 4, 8), aligned, dataclasses.replace(moe, expert_tp=False)) == []


def test_head_stages_take_a_pth_of_the_head_each_and_the_search_weighs_them(tmp_path: Path) -> None:
    # a head dearer than all four layers together: F 4 s, B 8 s per 16 tokens (layers 2 s, 4 s)
    c = costs()
    c.parts["head"] = part(4.0, 8.0, saved=4.0, params=64_000)
    vocab = Plan(
        ParallelDims(pp=2),
        ParallelConfig(schedule="Interleaved1F1B", microbatches=2, stages_per_rank=2, split_points=("layers.2",),
                       vocab_stages=True),
    )  # fmt: skip
    assert stage_layers(vocab, MODEL.n_layers) == [[0, 1], [2, 3], [], []]
    assert "vocab-stages" in vocab.describe()
    # one rank: the head stage runs after the layers' stage, so the step is the sum, as one stage's
    one = Plan(ParallelDims(), dataclasses.replace(vocab.config, split_points=(), microbatches=4))
    assert simulate(c, WORK, one).step_s == pytest.approx(simulate(c, WORK, plan(1, "1F1B", 4, ())).step_s)
    # two ranks: each holds half the head's rows (params and AdamW state), not the last one all of it
    naive = Plan(
        vocab.dims,
        dataclasses.replace(vocab.config, vocab_stages=False, split_points=("layers.1", "layers.2", "layers.3")),
    )
    got, base = simulate(c, WORK, vocab), simulate(c, WORK, naive)
    assert got.step_s < base.step_s, (got, base)
    spread = max(got.peak_bytes.values()) - min(got.peak_bytes.values())
    assert spread < max(base.peak_bytes.values()) - min(base.peak_bytes.values())
    # under tp the stages' rows split over it too (as the tp head's do): a quarter of the head each
    split = simulate(c, WORK, Plan(ParallelDims(pp=2, tp=2), vocab.config)).peak_bytes
    whole_config = dataclasses.replace(vocab.config, vocab_parallel_head=False)
    whole = simulate(c, WORK, Plan(ParallelDims(pp=2, tp=2), whole_config)).peak_bytes
    # (and half the saved activations: 4 bytes a token)
    assert all(whole[r] - split[r] == pytest.approx(64_000 / 4 * 16, rel=1e-3) for r in (0, 1)), (whole, split)
    # the search tries them beside the naive split, and ranks them first among the pipelines
    # when the head dominates (dp2 wins outright here: these costs have no collectives)
    result = search(c, WORK, 2, GIB, ParallelConfig(), Space(schedules=("Interleaved1F1B",), strategies=("sparta",)))
    pipelines = [r for r in result.fits if r.plan.dims.pp == 2]
    described = [r.plan.describe() for r in pipelines]
    assert any("vocab-stages" in d for d in described) and any("vocab-stages" not in d for d in described)
    assert any("v3 sparta embedding-stages vocab-stages" in d for d in described), described
    assert pipelines[0].plan.config.vocab_stages, described
    narrow = Space(schedules=("Interleaved1F1B",), strategies=("sparta",), vocab_stages=False)
    assert not any("stages" in r.plan.describe() for r in search(c, WORK, 2, GIB, ParallelConfig(), narrow).fits)
    # the token embedding's stages too, at the front: a table of 64,000 parameters split over pp
    # (a vocabulary of 4,000 rows, no position table)
    c.parts["embed"] = part(0.0, 0.0, saved=0.0, params=64_000)
    wide = Workload(dataclasses.replace(MODEL, vocab_size=4_000), None, WORK.global_batch)
    both = Plan(vocab.dims, dataclasses.replace(vocab.config, stages_per_rank=3, embedding_stages=True))
    assert stage_layers(both, MODEL.n_layers) == [[], [], [0, 1], [2, 3], [], []]
    assert "embedding-stages vocab-stages" in both.describe()
    peaks, head_only = simulate(c, wide, both).peak_bytes, simulate(c, wide, vocab).peak_bytes
    # the whole table on rank 0 (16 bytes a parameter with AdamW) against half of it on each
    assert max(head_only.values()) - min(head_only.values()) > 64_000 * 16 * 0.99
    assert max(peaks.values()) - min(peaks.values()) < 64_000 * 16 * 0.01
    # its plan file carries the choice; a file from before vocab_stages still reads
    path = tmp_path / "plan.toml"
    write_plan(path, pipelines[0], WORK, 2, c)
    assert "parallel.vocab_stages=true" in plan_overrides(path, WORK)
    path.write_text("\n".join(line for line in path.read_text().splitlines() if "vocab_stages" not in line))
    assert not any("vocab_stages" in o for o in plan_overrides(path, WORK))
