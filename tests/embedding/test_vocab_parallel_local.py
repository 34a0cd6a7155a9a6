"""vocab_parallel_cross_entropy in one process (a world of one): half-precision logits give
float32 statistics, so a large vocabulary neither overflows nor rounds (the ranks' own
checks are tests/dist/embedding_checks.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sparta
from sparta.embedding import vocab_parallel_cross_entropy


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_half_precision_logits_over_a_large_vocabulary(dtype: torch.dtype) -> None:
    world = sparta.init(backend="torch")
    vocab = 131_072  # fp16's sum of exponentials over it overflowed: an infinite loss
    logits = (torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 0.01).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (4,), generator=torch.Generator().manual_seed(1))
    losses = vocab_parallel_cross_entropy(logits, targets, 0, world.comm)
    losses.sum().backward()
    full = logits.detach().float().requires_grad_()
    F.cross_entropy(full, targets, reduction="sum").backward()
    assert losses.dtype == torch.float32 and logits.grad is not None and logits.grad.dtype == dtype
    torch.testing.assert_close(losses, F.cross_entropy(full.detach(), targets, reduction="none"), atol=1e-5, rtol=0)
    torch.testing.assert_close(logits.grad.float(), full.grad, atol=1e-5, rtol=0)
