"""The pipelined exchange equals the unpipelined computation on 4 real ranks, forward and backward."""

from __future__ import annotations

import pytest
from launch import assert_all_ok, launch

from sparta.errors import ConfigError
from sparta.scheduling.chunks import Chunks, PipelineDegrees
from tests.dist.sched_pipeline_checks import CHECKS


def test_chunks_cover_every_row_once_in_segment_order() -> None:
    import torch

    counts = torch.tensor([5, 0, 3, 1, 7, 2])
    chunks = Chunks.cut(counts, (1, 1, 1), ranks=2)
    assert [c.tolist() for c in chunks.counts] == [[1, 0, 1, 0, 2, 0], [2, 0, 1, 0, 2, 1], [2, 0, 1, 1, 3, 1]]
    assert chunks.splits == ([2, 2], [3, 3], [3, 5])
    everything = torch.cat(chunks.index)
    assert sorted(everything.tolist()) == list(range(18))
    # segment 0 holds rows 0..4; chunk 0 takes its first row, chunk 1 the next two
    assert chunks.index[0].tolist()[:1] == [0] and chunks.index[1].tolist()[:2] == [1, 2]


def test_tapered_chunks_are_small_at_both_ends() -> None:
    import torch

    assert PipelineDegrees(6, 3, taper=2).forward_weights == (1, 2, 4, 4, 2, 1)
    assert PipelineDegrees(6, 3, taper=2).backward_weights == (1, 2, 1)
    assert PipelineDegrees(4, 4, taper=3).forward_weights == (1, 2, 2, 1)
    assert PipelineDegrees(5, 5).forward_weights == (1,) * 5
    assert PipelineDegrees.of(3) == PipelineDegrees(3, 3) and PipelineDegrees.of((8, 8, 2)) == PipelineDegrees(8, 8, 2)
    counts = torch.tensor([40, 0, 13, 80])
    chunks = Chunks.cut(counts, (1, 2, 4, 4, 2, 1), ranks=2)
    assert sorted(torch.cat(chunks.index).tolist()) == list(range(133))
    sizes = [int(c.sum()) for c in chunks.counts]
    assert sizes[0] < sizes[1] < sizes[2] and sizes[-1] < sizes[-2] < sizes[-3]
    assert [c.tolist() for c in chunks.counts][0] == [40 // 14, 0, 13 // 14, 80 // 14]
    # each chunk holds rows grouped by segment, segments in order
    first = chunks.index[0].tolist()
    assert first == sorted(first)


def test_degrees_validated() -> None:
    with pytest.raises(ConfigError, match="backward = 0"):
        PipelineDegrees(1, 0)
    with pytest.raises(ConfigError, match="taper = 4"):
        PipelineDegrees(4, 4, taper=4)


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun", "horovodrun"])
def test_pipelined_equals_unpipelined(launcher: str) -> None:
    results = launch(launcher, "sched_pipeline_checks.py", nprocs=4, timeout=240)
    assert_all_ok(results, nprocs=4, expected_checks=len(CHECKS))
