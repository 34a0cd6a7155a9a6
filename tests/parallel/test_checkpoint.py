"""sparta.parallel.checkpoint: one process here, real launches in test_checkpoints_across_layouts.

The launches (tests/dist/checkpoint_checks.py) save on 8 ranks (pp2 x dp2 x tp2 ep2, FSDP2),
load on 4 (dp4 ep4), into the vocabulary stages of the same 8 ranks (and back into one
process) and in one process without a process group, SIGKILL a run while it
saves and resume it, and feed bad input to every rank. The one-process tests below cover the
directory's life: partial checkpoints ignored and removed, old ones pruned, a step saved
twice, and the errors of a wrong call.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from launch import assert_all_ok, launch, launch_raw
from torch import nn

from sparta.embedding import SparseEmbedding
from sparta.errors import ConfigError, SpartaError
from sparta.moe import MoELayer
from sparta.parallel.checkpoint import Checkpointer, CheckpointError


class Small(nn.Module):
    """A sharded-embedding model of one process: the checkpointer's keys for each kind."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = SparseEmbedding(20, 16)
        self.moe = MoELayer(16, 32, 4, top_k=2, capacity_factor=None)
        self.out = nn.Linear(16, 20)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(self.emb(ids))) * self.scale


def trained(seed: int = 0, steps: int = 2, lr: float = 1e-2) -> tuple[Small, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Small()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        ids = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(step))
        nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_a_checkpoint_restores_the_model_the_optimizer_and_extra(tmp_path: Path) -> None:
    model, opt = trained()
    ckpt = Checkpointer(tmp_path)
    assert ckpt.load(model, opt) is None  # nothing saved yet
    rng = torch.get_rng_state()
    ckpt.save(2, [model], opt, {"position": 17, "scheduler": {"last_epoch": 2}})
    torch.rand(3)  # move the RNG on: load must put it back
    fresh, fresh_opt = trained(seed=1, steps=0, lr=0.5)
    assert ckpt.load([fresh], fresh_opt) == {"position": 17, "scheduler": {"last_epoch": 2}, "step": 2}
    assert torch.equal(torch.get_rng_state(), rng)
    for (key, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert opt.state[p].keys() == fresh_opt.state[q].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for name in opt.state[p]:
            assert torch.equal(opt.state[p][name], fresh_opt.state[q][name]), name
    assert fresh_opt.param_groups[0]["lr"] == 1e-2  # hyperparameters come back, as load_state_dict does
    ids = torch.randint(0, 20, (4, 5))
    nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    nn.functional.cross_entropy(fresh(ids).flatten(0, 1), ids.flatten()).backward()
    opt.step()
    fresh_opt.step()
    for (key, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{key} after one more step"


def test_parameters_not_yet_stepped_load_without_state(tmp_path: Path) -> None:
    """A parameter the optimizer has not stepped when the checkpoint is written (no gradient
    yet, or step 0 itself) has no state in it, and none after the load: the resumed run then
    steps it as the run that saved it does."""
    model, opt = trained(steps=0)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(0, model, opt)  # before any step: no optimizer state at all
    fresh, fresh_opt = trained(seed=1, steps=0)
    assert ckpt.load(fresh, fresh_opt) == {"step": 0} and not fresh_opt.state
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    # one step in which the head alone gets a gradient
    model.out(torch.randn(3, 16)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    ckpt.save(1, model, opt)
    fresh, fresh_opt = trained(seed=1, steps=0)
    ckpt.load(fresh, fresh_opt)
    stepped = {name for name, p in fresh.named_parameters() if fresh_opt.state.get(p)}
    assert stepped == {"out.weight", "out.bias"}, stepped
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        for key, value in opt.state.get(p, {}).items():
            assert torch.equal(value, fresh_opt.state[q][key]), (name, key)
    # the next step, with every parameter's gradient, lands alike on both
    ids = torch.randint(0, 20, (4, 5))
    for m, o in ((model, opt), (fresh, fresh_opt)):
        nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten()).backward()
        o.step()
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), name
    # saved without an optimizer, a load with one is still refused by name
    ckpt.save(2, model)
    with pytest.raises(CheckpointError, match="missing keys"):
        ckpt.load(fresh, fresh_opt, step=2)


def test_partial_checkpoints_are_ignored_and_removed(tmp_path: Path) -> None:
    model, opt = trained()
    ckpt = Checkpointer(tmp_path, keep=2)
    ckpt.save(2, model, opt)
    # what a crash while saving step 4 leaves: a temporary directory with some files
    partial = tmp_path / ".tmp-step_4"
    shutil.copytree(tmp_path / "step_2", partial)
    (partial / ".metadata").unlink()
    # and a step directory without DCP's metadata (copied by hand, half done)
    (tmp_path / "step_9").mkdir()
    assert ckpt.steps() == [2]
    assert ckpt.load(model, opt) == {"step": 2}
    assert not partial.exists()


def test_keep_prunes_the_oldest_after_the_new_one_is_complete(tmp_path: Path) -> None:
    model, opt = trained()
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, model, opt)
    assert ckpt.steps() == [2, 3]
    # a run that went back to step 1 and saved it again: steps 2 and 3 are the abandoned
    # run's, set aside (kept, never resumed)
    ckpt.save(1, model, opt, {"run": "again"})
    assert ckpt.steps() == [1]
    assert all((tmp_path / f"later-step_{n}" / ".metadata").is_file() for n in (2, 3))
    assert ckpt.load(model, opt) == {"run": "again", "step": 1}
    every = Checkpointer(tmp_path, keep=None)
    for step in (4, 5):
        every.save(step, model, opt)
    assert every.steps() == [1, 4, 5]
    # a prune that died half way left a renamed directory: never read, removed at the next call
    (tmp_path / ".del-step_0").mkdir()
    (tmp_path / ".del-step_0" / ".metadata").write_text("half removed")
    assert every.steps() == [1, 4, 5]
    every.load(model, opt)
    assert not (tmp_path / ".del-step_0").exists()
    # back to step 3 twice: the second set-aside of step 4 keeps the first (a suffix)
    every.save(3, model, opt)
    every.save(4, model, opt)
    every.save(3, model, opt)
    assert every.steps() == [1, 3]
    assert all((tmp_path / name / ".metadata").is_file() for name in ("later-step_4", "later-step_4.2", "later-step_5"))


def test_a_save_that_dies_before_its_step_appears_never_resumes_the_abandoned_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 1 to 3 saved, the run goes back to step 1 and saves step 2 again, and the move
    that publishes it fails (a full disk, a crash): the abandoned step 3 is already set aside,
    so a load never resumes it; step 2 is still the one saved before."""
    import sparta.parallel.checkpoint as checkpoint

    model, opt = trained()
    ckpt = Checkpointer(tmp_path, keep=None)
    for step in (1, 2, 3):
        ckpt.save(step, model, opt, {"run": "first"})

    def no_space(tmp: Path, final: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "publish", no_space)
    with pytest.raises(CheckpointError, match=r"cannot move the complete checkpoint .*No space left"):
        ckpt.save(2, model, opt, {"run": "again"})
    assert ckpt.steps() == [1, 2] and (tmp_path / "later-step_3" / ".metadata").is_file()
    assert ckpt.load(model, opt) == {"run": "first", "step": 2}

    def read_only(directory: Path, step: int) -> list[Path]:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(checkpoint, "set_aside_later", read_only)
    with pytest.raises(CheckpointError, match=r"cannot set aside the checkpoints past step 1 .*Read-only"):
        ckpt.save(1, model, opt, {"run": "again"})
    assert ckpt.steps() == [1, 2]  # nothing published past what could not be set aside


def test_saving_a_step_again_replaces_it_whole(tmp_path: Path) -> None:
    model, opt = trained()
    ckpt = Checkpointer(tmp_path)
    ckpt.save(3, model, opt, {"version": 1})
    ckpt.save(3, model, opt, {"version": 2})
    assert ckpt.load(model, opt) == {"version": 2, "step": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]
    # a crash between the two renames leaves only the old copy, under .old-: it comes back
    os.rename(tmp_path / "step_3", tmp_path / ".old-step_3")
    assert ckpt.load(model, opt) == {"version": 2, "step": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]


def test_load_takes_a_given_step(tmp_path: Path) -> None:
    model, opt = trained()
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, model, opt, {"tag": "one"})
    ckpt.save(2, model, opt, {"tag": "two"})
    assert ckpt.load(model, opt, step=1) == {"tag": "one", "step": 1}
    with pytest.raises(CheckpointError, match=re.escape("step_7 is not a complete checkpoint; complete steps: [1, 2]")):
        ckpt.load(model, opt, step=7)


def test_a_checkpoint_of_another_model_names_the_keys(tmp_path: Path) -> None:
    model, opt = trained()
    Checkpointer(tmp_path).save(2, model, opt)
    other, other_opt = trained(steps=0)
    other.out = nn.Linear(16, 30)
    del other.moe
    other.head = nn.Linear(16, 16)
    other_opt = torch.optim.AdamW(other.parameters())
    with pytest.raises(CheckpointError) as caught:
        Checkpointer(tmp_path).load(other, other_opt)
    message = str(caught.value)
    assert "missing keys (8): model.head.bias, model.head.weight, optim.head.bias.exp_avg" in message, message
    assert "unexpected keys (" in message and "model.moe.experts.w1.0, model.moe.experts.w1.1" in message, message
    assert "shape mismatches (6): model.out.bias (checkpoint (20,), model (30,))" in message, message
    assert not other_opt.state, "a failed load leaves the optimizer as it was"
    # without an optimizer, the checkpoint's optimizer state is not asked for (nor unexpected)
    model2, _ = trained(steps=0)
    assert Checkpointer(tmp_path).load(model2) == {"step": 2}


def test_bad_calls_are_refused(tmp_path: Path) -> None:
    model, opt = trained()
    for bad in ({"keep": 0}, {"keep": 1.5}, {"keep": True}, {"rng": "yes"}):
        with pytest.raises(ConfigError):
            Checkpointer(tmp_path, **bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="non-empty path"):
        Checkpointer("")
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match=r"step=-1 must be an int >= 0"):
        ckpt.save(-1, model, opt)
    with pytest.raises(CheckpointError, match=r"extra\['step'\]=5 differs from step=4"):
        ckpt.save(4, model, opt, {"step": 5})
    stranger = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(CheckpointError, match=r"optimizer holds a parameter of shape \(3,\) that none of model_parts"):
        ckpt.save(4, model, stranger)
    with pytest.raises(CheckpointError, match="non-empty list"):
        ckpt.save(4, [], opt)

    class WithExtraState(nn.Linear):
        def get_extra_state(self) -> dict:
            return {"calls": 3}

    with pytest.raises(CheckpointError, match="extra state"):
        ckpt.save(4, WithExtraState(2, 2), None)
    assert ckpt.steps() == []


def test_an_unwritable_directory_is_a_clear_error(tmp_path: Path) -> None:
    model, opt = trained()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match=r"cannot create .*file/ckpt/.tmp-step_1: .*Not a directory"):
        Checkpointer(blocker / "ckpt").save(1, model, opt)


def test_checkpoint_error_is_a_sparta_error() -> None:
    assert issubclass(CheckpointError, SpartaError)


def test_a_launched_rank_without_a_process_group_is_refused(tmp_path: Path) -> None:
    """Ranks that each took themselves for the only one would write the same files."""
    script = (
        "import torch, sys\n"
        "from sparta.parallel.checkpoint import Checkpointer, CheckpointError\n"
        "try:\n"
        f"    Checkpointer({str(tmp_path)!r}).save(1, torch.nn.Linear(2, 2))\n"
        "except CheckpointError as e:\n"
        "    print(e); sys.exit(0)\n"
        "sys.exit(3)\n"
    )
    env = dict(os.environ, HOROVOD_RANK="1", HOROVOD_SIZE="2")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "one of 2 launched ranks but torch.distributed is not initialised" in done.stdout, done.stdout
    assert not any(tmp_path.iterdir())


def test_checkpoints_across_layouts_crashes_and_bad_input() -> None:
    """8 ranks save; a 4-rank run dies while saving; 4 ranks load the 8-rank checkpoint and
    resume the dead run exactly; one process without a process group loads both."""
    base = tempfile.mkdtemp(prefix="sparta-ckpt-")
    try:
        common = ["--dir", base]
        results = launch("torchrun", "checkpoint_checks.py", nprocs=8, args=["--phase", "eight", *common], timeout=400)
        assert_all_ok(results, nprocs=8, expected_checks=5)

        code, out, _ = launch_raw("torchrun", "checkpoint_checks.py", 4, ["--phase", "crash", *common], timeout=300)
        assert code != 0 and "Signal 9 (SIGKILL)" in out, f"the run was to die by SIGKILL; exit {code}:\n{out[-3000:]}"
        run = Path(base) / "run"
        assert sorted(p.name for p in run.iterdir()) == [".tmp-step_6", "step_2", "step_4"], list(run.iterdir())
        assert not (run / ".tmp-step_6" / ".metadata").exists()

        results = launch("torchrun", "checkpoint_checks.py", nprocs=4, args=["--phase", "four", *common], timeout=300)
        assert_all_ok(results, nprocs=4, expected_checks=3)

        results = launch("env", "checkpoint_checks.py", nprocs=1, args=["--phase", "one", *common], timeout=120)
        assert_all_ok(results, nprocs=1, expected_checks=2)
        for phase in ("eight", "four", "one"):  # the measured gaps, for the log (-s shows them)
            print(phase, (Path(base) / f"gaps-{phase}.json").read_text())
    finally:
        shutil.rmtree(base, ignore_errors=True)
