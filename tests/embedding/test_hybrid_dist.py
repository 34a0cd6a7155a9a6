"""A transformer LM with SparseEmbedding under DDP, Horovod and the PriorityQueue trains like
one with nn.Embedding under plain DDP / Horovod / one process (dist/embedding_hybrid_checks.py)."""

from __future__ import annotations

import pytest
from launch import assert_all_ok, launch

from tests.dist.embedding_hybrid_checks import CHECKS


@pytest.mark.parametrize("launcher", ["torchrun", "horovodrun", "mpirun"])
def test_lm_with_sparse_embeddings_matches_dense_data_parallel(launcher: str) -> None:
    results = launch(launcher, "embedding_hybrid_checks.py", nprocs=4, timeout=240)
    assert_all_ok(results, nprocs=4, expected_checks=len(CHECKS))
