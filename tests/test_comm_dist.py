"""sparta.comm on 4 real processes under every launcher and engine."""

from __future__ import annotations

import pytest
from launch import assert_all_ok, launch

from tests.dist.comm_checks import CHECKS, TORCH_ONLY
from tests.dist.timeout_checks import OPS

ENGINES = ["torchrun", "mpirun", "horovodrun", "horovod-mpirun"]


@pytest.mark.parametrize("launcher", ENGINES)
def test_every_collective_on_four_ranks(launcher: str) -> None:
    results = launch(launcher, "comm_checks.py", nprocs=4, timeout=400)
    expected = len(CHECKS) - (0 if launcher == "torchrun" else len(TORCH_ONLY))
    assert_all_ok(results, nprocs=4, expected_checks=expected)


@pytest.mark.parametrize("launcher", ENGINES)
def test_stuck_collective_times_out_naming_rank_and_op(launcher: str) -> None:
    results = launch(launcher, "timeout_checks.py", nprocs=4, timeout=120, expect_ok=False)
    assert_all_ok(results, nprocs=4, expected_checks=len(OPS) + (2 if launcher == "torchrun" else 1))


@pytest.mark.parametrize("launcher", ENGINES)
def test_failed_collective_or_dropped_handle_breaks_the_communicator(launcher: str) -> None:
    results = launch(launcher, "broken_checks.py", nprocs=4, timeout=120, expect_ok=False)  # wedged: no clean exit
    assert_all_ok(results, nprocs=4, expected_checks=3)
