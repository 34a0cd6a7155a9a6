"""DataParallel in a plain loop: a Hugging Face GPT-2 with expert-parallel MLPs and sparse
embeddings on 4 ranks trains like one process on the global batch (5 SGD steps, within
1e-5) under the engine's own strategy and "sparta" with and without its priority queue; the
path that averaged expert weights as dense ones is shown wrong and is refused
(tests/dist/data_parallel_checks.py)."""

from __future__ import annotations

import pytest
from launch import assert_all_ok, launch, require_launcher

from tests.dist.data_parallel_checks import CHECKS


@pytest.mark.parametrize("launcher", ["torchrun", "horovodrun"])
def test_gpt2_with_experts_and_sparse_embeddings_equals_one_process(launcher: str) -> None:
    require_launcher(launcher)
    results = launch(launcher, "data_parallel_checks.py", nprocs=4, timeout=400)
    assert_all_ok(results, nprocs=4, expected_checks=len(CHECKS))
