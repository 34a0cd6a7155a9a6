"""`sparta train`'s run files (sparta.parallel.config) in one process: the demo's file loads,
TOML and YAML agree, `--set` overrides are validated like the file, and every bad input
raises ConfigError naming the field and the fix before anything starts. Also the pure pieces
of the loop: the learning-rate schedule, the batches of a step and the MFU's parameter count."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from sparta.cli import main
from sparta.errors import ConfigError
from sparta.parallel import Decoder, DecoderConfig, MoESpec, ParallelConfig, ParallelDims
from sparta.parallel.config import CheckpointConfig, DataConfig, OutputConfig, RunConfig, TrainConfig
from sparta.parallel.config_file import from_dict, load_config, parse_value
from sparta.parallel.data import TokenBatches, random_tokens
from sparta.parallel.decoder import Block
from sparta.parallel.train import active_parameters, learning_rate

DEMO = Path(__file__).resolve().parents[2] / "examples" / "moe_gpt.toml"


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def demo_with(*overrides: str) -> RunConfig:
    return load_config(DEMO, overrides)


def test_the_demo_file_is_pp_dp_tp_with_experts() -> None:
    run = load_config(DEMO)
    assert run.dims == ParallelDims(pp=2, dp=2, tp=2, ep=2)
    assert isinstance(run.model, DecoderConfig) and isinstance(run.parallel, ParallelConfig)
    assert run.parallel.moe == MoESpec(num_experts=8, top_k=2, router="topk", pipeline_degree="auto")
    assert run.parallel.split_points == ("layers.2",)  # a TOML list becomes the field's tuple
    assert run.data.source == "stdlib" and run.output.peak_tflops == pytest.approx(0.166)
    run.check(8)
    # the tree it writes reads back to the same run
    assert from_dict(run.to_dict()) == run


def test_toml_and_yaml_give_the_same_run(tmp_path: Path) -> None:
    toml = write(tmp_path, '[model]\nd_model = 32\nn_heads = 2\n[parallel]\ndp = 2\nschedule = "GPipe"\n'
                 "[parallel.moe]\nnum_experts = 4\n[train]\nlr = 1e-3\n")  # fmt: skip
    yaml = write(
        tmp_path,
        "model: {d_model: 32, n_heads: 2}\nparallel: {dp: 2, schedule: GPipe, moe: {num_experts: 4}}\n"
        "train: {lr: 0.001}\n",
        "run.yaml",
    )
    a, b = load_config(toml), load_config(yaml)
    assert a == b
    assert a.model.d_model == 32 and a.dims.dp == 2 and a.parallel.moe.num_experts == 4 and a.train.lr == 1e-3
    assert load_config(write(tmp_path, "", "empty.yml")) == RunConfig()  # an empty file: the defaults


def test_yaml_without_pyyaml_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "train: {steps: 3}\n", "run.yaml")
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml now raises ImportError
    with pytest.raises(ConfigError, match=r"PyYAML \(pip install pyyaml\).*TOML"):
        load_config(path)


def test_overrides_are_parsed_and_applied() -> None:
    run = demo_with(
        "train.steps=7", "train.lr=1e-4", "parallel.schedule=GPipe", "parallel.moe.top_k=1",
        "parallel.split_points=['layers.1']", "checkpoint.dir=/tmp/run 1", "output.trace=\"t.json\"",
    )  # fmt: skip
    assert run.train.steps == 7 and run.train.lr == 1e-4
    assert run.parallel.schedule == "GPipe" and run.parallel.moe.top_k == 1  # bare strings stay strings
    assert run.parallel.split_points == ("layers.1",)
    assert run.checkpoint.dir == "/tmp/run 1" and run.output.trace == "t.json"
    assert parse_value("3") == 3 and parse_value("true") is True and parse_value("1F1B") == "1F1B"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        # an unknown field names itself and lists the known ones, in every section
        (["model.width=3"], r"unknown field model\.width: the known fields of \[model\] are vocab_size, seq_len, "
         r"d_model, n_layers, n_heads, d_ff"),
        (["parallel.degree=3"], r"unknown field parallel\.degree: .*\[parallel\] are pp, dp, tp, ep, schedule, "
         r"microbatches"),
        (["parallel.moe.experts=4"], r"unknown field parallel\.moe\.experts: .*num_experts, top_k"),
        (["train.epochs=3"], r"unknown field train\.epochs: .*steps, global_batch, lr"),
        (["optim.lr=3"], r"unknown section \[optim\]: the known sections are model, parallel, train"),
        # types
        (["model.d_model=big"], r"model\.d_model='big' must be an integer"),
        (["train.steps=true"], r"train\.steps=True must be an integer"),
        (["train.lr=fast"], r"train\.lr='fast' must be a number"),
        (["parallel.split_points=layers.2"], r"parallel\.split_points='layers\.2' must be a list"),
        # values, checked by the leaves (the core's own messages)
        (["parallel.ep=3"], r"ep=3 must divide dp=2"),
        (["parallel.moe.top_k=9"], r"top_k=9 exceeds num_experts=8"),
        (["parallel.moe.pipeline_degree=fast"], r"pipeline_degree='fast': the one word it takes is 'auto'"),
        (["parallel.moe.pipeline_degree=0"], r"MoESpec\.pipeline_degree: .*use an int >= 1"),
        (["parallel.moe.pipeline_degree=auto", "parallel.moe.router=soft"], r"router='soft' has none"),
        (["parallel.moe.pipeline_degree=auto", "parallel.ep=1"], r"'auto' tunes the experts' row exchange, but ep=1"),
        (["parallel.moe.overlap=0"], r"MoESpec\.overlap=0 must be a positive integer"),
        (["parallel.moe.overlap=2"], r"overlap=2 with pipeline_degree='auto', which tunes the blocks' micro-batches"),
        (["parallel.moe.pipeline_degree=1", "parallel.moe.overlap=2"], r"overlap=2: tp=2 splits the experts' hidden "
         r"units \(expert_tp\)"),
        (["parallel.moe.pipeline_degree=1", "parallel.moe.overlap=2", "parallel.ep=1"], r"overlap=2: ep=1 keeps every "
         r"expert on its rank"),
        (["parallel.moe.pipeline_degree=1", "parallel.moe.overlap=2", "parallel.moe.capacity_factor=1.25"],
         r"overlap=2 runs each block through micro-batches, which route as the whole batch only for dropless token "
         r"choice \(router 'topk', capacity_factor 1\.25\)"),
        (["parallel.moe.dedup=yes"], r"parallel\.moe\.dedup='yes' must be true or false"),
        (["parallel.moe.dedup=true"], r"dedup=True with pipeline_degree='auto', which tunes the blocks' micro-batches "
         r"and deduplication itself"),
        (["parallel.moe.pipeline_degree=1", "parallel.moe.dedup=true", "parallel.tp=1", "parallel.schedule=GPipe",
          "parallel.recompute=[0]"], r"dedup=True: recompute=\[0\] would run the micro-batches' exchanges again"),
        (["parallel.find_unused_parameters=true"], r"find_unused_parameters=True is torch DDP's flag; "
         r"data_parallel='sparta' counts"),
        (["model.n_heads=3"], r"d_model=64 must be divisible by n_heads=3"),
        (["parallel.schedule=Zigzag"], r"schedule='Zigzag' is unknown"),
        (["parallel.moe.num_experts=3", "parallel.moe.top_k=1"], r"num_experts=3 does not divide over ep=2"),
        (["train.steps=0"], r"train\.steps=0 must be an integer >= 1"),
        (["train.lr=-1e-3"], r"train\.lr=-0\.001 must be a finite number > 0"),
        (["train.min_lr_ratio=2"], r"min_lr_ratio=2\.0 must be .* <= 1"),
        (["train.device=tpu"], r"train\.device='tpu' is unknown: choose one of cpu, cuda"),
        (["data.source=web"], r"data\.source='web' is unknown: choose one of stdlib, random"),
        (["checkpoint.keep=0"], r"checkpoint\.keep=0 must be an integer >= 1"),
        (["output.peak_tflops=0"], r"output\.peak_tflops=0\.0 must be a finite number > 0"),
        # across sections
        (["train.global_batch=6"], r"global_batch=6 must be divisible by parallel\.dp x parallel\.microbatches = "
         r"2 x 2 = 4"),
        (["parallel.microbatches=1"], r"microbatches \(1\) must be greater than or equal to the number of stages"),
        (["parallel.schedule=Interleaved1F1B", "parallel.stages_per_rank=2", "parallel.microbatches=1",
          "parallel.split_points=['layers.1', 'layers.2', 'layers.3']", "train.global_batch=2"],
         r"needs at least as many micro-batches as pipeline ranks: microbatches=1 < pp=2"),
        (["parallel.lengths=[0, 64]"], r"lengths=\[0, 64\]: every length must be a positive integer"),
        (["parallel.lengths=[64, 64]"], r"lengths=\[64, 64\] names a length twice"),
        (["parallel.lengths=[32, 64]", "parallel.seq_len=64"], r"seq_len=64 and lengths=\[32, 64\] both set"),
        (["parallel.schedule=ZBVZeroBubble"], r"two stages on each rank \(a V\): pass stages_per_rank=2"),
        (["parallel.split_points=['layers.9']"], r"split_points \['layers\.9'\] name no layer; the layers are "
         r"layers\.0, layers\.1"),
        (["model.n_layers=1", "parallel.split_points=[]"], r"2 pipeline stages .* but the model has 1 layers"),
        (["parallel.ep=1", "parallel.moe.pipeline_degree=1", "model.vocab_size=200"], r"vocab_size=200 must exceed the "
         r"256 byte tokens"),
        (["output.trace=t.json", "output.trace_start=500"], r"output\.trace_start=500 is after the last step"),
        # the override itself
        (["train.steps"], r"--set 'train\.steps' must read section\.field=value"),
        (["steps=3"], r"must read section\.field=value"),
    ],
)  # fmt: skip
def test_every_bad_input_names_the_field_and_the_fix(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        demo_with(*overrides)


def test_degrees_against_the_world_size() -> None:
    run = load_config(DEMO)
    with pytest.raises(ConfigError, match=r"multiply to 8 ranks but 4 were launched: launch 8 ranks"):
        run.check(4)
    demo_with("parallel.pp=1", "parallel.split_points=[]").check(4)


def test_each_dimensions_groups_partition_the_world_along_its_coordinate() -> None:
    """`build_layout`'s mesh is made from these groups over `arange(world).reshape(pp, dp,
    tp)`, and `DeviceMesh.from_group` checks neither against the other."""
    dims = ParallelDims(pp=2, dp=4, tp=2, ep=2)
    mesh = torch.arange(dims.world_size).reshape(dims.pp, dims.dp, dims.tp)
    for axis, groups in enumerate((dims.pp_groups(), dims.dp_groups(), dims.tp_groups())):
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))
        assert sorted(groups) == sorted(mesh.movedim(axis, -1).reshape(-1, mesh.shape[axis]).tolist())
        for group in groups:  # a rank's place in its group is its coordinate along the axis
            assert [dims.coordinates(r)[axis] for r in group] == list(range(len(group)))
            assert len({tuple(c for i, c in enumerate(dims.coordinates(r)) if i != axis) for r in group}) == 1
    assert [dims.rank_of(*dims.coordinates(r)) for r in range(dims.world_size)] == list(range(dims.world_size))


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match=r"must end in \.toml, \.yaml or \.yml"):
        load_config(write(tmp_path, "{}", "run.json"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[model\nd_model = 3"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "model: [1, 2", "bad.yaml"))
    with pytest.raises(ConfigError, match=r"\[model\] must be a table"):
        load_config(write(tmp_path, "model = 3"))
    with pytest.raises(ConfigError, match="must hold tables"):
        load_config(write(tmp_path, "- 1\n- 2\n", "list.yaml"))


def test_the_leaves_validate_when_built_directly() -> None:
    with pytest.raises(ConfigError, match=r"train\.global_batch=0"):
        TrainConfig(global_batch=0)
    with pytest.raises(ConfigError, match=r"data\.corpus_mb=0"):
        DataConfig(corpus_mb=0)
    with pytest.raises(ConfigError, match=r"checkpoint\.dir=''"):
        CheckpointConfig(dir="")
    with pytest.raises(ConfigError, match=r"output\.trace_steps=0"):
        OutputConfig(trace_steps=0)
    with pytest.raises(ConfigError, match="global_batch=3 must be divisible"):
        RunConfig(dims=ParallelDims(dp=2), train=TrainConfig(global_batch=3))


def test_sparta_train_refuses_a_bad_file_before_starting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No launcher: a world of one. The error is printed and the exit code is 2, before any
    engine starts (so every rank of a launch fails alike instead of hanging)."""
    bad = write(tmp_path, "[train]\nsteps = 3\nbatch = 4\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "unknown field train.batch: the known fields of [train] are steps, global_batch" in capsys.readouterr().err
    assert main(["train", "--config", str(DEMO), "--set", "train.lr=fast"]) == 2
    assert "train.lr='fast' must be a number" in capsys.readouterr().err
    # a good file, on the wrong number of ranks: the launch is checked before the engine starts
    assert main(["train", "--config", str(DEMO), "--set", "train.steps=1"]) == 2
    assert "multiply to 8 ranks but 1 were launched" in capsys.readouterr().err


def test_learning_rate_warms_up_then_decays_to_the_floor() -> None:
    run = dataclasses.replace(RunConfig(), train=TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1))
    rates = [learning_rate(run, s) for s in range(100)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:], strict=False))
    assert rates[-1] == pytest.approx(1e-4)
    no_warmup = dataclasses.replace(run, train=TrainConfig(steps=100, lr=1e-3, warmup_steps=0))
    assert learning_rate(no_warmup, 0) == pytest.approx(1e-3)


def test_a_steps_batch_is_the_same_global_batch_under_any_dp() -> None:
    batches = TokenBatches(random_tokens(20_000, 300, seed=1), seq_len=16, seed=3)
    whole_ids, whole_targets = batches.train_batch(step=5, global_batch=8, dp_rank=0, dp=1)
    assert whole_ids.shape == (8, 16) and whole_ids.dtype == torch.int64
    assert torch.equal(whole_ids[:, 1:], whole_targets[:, :-1])  # targets are the inputs shifted by one
    for dp in (2, 4):
        parts = [batches.train_batch(5, 8, r, dp) for r in range(dp)]
        assert torch.equal(torch.cat([p[0] for p in parts]), whole_ids)
        assert torch.equal(torch.cat([p[1] for p in parts]), whole_targets)
    assert not torch.equal(batches.train_batch(6, 8, 0, 1)[0], whole_ids)  # another step, other windows
    val = [batches.val_batch(i, 2, 8, 0, 1)[0] for i in range(2)]
    assert not torch.equal(val[0], val[1])
    assert torch.equal(torch.cat([batches.val_batch(1, 2, 8, r, 2)[0] for r in range(2)]), val[1])
    with pytest.raises(ConfigError, match="fewer than model.seq_len"):
        TokenBatches(random_tokens(150, 300, seed=1), seq_len=16, seed=0)  # 15 validate
    exact = TokenBatches(random_tokens(1000, 300, seed=1), seq_len=99, seed=0)  # 100 validate: one window
    ids, targets = exact.val_batch(0, 1, 2, 0, 1)
    assert torch.equal(ids[0], exact.val[:-1]) and torch.equal(targets[1], exact.val[1:])


def test_active_parameters_count_the_dense_decoder_without_embeddings() -> None:
    cfg = DecoderConfig(vocab_size=300, seq_len=16, d_model=32, n_layers=3, n_heads=4, d_ff=48)
    model = Decoder(cfg)
    embeddings = sum(p.numel() for m in (model.tok_emb, model.pos_emb) for p in m.parameters())
    assert active_parameters(cfg, ParallelConfig()) == sum(p.numel() for p in model.parameters()) - embeddings
    moe = ParallelConfig(moe=MoESpec(num_experts=4, top_k=2))
    mlp = sum(p.numel() for p in model.layers["0"].mlp.parameters())
    extra = cfg.n_layers * (mlp + cfg.d_model * 4)  # a second expert's MLP and the router, per layer
    assert active_parameters(cfg, moe) == active_parameters(cfg, ParallelConfig()) + extra
    # every second layer an MoE one: layers 0 and 2 of 3
    alternate = ParallelConfig(moe=MoESpec(num_experts=4, top_k=2, every=2))
    assert active_parameters(cfg, alternate) == active_parameters(cfg, ParallelConfig()) + extra * 2 // 3


def test_auto_degrees_read_from_a_file() -> None:
    """pipeline_degree = "auto" (the co-scheduler tuned on the first step, auto_schedule.py),
    as the demo asks it on pp2 x dp2 x tp2 x ep2 with the experts split over tp; a degree
    given instead reads as one."""
    run = load_config(DEMO)
    assert run.parallel.moe is not None and run.parallel.moe.auto and run.parallel.moe.pipeline_degree == "auto"
    run.parallel.check(run.dims)
    fixed = demo_with("parallel.moe.pipeline_degree=[4, 2]").parallel.moe
    assert fixed is not None and not fixed.auto and fixed.pipeline_degree == (4, 2)
    assert not MoESpec(pipeline_degree=(2, 4)).auto and MoESpec(pipeline_degree=[2, 4]).pipeline_degree == (2, 4)


def test_block_overlap_is_refused_where_its_micro_batches_would_not_run_as_the_batch() -> None:
    """MoESpec.overlap cuts each Block's batch into micro-batches: refused (naming the fix)
    under a zero-bubble schedule and under recomputation, and by a Block whose MLP is not an
    expert-parallel MoE layer."""
    spec = MoESpec(num_experts=4, overlap=2)
    dims = ParallelDims(pp=2, dp=2, ep=2)
    ParallelConfig(moe=spec, microbatches=2).check(dims)
    zero_bubble = ParallelConfig(moe=spec, schedule="ZBVZeroBubble", stages_per_rank=2, microbatches=2)
    with pytest.raises(ConfigError, match=r"overlap=2: schedule 'ZBVZeroBubble' splits each backward.*leave it off"):
        zero_bubble.check(dims)
    with pytest.raises(ConfigError, match=r"overlap=2: recompute=\[0\] would run the micro-batches' exchanges again"):
        ParallelConfig(moe=spec, microbatches=2, recompute=(0,)).check(dims)
    block = Block(DecoderConfig())
    with pytest.raises(ConfigError, match=r"set_overlap\(2\): cannot overlap micro-batches: its MLP is not an MoE"):
        block.set_overlap(2)
    with pytest.raises(ConfigError, match=r"set_overlap\(0\): give an int >= 1"):
        block.set_overlap(0)
    block.set_overlap(1)
