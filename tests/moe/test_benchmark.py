"""benchmarks/moe_layer.py runs end to end: one process, 2 expert-parallel ranks under torchrun,
and the memory probe, each candidate printing a well-formed JSON record (timings are not
checked here: speed is the benchmark's to report, not a test's)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from launch import run_killing_on_timeout

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_layer.py"
TIMED = ["dense", "naive", "sparta_dropless", "sparta_cap1.25"]
EXPERT_PARALLEL_ONLY = ["sparta_pipelined"]


def _bench(args: list[str], timeout: float) -> tuple[int, str]:
    """(exit code, stdout and stderr) of one run of the benchmark."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return run_killing_on_timeout([sys.executable, str(BENCH), *args], env, timeout, BENCH.name)


def test_every_candidate_reports_on_one_process_and_two_ranks() -> None:
    candidates = ",".join(TIMED + EXPERT_PARALLEL_ONLY)
    args = ["--config", "small", "--repeats", "1", "--ranks", "1,2", "--memory", "--candidates", candidates]
    code, out = _bench(args, 300)
    assert code == 0, out[-3000:]
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert not [r for r in records if "error" in r], records

    one = {r["candidate"]: r for r in records if r["bench"] == "moe_layer"}
    assert sorted(one) == sorted(TIMED + EXPERT_PARALLEL_ONLY), sorted(one)
    for name in TIMED:
        assert one[name]["median_s"] > 0 and one[name]["ratio_to_dense"] > 0, one[name]
        assert one[name]["tokens"] == 4096 and one[name]["ranks"] == 1, one[name]
    # the dropless candidates' outputs equal the one-process layer's; the others say why unchecked
    for name in ("naive", "sparta_dropless"):
        assert one[name]["wrong"] == 0, one[name]
    assert one["dense"]["wrong"] is None and "floor" in one["dense"]["unchecked"], one["dense"]
    assert one["sparta_cap1.25"]["wrong"] is None and "capacity" in one["sparta_cap1.25"]["unchecked"]
    assert one["dense"]["ratio_to_dense"] == 1.0
    for name in EXPERT_PARALLEL_ONLY:
        assert "expert parallel" in one[name]["skipped"], one[name]

    memory = {r["candidate"]: r for r in records if r["bench"] == "moe_layer_memory"}
    for name in TIMED:
        assert memory[name]["peak_rss_mib"] > memory[name]["step_rss_mib"] > 0, memory[name]
        assert name == "dense" or memory[name]["step_ratio_to_dense"] > 0, memory[name]

    two = {r["candidate"]: r for r in records if r["bench"] == "moe_layer_ep"}
    assert sorted(two) == sorted(["dense", "sparta_dropless", "sparta_cap1.25", *EXPERT_PARALLEL_ONLY]), sorted(two)
    for record in two.values():
        assert record["ranks"] == 2 and record["engine"] == "torch" and record["tokens_per_rank"] == 2048, record
        assert record["median_s"] > 0 and record["busiest_rank_load"] >= 1.0, record
    assert two["sparta_dropless"]["wrong"] == 0, two["sparta_dropless"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--candidates", "dense,sparta_fast"], "unknown candidates ['sparta_fast']"),
        (["--device", "cuda", "--ranks", "1,2"], "--device cuda"),
    ],
)
def test_bad_arguments_exit_with_a_message(args: list[str], message: str) -> None:
    code, out = _bench([*args, "--repeats", "1"], 60)
    assert code == 2, out[-3000:]
    assert message in out, out[-3000:]
