"""benchmarks/trainer.py runs end to end on its smallest case: the tiny dense Llama on one
rank, plain eager against Sparta's trainer, with the memory launches, and torchtitan either
timed (where torchtitan 0.3.0 is installed) or reported as skipped with the reason, never
dropped. Timings are the benchmark's to report; this checks the records and the oracle:
Sparta's first-step loss equals plain eager's within 1e-5."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from launch import run_killing_on_timeout

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "trainer.py"
TIMING_FIELDS = (
    "model",
    "layout",
    "candidate",
    "ranks",
    "median_s",
    "min_s",
    "max_s",
    "repeats",
    "tokens_per_step",
    "tokens_per_s",
    "tokens_per_s_per_rank",
    "first_loss",
    "last_loss",
    "wrong",
    "oracle_loss",
    "params",
)


def _bench(args: list[str], timeout: float) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return run_killing_on_timeout([sys.executable, str(BENCH), *args], env, timeout, BENCH.name)


def test_one_rank_eager_sparta_and_torchtitan_report_with_the_oracle() -> None:
    args = [
        "--size",
        "tiny",
        "--repeats",
        "2",
        "--warmup",
        "1",
        "--models",
        "dense",
        "--layouts",
        "1",
        "--candidates",
        "eager,sparta,torchtitan",
        "--no-cluster",
    ]
    code, out = _bench(args, 600)
    assert code == 0, out[-3000:]
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert not [r for r in records if "error" in r], records

    (header,) = [r for r in records if r["bench"] == "trainer_header"]
    assert header["models"]["dense"]["d_model"] == 32 and header["layouts"]["1"]["pp"] == 1, header
    assert header["candidates"] == ["eager", "sparta", "torchtitan"], header

    timed = {r["candidate"]: r for r in records if r["bench"] == "trainer" and "median_s" in r}
    skipped = {r["candidate"]: r for r in records if r["bench"] == "trainer" and "skipped" in r}
    assert {"eager", "sparta"} <= set(timed), sorted(timed)
    # torchtitan: timed where it is installed, else a record that says why (never silently dropped)
    assert ("torchtitan" in timed) != ("torchtitan" in skipped), (sorted(timed), sorted(skipped))
    if "torchtitan" in skipped:
        assert "torchtitan" in skipped["torchtitan"]["skipped"], skipped
    for name in ("eager", "sparta"):
        record = timed[name]
        assert all(field in record for field in TIMING_FIELDS), record
        assert record["repeats"] == 2 and record["ranks"] == 1 and record["tokens_per_step"] == 2 * 16, record
        assert 0 < record["min_s"] <= record["median_s"] <= record["max_s"], record
        assert record["tokens_per_s"] > 0 and record["wrong"] is False, record
        assert record["floor"] == "eager" and record["ratio_to_floor"] > 0, record
    # the oracle: Sparta's first step gives plain eager's loss (one process, same model and batch)
    assert abs(timed["sparta"]["first_loss"] - timed["eager"]["first_loss"]) <= 1e-5, timed
    assert abs(timed["eager"]["first_loss"] - timed["eager"]["oracle_loss"]) <= 1e-5, timed
    if "torchtitan" in timed:
        assert timed["torchtitan"]["tokens_per_s"] > 0 and timed["torchtitan"]["peak_rss_mib"] > 0, timed

    memory = {r["candidate"]: r for r in records if r["bench"] == "trainer_memory"}
    assert sorted(memory) == ["eager", "sparta"], memory
    for record in memory.values():
        assert record["peak_rss_mib"] > record["base_rss_mib"] > 0, record
        assert len(record["peak_rss_mib_per_rank"]) == 1, record

    (target,) = [r for r in records if r["bench"] == "trainer_target"]
    assert "eager" in target["target"] and target["ratio"] > 0 and isinstance(target["met"], bool), target


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layouts", "pp3"], "unknown layouts ['pp3']"),
        (["--candidates", "sparta,megatron"], "unknown candidates ['megatron']"),
        (["--repeats", "0"], "--repeats and --warmup must be >= 1"),
    ],
)
def test_bad_arguments_exit_with_a_message(args: list[str], message: str) -> None:
    code, out = _bench(args, 60)
    assert code == 2, out[-3000:]
    assert message in out, out[-3000:]


def _suite(args: list[str], timeout: float) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "sparta.cli", "bench", "trainer", "--size", "tiny", "-n", "2", "-w", "1", *args]
    return run_killing_on_timeout(cmd, env, timeout, "sparta bench trainer")


def test_bench_suite_times_the_layouts_of_its_world_and_checks_the_first_loss(tmp_path: Path) -> None:
    out_file = tmp_path / "run.jsonl"
    args = ["--nprocs", "1", "--layouts", "1,dp2", "--models", "dense", "-J", str(out_file)]
    code, out = _suite(args, 300)
    assert code == 0, out[-3000:]
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    points = {r["variant"]: r for r in records if r["type"] == "point"}
    assert sorted(points) == ["eager", "sparta"], records
    for point in points.values():
        assert point["wrong"] == 0 and point["layout"] == "1" and point["tokens_per_s"] > 0, point
        assert point["tokens_per_step"] == 2 * 16 and point["median_us"] > 0, point
    reasons = {r.get("layout", r.get("candidate")): r["reason"] for r in records if r["type"] == "skipped"}
    assert "--nprocs 2" in reasons["dp2"] and "benchmarks/trainer.py" in reasons["torchtitan"], reasons
    # a planted wrong oracle fails the run: the first-step check is live
    code, out = _suite(["--nprocs", "1", "--layouts", "1", "--models", "dense", "--candidates", "sparta",
                        "--_plant-wrong"], 300)  # fmt: skip
    assert code == 1, out[-3000:]


def test_whole_experts_and_whole_heads_run_only_under_tp() -> None:
    from sparta_tools.bench.trainer import LAYOUTS, SIZES, plan_candidates

    wanted = ["sparta", "sparta_experts_whole"]
    moe, dense = SIZES["tiny"]["moe"], SIZES["tiny"]["dense"]
    assert plan_candidates(moe, LAYOUTS["tp2"], wanted)[0] == wanted
    assert plan_candidates(dense, LAYOUTS["tp2"], wanted)[0] == ["sparta"]
    assert plan_candidates(moe, LAYOUTS["dp2"], wanted)[0] == ["sparta"]
    # the head whole on each tp rank: either model, only under tp
    wanted = ["sparta", "sparta_head_whole"]
    assert plan_candidates(dense, LAYOUTS["tp2"], wanted)[0] == wanted
    assert plan_candidates(moe, LAYOUTS["tp2"], wanted)[0] == wanted
    assert plan_candidates(dense, LAYOUTS["fsdp4"], wanted)[0] == ["sparta"]


def test_torchtitan_target_takes_the_alternating_pair_where_it_ran(capsys: pytest.CaptureFixture[str]) -> None:
    """Two launches' medians drift more than the gap judged: the pair's ratio wins, and the
    same model's (torchtitan's Llama under both trainers) where it ran."""
    import importlib.util

    from sparta_tools.bench.trainer import LAYOUTS, SIZES

    spec = importlib.util.spec_from_file_location("trainer_bench_script", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    apart = [
        {"bench": "trainer", "candidate": "sparta", "median_s": 2.8},
        {"bench": "trainer", "candidate": "torchtitan", "median_s": 2.5},
    ]
    pair = {"bench": "trainer_pair", "torchtitan_over_sparta": 0.97, "torchtitan_over_sparta_same_model": None}
    same = {**pair, "torchtitan_over_sparta_same_model": 1.02}
    for records, ratio, how in (
        (apart, 0.8929, "medians of two launches"),
        ([*apart, pair], 0.97, "alternating in one launch"),
        ([*apart, same], 1.02, "torchtitan's own model under both"),
    ):
        bench.targets("debug", SIZES["debug"]["dense"], LAYOUTS["fsdp4"], records)
        (target,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert target["ratio"] == ratio and how in target["target"] and target["met"] == (ratio >= 1), target
        assert target.get("hf_llama_ratio") == (0.97 if ratio == 1.02 else None), target
