"""The demo (`make demo`): `sparta train --config examples/moe_gpt.toml` on 8 real ranks under
torchrun (pp2 x dp2 x tp2, experts over ep2), shortened by `--set`; its metrics file, Chrome
traces and summary line are checked. And a dry run of `make demo`, which must not wait for
MPI or Horovod."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "moe_gpt.toml"
STEPS = 30


def test_the_demo_trains_on_eight_ranks_through_sparta_train(tmp_path: Path) -> None:
    from launch import free_port, run_killing_on_timeout

    metrics, trace = tmp_path / "metrics.jsonl", tmp_path / "trace.json"
    overrides = [
        f"train.steps={STEPS}", "train.warmup_steps=5", "train.eval_every=15", "data.corpus_mb=0.5",
        f"data.cache_dir={tmp_path / 'cache'}", f"output.metrics={metrics}", "output.trace_start=3",
        "output.trace_steps=1",
    ]  # fmt: skip
    sparta = Path(sys.executable).parent / "sparta"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=8", "--master-addr=127.0.0.1",
        f"--master-port={free_port()}", "--no-python", str(sparta), "train", "--config", str(DEMO),
        "--trace", str(trace), *[a for o in overrides for a in ("--set", o)],
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    code, out = run_killing_on_timeout(cmd, env, 420, "sparta train on 8 ranks")
    assert code == 0, f"sparta train exited with {code}; output tail:\n{out[-4000:]}"

    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "one record per step, written by rank 0 alone"
    fields = {"step", "loss", "lr", "grad_norm", "step_s", "tokens", "tokens_per_s", "mfu", "peak_mem_mb"}
    fields.add("expert_load")
    for r in records:
        assert fields <= set(r), f"missing {fields - set(r)} in {r}"
        assert r["tokens"] == 16 * 64 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["peak_mem_mb"] > 50, r
        assert r["expert_load"] >= 1.0, r  # max/mean tokens per expert of rank 0's stage
    losses = [r["loss"] for r in records]
    first, last = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    assert 7.0 < first < 8.2, f"an untrained model should be near ln(2048) = 7.6: {losses[:3]}"
    assert last < first - 0.4, f"the loss did not fall: {losses}"
    assert "val_loss" in records[14] and "val_loss" in records[-1] and "val_loss" not in records[0]

    # launchers merge the ranks' stdout and stderr: another rank's text may precede it on its line
    found = re.findall(r'\{"steps": .*\}', out)
    assert found, f"no summary line in the output; tail:\n{out[-4000:]}"
    summary = json.loads(found[-1])
    assert summary["steps"] == STEPS and summary["ranks"] == 8 and summary["backend"] == "torch", summary
    assert summary["val_loss"] < summary["initial_val_loss"], summary
    assert "pp2 x dp2 x tp2, ep2, 1F1B" in out
    assert re.search(r"co-scheduler tuned: \d+ forward / \d+ backward chunks, .* \(2 MoE layers\)", out), out[-4000:]

    # rank 0 writes the trace's own path, rank r > 0 trace.rank<r>.json
    for rank in range(8):
        path = trace if rank == 0 else tmp_path / f"trace.rank{rank}.json"
        events = json.loads(path.read_text())["traceEvents"]
        assert any(e.get("name") == "step 3" for e in events), f"{path} has no 'step 3' region"


def _make_dry_run(target: str) -> str:
    """Every command `make <target>` would run on a fresh clone: -B takes every stamp as stale,
    -n runs none of them."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not on PATH")
    # An outer make (make test) must not hand its flags to this one.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    done = subprocess.run([make, "-n", "-B", target], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"make -n -B {target} failed:\n{done.stderr}"
    return done.stdout


def test_make_demo_sets_up_neither_mpi_nor_horovod() -> None:
    demo, test = _make_dry_run("demo"), _make_dry_run("test")
    tests_only = ("scripts/install_horovod.sh", "apt-get", "'.[test,mpi]'")
    for step in tests_only:
        assert step in test, f"make test no longer runs {step!r}; update this test:\n{test}"
        assert step not in demo, f"make demo runs {step!r}, which only the tests need:\n{demo}"
    for step in ("torch==2.13.0", "'.[demo]'", "torch.distributed.run", "--nproc-per-node=8",
                 "sparta train --config examples/moe_gpt.toml"):  # fmt: skip
        assert step in demo, f"make demo does not run {step!r}:\n{demo}"
