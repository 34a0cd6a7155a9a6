"""The MoE language-model demo (examples/train_moe_lm.py) on 2 real ranks under torchrun.

Two launches: the demo itself with a tiny configuration (its loss must fall and its JSON
summary be sane), and this file as a worker that checks the demo's gradient convention:
data-parallel dense weights + expert-parallel experts must give the gradients of one process
running the whole batch. And a dry run of `make demo`, which must not wait for MPI or Horovod.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _torchrun(script: Path, args: list[str], timeout: float) -> str:
    from launch import command, run_killing_on_timeout

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    returncode, out = run_killing_on_timeout(command("torchrun", 2, script, args), env, timeout, script.name)
    if returncode != 0:
        pytest.fail(f"{script.name} exited with {returncode}; output tail:\n{out[-3000:]}")
    return out


def test_demo_trains_on_two_ranks() -> None:
    tiny = "--steps 30 --batch 4 --seq-len 32 --d-model 32 --layers 2 --heads 2 --experts 4 --vocab 512"
    out = _torchrun(EXAMPLES / "train_moe_lm.py", [*tiny.split(), "--corpus-mb", "0.2", "--lr", "1e-2"], 180)
    summary = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert summary["steps"] == 30 and summary["ranks"] == 2 and summary["backend"] == "torch", summary
    assert summary["final_loss"] < summary["initial_loss"] - 0.3, summary
    assert summary["val_loss"] < summary["initial_val_loss"], summary
    assert 5.0 < summary["initial_loss"] < 8.0, f"an untrained model should be near ln(512) = 6.2: {summary}"
    assert summary["tokens_per_s"] > 0 and summary["wall_s"] > 0, summary


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
    for step in ("torch==2.13.0", "'.[demo]'", "torch.distributed.run"):
        assert step in demo, f"make demo does not run {step!r}:\n{demo}"


def test_gradients_equal_one_process_on_the_whole_batch() -> None:
    out = _torchrun(Path(__file__), [], 120)
    assert "gradients match" in out, out[-3000:]


def _check_gradients() -> None:
    """Worker (one per rank): each rank runs its share of a batch through the expert-parallel
    model and syncs as the demo does; one full model on every rank runs the whole batch."""
    import torch
    from moe_lm.model import ModelConfig, MoEGPT

    import sparta
    from sparta.moe import sync_gradients

    torch.set_num_threads(1)
    world = sparta.init()
    # No balance loss: it is computed per rank (as in any data-parallel MoE), so it is not the
    # balance loss of the whole batch. The z-loss, a mean over tokens, stays in.
    cfg = ModelConfig(vocab_size=300, seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=24, aux_loss_coef=0.0)
    per_rank = 3
    shape = (world.size * per_rank, cfg.seq_len + 1)
    ids = torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(0))
    mine = slice(world.rank * per_rank, (world.rank + 1) * per_rank)

    def loss_of(model: MoEGPT, rows: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())

    torch.manual_seed(1)
    full = MoEGPT(cfg)
    torch.manual_seed(1)
    sharded = MoEGPT(replace(cfg, ep_size=world.size), world.comm)
    full_loss = loss_of(full, ids)
    full_loss.backward()
    local_loss = loss_of(sharded, ids[mine])
    local_loss.backward()
    global_loss, norm = sync_gradients(sharded, world.comm, loss=local_loss)

    def close(a: torch.Tensor | float, b: torch.Tensor | float, what: str) -> None:
        same = torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=1e-4, atol=1e-6)
        assert same, f"rank {world.rank}: {what} differs from one process running the whole batch"

    close(global_loss, full_loss, "loss")
    close(norm, torch.cat([p.grad.flatten() for p in full.parameters()]).norm(), "gradient norm")
    for p, q in zip(sharded.dense_parameters(), full.dense_parameters(), strict=True):
        close(p.grad, q.grad, "dense gradient")
    local = cfg.num_experts // world.size
    for p, q in zip(sharded.expert_parameters(), full.expert_parameters(), strict=True):
        close(p.grad, q.grad[world.rank * local : (world.rank + 1) * local], "expert gradient")
    if world.rank == 0:
        print(f"gradients match on {world.size} ranks", flush=True)
    world.exit()


if __name__ == "__main__":
    sys.path[:0] = [str(EXAMPLES)]
    _check_gradients()
