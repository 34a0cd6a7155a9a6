"""sparta.comm.shm_rows: the shared-memory row gather, two "ranks" in one process.

A gather publishes its row when it starts and its wait only reads the peers' files, so two
instances over the same two files, called in turn, are two ranks: no thread, no mock.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest
import torch

from sparta.comm.shm_rows import SLOTS, SharedRowGather, control_path, ordered_stores
from sparta.errors import CollectiveTimeoutError

pytestmark = pytest.mark.skipif(
    not (ordered_stores() and os.path.isdir("/dev/shm")), reason="the row gather serves x86-64 hosts with /dev/shm"
)

ROW = 5


@pytest.fixture
def pair() -> Iterator[list[SharedRowGather]]:
    paths = [control_path(secrets.randbits(62)) for _ in range(2)]
    for path in paths:
        SharedRowGather.create(path, ROW)
    ranks = [SharedRowGather(r, paths, ROW, timeout_s=0.3) for r in range(2)]
    for path in paths:
        os.unlink(path)  # mapped by both: nothing needs the names any more
    yield ranks
    for g in ranks:
        g.close()


def row(rank: int, seq: int) -> torch.Tensor:
    return torch.arange(ROW, dtype=torch.int64) + 1000 * seq + 100 * rank


def test_rows_arrive_in_rank_order_past_slot_reuse_and_out_of_order_waits(pair: list[SharedRowGather]) -> None:
    # Three gathers in flight at a time, waited newest first, for 3 * SLOTS gathers: every
    # slot is rewritten twice, each time only after both ranks read what it held.
    for first in range(0, 3 * SLOTS, 3):
        handles = [[g.gather(row(g.rank, s), "test") for g in pair] for s in range(first, first + 3)]
        for s in reversed(range(first, first + 3)):
            for h in handles[s - first]:
                assert torch.equal(h.wait(), torch.stack([row(0, s), row(1, s)]))


def test_a_rank_that_never_joins_times_out_naming_it(pair: list[SharedRowGather]) -> None:
    handle = pair[0].gather(row(0, 0), "all_to_all on group 'g'")
    with pytest.raises(CollectiveTimeoutError, match=r"all_to_all on group 'g': rank\(s\) \[1\] never joined"):
        handle.wait()


def test_a_writer_waits_for_readers_before_reusing_a_slot(pair: list[SharedRowGather]) -> None:
    # Rank 1 joins every gather but reads none: rank 0 may run SLOTS ahead, no further.
    for s in range(SLOTS):
        pair[1].gather(row(1, s), "test")
        pair[0].gather(row(0, s), "test").wait()
    with pytest.raises(CollectiveTimeoutError, match=r"rank\(s\) \[1\] have not read this rank's earlier rows"):
        pair[0].gather(row(0, SLOTS), "test")
