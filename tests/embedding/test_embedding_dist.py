"""SparseEmbedding on real processes under every launcher and engine (see dist/embedding_checks.py)."""

from __future__ import annotations

import pytest
from launch import assert_all_ok, launch

from tests.dist.embedding_checks import CHECKS

ENGINES = ["torchrun", "mpirun", "horovodrun", "horovod-mpirun"]


@pytest.mark.parametrize("launcher", ENGINES)
def test_sparse_embedding_matches_one_process_on_four_ranks(launcher: str) -> None:
    results = launch(launcher, "embedding_checks.py", nprocs=4, timeout=240)
    assert_all_ok(results, nprocs=4, expected_checks=len(CHECKS))


def test_sparse_embedding_matches_one_process_on_two_ranks() -> None:
    results = launch("mpirun", "embedding_checks.py", nprocs=2, timeout=240)
    assert_all_ok(results, nprocs=2, expected_checks=len(CHECKS))
