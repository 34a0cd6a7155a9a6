"""The layer's timed auto-planning and the gradient pieces' issue, on 4 real ranks."""

from __future__ import annotations

from launch import assert_all_ok, launch

from tests.scheduling.auto_checks import CHECKS


def test_auto_plan_and_piece_issue_on_four_ranks() -> None:
    results = launch("torchrun", "../scheduling/auto_checks.py", nprocs=4, timeout=240)
    assert_all_ok(results, nprocs=4, expected_checks=len(CHECKS))
