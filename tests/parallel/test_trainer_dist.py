"""The 3D trainer equals one process: real ranks, real engines (tests/dist/parallel_checks.py).

Each launch trains the MoE decoder with a sharded embedding for 10 SGD steps under several
schedules and data-parallel strategies, some with stages recomputing their activations, some
with batches of several padded lengths (a pipeline schedule per shape; under pp2 x dp2 x tp2
x ep2 the dp ranks of a step at different lengths), some with the output head split by
vocabulary over the pipeline ranks (vocab_stages), and compares every step's loss with one
process on the global batch, within 1e-5 (float32); the 8-rank launch also checks every bad
input.
"""

from __future__ import annotations

import pytest
import torch
from launch import assert_all_ok, launch, require_launcher

from tests.dist.parallel_checks import CHECKS

LAYOUTS = [
    # launcher, ranks, degrees, check set
    ("torchrun", 1, [], "one"),
    # the same code on a GPU, where there is one: CPU runs list no test they cannot run
    *([("torchrun", 1, ["--device", "cuda"], "one")] if torch.cuda.is_available() else []),
    ("torchrun", 8, ["--pp", "2", "--dp", "2", "--tp", "2", "--ep", "2"], "all"),
    ("torchrun", 4, ["--dp", "4", "--ep", "2"], "ddp"),
    ("torchrun", 4, ["--pp", "2", "--dp", "2", "--ep", "2"], "ddp_pp"),
    # the co-scheduler inside the trainer: pipelined rows over a two-level all-to-all, 2 nodes of 2
    ("torchrun", 4, ["--dp", "4", "--ep", "4", "--ranks-per-node", "2"], "coscheduled"),
    ("horovodrun", 4, ["--dp", "4", "--ep", "4"], "horovod"),
    ("horovodrun", 4, ["--pp", "2", "--dp", "2", "--ep", "2"], "horovod"),
    ("mpirun", 4, ["--pp", "2", "--dp", "2", "--ep", "2"], "sparta"),
]


@pytest.mark.parametrize(("launcher", "nprocs", "degrees", "checks"), LAYOUTS, ids=lambda v: str(v).replace(" ", ""))
def test_trainer_equals_one_process(launcher: str, nprocs: int, degrees: list[str], checks: str) -> None:
    require_launcher(launcher)
    results = launch(launcher, "parallel_checks.py", nprocs=nprocs, args=[*degrees, "--checks", checks], timeout=600)
    assert_all_ok(results, nprocs=nprocs, expected_checks=len(CHECKS[checks]))
