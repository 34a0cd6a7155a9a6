"""The two-level all-to-all equals the flat one on 4 real ranks (2 nodes x 2), every engine."""

from __future__ import annotations

import pytest
from launch import LAUNCHERS, assert_all_ok, launch

from tests.dist.hier_checks import CHECKS


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_hierarchical_equals_flat(launcher: str) -> None:
    results = launch(launcher, "hier_checks.py", nprocs=4, timeout=180)
    assert_all_ok(results, nprocs=4, expected_checks=len(CHECKS))
