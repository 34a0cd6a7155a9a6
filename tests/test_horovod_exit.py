"""Leaving a Horovod world: a rank that exits first must not end its peers' collectives
(dist/horovod_exit_checks.py on 4 horovodrun ranks)."""

from __future__ import annotations

from launch import assert_all_ok, launch

from tests.dist.horovod_exit_checks import CHECKS


def test_early_exit_waits_for_a_late_group_collective() -> None:
    results = launch("horovodrun", "horovod_exit_checks.py", nprocs=4, timeout=120)
    assert_all_ok(results, nprocs=4, expected_checks=len(CHECKS))
