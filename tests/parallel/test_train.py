"""`sparta train` as users launch it, beyond the demo's torchrun run (tests/test_demo.py):

- one process, no launcher: a run that finds a checkpoint resumes from it and continues the
  uninterrupted run's losses exactly (the batch of a step is a function of (seed, step); the
  optimizer and RNG states come back with the weights);
- the demo's own file under mpirun, on the MPI engine, 8 ranks;
- a run under horovodrun, on the Horovod engine with Horovod's data parallelism (dp2) and the
  experts over both ranks (ep2) with the co-scheduler tuned at the first step
  (``pipeline_degree = "auto"``), whose losses equal one process's on the same global batches.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "moe_gpt.toml"
SPARTA = Path(sys.executable).parent / "sparta"

TINY = """
[model]
vocab_size = 128
seq_len = 16
d_model = 32
n_layers = 2
n_heads = 2
d_ff = 32
[parallel.moe]
num_experts = 4
top_k = 2
[train]
steps = 6
global_batch = 4
lr = 1e-2
warmup_steps = 2
eval_every = 3
[data]
source = "random"
random_tokens = 20000
"""


def _run(cmd: list[str], timeout: float, what: str, expect: int = 0) -> str:
    from launch import run_killing_on_timeout

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE", "HOROVOD_RANK"):
        env.pop(var, None)  # the launcher in cmd (or none: one process) sets these, not the test's own
    code, out = run_killing_on_timeout(cmd, env, timeout, what)
    assert code == expect, f"{what} exited with {code}, not {expect}; output tail:\n{out[-4000:]}"
    return out


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resumed_run_continues_the_uninterrupted_losses(tmp_path: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    ckpt = tmp_path / "ckpt"

    def train(metrics: str, *more: str, expect: int = 0) -> str:
        sets = [f"checkpoint.dir={ckpt}", "checkpoint.every=3", "checkpoint.keep=2", *more]
        sets.append(f"output.metrics={tmp_path / metrics}")
        cmd = [str(SPARTA), "train", "--config", str(config), *[a for s in sets for a in ("--set", s)]]
        return _run(cmd, 180, f"sparta train ({metrics})", expect)

    train("whole.jsonl")
    whole = _records(tmp_path / "whole.jsonl")
    assert [r["step"] for r in whole] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_3", "step_6"]
    # as if the run had died after step 3's checkpoint: the next launch resumes there
    shutil.rmtree(ckpt / "step_6")
    out = train("resumed.jsonl")
    assert "resumed from step 3" in out, out[-2000:]
    resumed = _records(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for a, b in zip(whole[3:], resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6), (a, b)
        assert b["lr"] == a["lr"] and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert resumed[-1]["val_loss"] == pytest.approx(whole[-1]["val_loss"], abs=1e-6)
    assert whole[-1]["expert_load"] >= 1.0 and whole[-1]["mfu"] is None  # no peak_tflops stated: no MFU

    # the same directory under another model: refused with the keys that differ, exit code 2
    out = train("other.jsonl", "model.n_layers=3", "train.steps=9", expect=2)
    assert "sparta train: loading" in out and "layers.2." in out, out[-2000:]


def test_an_unwritable_metrics_file_stops_every_rank(tmp_path: Path) -> None:
    """Rank 0 alone opens output.metrics; where it cannot, the other rank raises too, rather
    than waiting in the first validation's collectives (the launch would hang)."""
    from launch import command

    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    not_a_folder = tmp_path / "a_file"
    not_a_folder.write_text("")
    sets = ["parallel.dp=2", f"output.metrics={not_a_folder / 'metrics.jsonl'}"]
    args = ["train", "--config", str(config), *[a for s in sets for a in ("--set", s)]]
    out = _run(command("torchrun", 2, SPARTA, args), 150, "torchrun sparta train (bad metrics path)", expect=1)
    assert out.count("opening output.metrics") >= 2 and "cannot be written" in out, out[-3000:]


def test_the_demo_file_under_mpirun(tmp_path: Path) -> None:
    from launch import command, require_launcher

    require_launcher("mpirun")
    metrics = tmp_path / "metrics.jsonl"
    sets = ["train.steps=4", "train.eval_every=2", f"output.metrics={metrics}"]
    args = ["train", "--config", str(DEMO), *[a for s in sets for a in ("--set", s)]]
    out = _run(command("mpirun", 8, SPARTA, args), 600, "mpirun sparta train")
    # launchers merge the ranks' stdout and stderr: another rank's text may precede it on its line
    found = re.findall(r'\{"steps": .*\}', out)
    assert found, f"no summary line in the output; tail:\n{out[-4000:]}"
    summary = json.loads(found[-1])
    assert summary["backend"] == "mpi" and summary["ranks"] == 8 and summary["steps"] == 4, summary
    assert re.search(r"co-scheduler tuned: \d+ forward / \d+ backward chunks", out), out[-4000:]  # the demo's "auto"
    records = _records(metrics)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(7.0 < r["loss"] < 8.2 and r["expert_load"] >= 1.0 for r in records), records
    assert "val_loss" in records[1] and "val_loss" in records[3]


def test_a_run_under_horovodrun_equals_one_process(tmp_path: Path) -> None:
    from launch import command, require_launcher

    require_launcher("horovodrun")
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)

    def train(metrics: str, *more: str) -> list[str]:
        sets = [f"output.metrics={tmp_path / metrics}", "train.eval_every=0", *more]
        return ["train", "--config", str(config), *[a for s in sets for a in ("--set", s)]]

    # aux losses and routing are per chunk: the oracle runs dp2's two halves as micro-batches
    _run([str(SPARTA), *train("one.jsonl", "parallel.microbatches=2")], 180, "sparta train (one process)")
    # the experts over both ranks, the co-scheduler tuned at the first step on Horovod's engine
    auto = ("parallel.ep=2", "parallel.moe.pipeline_degree=auto")
    args = train("hvd.jsonl", "parallel.dp=2", "parallel.data_parallel=horovod", *auto)
    out = _run(command("horovodrun", 2, SPARTA, args), 300, "horovodrun sparta train")
    found = re.findall(r'\{"steps": .*\}', out)
    assert found, f"no summary line in the output; tail:\n{out[-4000:]}"
    summary = json.loads(found[-1])
    assert summary["backend"] == "horovod" and summary["ranks"] == 2, summary
    tuned = r"co-scheduler tuned: \d+ forward / \d+ backward chunks, flat all-to-all \(2 MoE layers\)"
    assert re.search(tuned, out), out[-4000:]
    one, hvd = _records(tmp_path / "one.jsonl"), _records(tmp_path / "hvd.jsonl")
    assert [r["step"] for r in hvd] == [1, 2, 3, 4, 5, 6]
    # float32 sums in another order (measured: 5e-7 apart over 6 AdamW steps)
    for a, b in zip(one, hvd, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (a, b)


def test_documents_through_a_pipeline_equal_one_process(tmp_path: Path) -> None:
    """data.samples = "documents": steps of one shape padded to parallel.lengths, several shapes
    through one pp2 pipeline (a schedule each), equal to one process on the same steps."""
    from launch import command, require_launcher

    require_launcher("torchrun")
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    sets = ["data.samples=documents", "parallel.lengths=[4, 8, 16]", "parallel.microbatches=2", "train.eval_every=3"]

    def train(metrics: str, *more: str) -> list[str]:
        every = [*sets, f"output.metrics={tmp_path / metrics}", *more]
        return ["train", "--config", str(config), *[a for s in every for a in ("--set", s)]]

    _run([str(SPARTA), *train("one.jsonl")], 180, "sparta train on documents (one process)")
    _run(command("torchrun", 2, SPARTA, train("pp2.jsonl", "parallel.pp=2")), 300, "torchrun sparta train pp2")
    one, pp2 = _records(tmp_path / "one.jsonl"), _records(tmp_path / "pp2.jsonl")
    assert [r["step"] for r in pp2] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(one, pp2, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5), (a, b)
        assert b["tokens"] == a["tokens"] and b.get("val_loss") == pytest.approx(a.get("val_loss"), abs=1e-5)
    # a batch by token budget: each step's real tokens, at most the windows' 4 x 16
    assert all(0 < r["tokens"] <= 64 for r in one) and len({r["tokens"] for r in one}) > 1, one
