"""Expert parallelism over real engines: 4 ranks under every launcher, 2 under torchrun.

Each launch runs every check of tests/dist/moe_checks.py: every router with and without
capacity against one process, ep_size 2 and 4, empty ranks and idle experts, checkpoints
resharded, expert-data-parallel gradients, and bad input on one rank raising on all.
"""

from __future__ import annotations

import pytest
from launch import assert_all_ok, launch

from tests.dist.moe_checks import checks_for


@pytest.mark.parametrize(
    ("launcher", "nprocs"),
    [("torchrun", 4), ("torchrun", 2), ("mpirun", 4), ("horovodrun", 4), ("horovod-mpirun", 4)],
)
def test_expert_parallel_equals_one_process(launcher: str, nprocs: int) -> None:
    results = launch(launcher, "moe_checks.py", nprocs=nprocs, timeout=400)
    assert_all_ok(results, nprocs=nprocs, expected_checks=len(checks_for(nprocs)))
