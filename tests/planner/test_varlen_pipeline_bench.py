"""benchmarks/varlen_pipeline.py runs end to end on a tiny case (2 pipeline ranks, torchrun):
each way's step losses equal one process's on the same micro-batches (the benchmark's own
oracle, exit 1 otherwise), and every way takes every sample's tokens. Timings, and the
bucketed way's cuts (they follow the cost fitted to them), are the benchmark's to report;
several shapes through one pipeline are tests/dist/parallel_checks.py's."""

from __future__ import annotations

import json
import os
from pathlib import Path

from launch import command, run_killing_on_timeout

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "varlen_pipeline.py"
TINY = ["--samples", "24", "--seq-len", "64", "--d-model", "32", "--layers", "2", "--vocab", "256",
        "--max-tokens", "256", "--buckets", "16,32,64", "--microbatches", "2", "--repeats", "1"]  # fmt: skip


def test_the_pipeline_takes_padded_packed_and_bucketed_steps_and_equals_one_process() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    code, out = run_killing_on_timeout(command("torchrun", 2, BENCH, TINY), env, 240, BENCH.name)
    assert code == 0, out[-3000:]
    records = [json.loads(line) for line in out.splitlines() if line.startswith('{"record"')]
    gaps = {r["way"]: r["max_rel_gap"] for r in records if r["record"] == "varlen_pipeline_oracle"}
    assert sorted(gaps) == ["bucketed", "packed", "padded"] and max(gaps.values()) < 1e-5, gaps
    ways = {r["way"]: r for r in records if r["record"] == "varlen_pipeline_way"}
    assert ways["padded"]["shapes"] == ways["packed"]["shapes"] == [[8, 64]], ways
    # how bucketed cuts depends on the cost fitted to this machine's timings; its lengths do not
    assert {length for _, length in ways["bucketed"]["shapes"]} <= {16, 32, 64}, ways
    assert all(w["measured_s"] > 0 and w["tokens_with_padding"] >= w["real_tokens"] for w in ways.values()), ways
    summary = next(r for r in records if r["record"] == "varlen_pipeline_summary")
    assert summary["wrong"] == 0, summary
