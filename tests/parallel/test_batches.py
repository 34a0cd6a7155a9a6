"""The rules a ParallelModel's batches are checked and padded by (one process; the same
rules agreed over dp are checked on real ranks in tests/dist/trainer_failures.py)."""

from __future__ import annotations

import re

import pytest
import torch

from sparta.errors import InputError
from sparta.parallel.batches import Batches
from sparta.scheduling.varlen import IGNORE_INDEX


def test_each_bad_batch_is_named_unraised() -> None:
    rules = Batches(microbatches=2, lengths=(4, 8), seq_len=None, num_ids=10, num_classes=6)
    ids = torch.zeros(4, 3, dtype=torch.long)
    assert rules.problem(ids, ids) is None
    cases = [
        ((ids, ids[:, :2]), r"ids \(4, 3\) and targets \(4, 2\) must both be tensors \[B, T\]"),
        ((ids[0], ids[0]), r"must both be tensors \[B, T\]"),
        ((ids[:3], ids[:3]), "a batch of 3 sequences does not divide into microbatches=2"),
        ((torch.zeros(2, 9, dtype=torch.long),) * 2, r"length 9 exceeds the longest of lengths=\[4, 8\]"),
        ((ids + 10, ids), "got id 10, outside its vocabulary 0..9"),
        ((ids, ids.float()), "targets of dtype torch.float32 must be integer class indices"),
        ((ids, ids - 2), r"targets hold -2, outside the output head's classes 0..5"),
        ((ids, ids + 6), "targets hold 6"),
    ]
    for (x, t), message in cases:
        problem = rules.problem(x, t)
        assert isinstance(problem, InputError) and re.search(message, str(problem)), (message, problem)
    # padding in the targets is no class
    assert rules.problem(ids, torch.full((4, 3), IGNORE_INDEX)) is None


def test_padding_to_a_bucket_or_to_the_first_batch_length() -> None:
    buckets = Batches(microbatches=1, lengths=(4, 8), seq_len=None)
    ids, targets = buckets.padded(torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long))
    assert ids.shape == targets.shape == (2, 8)
    assert ids[:, 5:].eq(0).all() and targets[:, 5:].eq(IGNORE_INDEX).all() and ids[:, :5].eq(1).all()
    assert buckets.padded_length(4) == 4 and buckets.padded_length(1) == 4 and buckets.seq_len is None
    fixed = Batches(microbatches=1, lengths=(), seq_len=None)
    assert fixed.padded_length(7) == 7  # nothing fixed yet
    fixed.padded(torch.ones(1, 6, dtype=torch.long), torch.ones(1, 6, dtype=torch.long))
    assert fixed.seq_len == 6 and fixed.padded_length(3) == 6
    with pytest.raises(InputError, match="length 7 exceeds the pipeline's sequence length 6"):
        fixed.padded_length(7)
