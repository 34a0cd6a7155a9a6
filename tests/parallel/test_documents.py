"""The documents data path of `sparta train` (sparta/parallel/documents.py), one process:
pieces cut at the end-of-text token with one token of overlap, steps of one shape padded to a
bucket, the same batches for the same seed, each step's tokens counted, bad runs refused."""

from __future__ import annotations

import pytest
import torch

from sparta.errors import ConfigError
from sparta.parallel import DecoderConfig, ParallelConfig
from sparta.parallel.config import DataConfig, RunConfig, TrainConfig
from sparta.parallel.data import random_tokens
from sparta.parallel.documents import DocumentBatches, document_pieces
from sparta.scheduling import IGNORE_INDEX, LengthCost


def test_pieces_end_at_end_of_text_and_overlap_by_one_token() -> None:
    tokens = torch.tensor([5, 6, 0, 7, 8, 9, 10, 11, 0, 3])
    starts, ends = document_pieces(tokens, seq_len=3)
    # [5 6 0] | [7 8 9 10] [10 11 0] | [3] alone has no target: dropped
    assert list(zip(starts.tolist(), ends.tolist(), strict=True)) == [(0, 3), (3, 7), (6, 9)]


def _batches(seed: int = 1, dp: int = 2) -> DocumentBatches:
    tokens = random_tokens(30_000, 64, seed=3)  # documents end at token 0: one in 64
    cost = LengthCost.of_flops(10_000, 2, 32)
    return DocumentBatches(tokens, 16, seed, (4, 8, 16), 16, dp, 2, 2, cost)


def test_steps_are_buckets_of_whole_pieces_and_the_same_for_a_seed() -> None:
    batches, again = _batches(), _batches()
    lengths, total = set(), 0
    for step in range(6):
        for rank in range(2):
            ids, targets = batches.train_batch(step, 16, rank, 2)
            assert ids.shape == targets.shape and ids.shape[1] in (4, 8, 16) and ids.shape[0] % 2 == 0
            assert ids.shape[0] * ids.shape[1] <= 2 * batches.max_tokens  # two micro-batches, each within
            real = targets != IGNORE_INDEX
            # each row: real targets first, then padding; a target is the next input
            assert torch.equal(real, real.cummin(dim=1).values)
            assert torch.equal(ids[:, 1:][real[:, 1:]], targets[:, :-1][real[:, 1:]])
            assert all(real[k::2].any() for k in range(2)), "a micro-batch without a real token"
            again_ids, _ = again.train_batch(step, 16, rank, 2)
            assert torch.equal(ids, again_ids)
            lengths.add(ids.shape[1])
            total += int(real.sum())
        assert batches.tokens_of(step) == total
        total = 0
    assert len(lengths) > 1, "the pieces' lengths never left one bucket"
    assert not torch.equal(_batches(seed=2).train_batch(0, 16, 0, 2)[0], batches.train_batch(0, 16, 0, 2)[0])
    ids, targets = batches.val_batch(1, 3, 16, 1, 2)
    assert ids.shape[0] == 8 and ids.shape[1] <= 16 and (targets != IGNORE_INDEX).any()
    with pytest.raises(ConfigError, match="global_batch=16, dp=2"):
        batches.train_batch(0, 16, 0, 1)


def test_a_micro_batch_of_one_row_takes_a_bucket_past_seq_len() -> None:
    """One row a micro-batch (global_batch = dp x microbatches) and no bucket at seq_len: a
    whole piece pads to the next bucket, which the budget must hold (it had been seq_len
    tokens, less than one such row, and every step raised)."""
    tokens = random_tokens(30_000, 64, seed=3)
    batches = DocumentBatches(tokens, 16, 1, (8, 24, 32), 4, 2, 2, 1, LengthCost.of_flops(10_000, 2, 32))
    assert batches.buckets == (8, 24) and batches.max_tokens == 24
    for step in range(4):
        ids, _ = batches.train_batch(step, 4, 0, 2)
        assert ids.shape[0] == 2 and ids.shape[1] in (8, 24), ids.shape


def test_runs_on_documents_are_refused_without_lengths_that_hold_seq_len() -> None:
    model = DecoderConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=32)
    data = DataConfig(source="random", samples="documents")
    with pytest.raises(ConfigError, match=r"parallel\.lengths, which is empty: set it, e\.g\. .*\[4, 8, 16\]"):
        RunConfig(model=model, data=data, train=TrainConfig(global_batch=4))
    with pytest.raises(ConfigError, match=r"lengths=\[4, 8\]: the longest must hold model\.seq_len=16"):
        RunConfig(model=model, data=data, parallel=ParallelConfig(lengths=(4, 8)), train=TrainConfig(global_batch=4))
    with pytest.raises(ConfigError, match=r"lengths=\[8, 16, 32\]: \[32\] exceed model\.seq_len=16"):
        RunConfig(
            model=model, data=data, parallel=ParallelConfig(lengths=(8, 16, 32)), train=TrainConfig(global_batch=4)
        )
    with pytest.raises(ConfigError, match=r"buckets=\[4, 8\]: none holds a whole piece of seq_len=16"):
        DocumentBatches(random_tokens(1000, 64, seed=3), 16, 1, (4, 8), 4, 2, 2, 1, LengthCost.of_flops(1, 2, 32))
    with pytest.raises(ConfigError, match=r"data\.samples='lines' is unknown"):
        DataConfig(samples="lines")
