"""benchmarks/vocab_stages.py runs end to end on a tiny case (2 pipeline ranks, torchrun): every
way's first loss equals one process's (the benchmark's own oracle, exit 1 otherwise), the
stages hold what each way promises, and each rank's memory is reported. Timings are the
benchmark's to report; the parity of the vocabulary stages is tests/dist/parallel_checks.py's."""

from __future__ import annotations

import json
import os
from pathlib import Path

from launch import command, run_killing_on_timeout

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "vocab_stages.py"
TINY = ["--vocabs", "300", "--d-model", "32", "--layers", "4", "--heads", "2", "--d-ff", "64", "--seq-len", "16",
        "--batch", "4", "--microbatches", "2", "--repeats", "1"]  # fmt: skip


def test_every_way_equals_one_process_and_reports_memory_per_rank() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    code, out = run_killing_on_timeout(command("torchrun", 2, BENCH, TINY), env, 240, BENCH.name)
    assert code == 0, out[-3000:]
    records = [json.loads(line) for line in out.splitlines() if line.startswith('{"bench"')]
    ways = {r["way"]: r for r in records if r["bench"] == "vocab_stages"}
    assert sorted(ways) == ["balanced", "naive", "naive_1f1b", "vocab", "vocab_both"], sorted(ways)
    for way, r in ways.items():
        assert not r["wrong"] and abs(r["first_loss"] - r["one_process_loss"]) < 1e-5 * r["one_process_loss"], r
        assert len(r["peak_mib"]) == 2 and min(r["state_mib"]) > 0 and r["median_s"] > 0, (way, r)
    assert ways["naive"]["stages"][-1] == "stage 3: layers.3, norm, output", ways["naive"]["stages"]
    assert ways["vocab"]["stages"][2:] == ["stage 2: norm, output[0:150]", "stage 3: output[150:300]"]
    assert ways["vocab_both"]["stages"][:2] == ["stage 0: tok_emb[0:150]", "stage 1: tok_emb[150:300]"]
    summary = next(r for r in records if r["bench"] == "vocab_stages_summary")
    assert {"vocab_over_naive", "vocab_both_over_naive_1f1b"} <= set(summary), summary
