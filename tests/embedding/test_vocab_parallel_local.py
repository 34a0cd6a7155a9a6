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


def test_padding_targets_are_ignored_as_cross_entropy_ignores_them() -> None:
    """Targets of ignore_index (-100, the usual padding label) add no loss and no gradient,
    and the head's mean is over the other tokens, as F.cross_entropy's."""
    from sparta.embedding import VocabParallelHead

    world = sparta.init(backend="torch")
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 5, 8, generator=gen)
    targets = torch.randint(0, 40, (2, 5), generator=gen)
    targets[0, :2] = -100
    head = VocabParallelHead(8, 40, world.comm)
    weight = head.weight.detach().clone().requires_grad_()
    h, ref_h = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    loss = head(h, targets)
    loss.backward()
    want = F.cross_entropy((ref_h @ weight.t()).flatten(0, 1), targets.flatten())
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(h.grad, ref_h.grad)
    torch.testing.assert_close(head.weight.grad, weight.grad)
    assert not h.grad[0, :2].any()  # the padded tokens: no gradient
    logits = torch.randn(6, 40, generator=gen, requires_grad=True)
    ids = torch.tensor([3, -100, 7, -100, 0, 39])
    losses = vocab_parallel_cross_entropy(logits, ids, 0, world.comm)
    torch.testing.assert_close(losses, F.cross_entropy(logits.detach(), ids, reduction="none"))
    losses.sum().backward()
    assert not logits.grad[[1, 3]].any()
    # a rank whose targets are all padding (a tail micro-batch): 0 with zero gradients, where
    # F.cross_entropy's NaN would be summed into every rank's weights
    head.weight.grad = None
    hidden_all = hidden.clone().requires_grad_()
    empty = head(hidden_all, torch.full((2, 5), -100))
    empty.backward()
    assert empty.item() == 0.0 and head.weight.grad is not None and hidden_all.grad is not None
    assert not head.weight.grad.any() and not hidden_all.grad.any()


def test_float64_logits_keep_float64() -> None:
    world = sparta.init(backend="torch")
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 30, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 30, (5,), generator=gen)
    losses = vocab_parallel_cross_entropy(logits, targets, 0, world.comm)
    losses.sum().backward()
    full = logits.detach().clone().requires_grad_()
    F.cross_entropy(full, targets, reduction="sum").backward()
    assert losses.dtype == torch.float64 and logits.grad is not None and logits.grad.dtype == torch.float64
    torch.testing.assert_close(losses, F.cross_entropy(full.detach(), targets, reduction="none"), atol=1e-12, rtol=0)
    torch.testing.assert_close(logits.grad, full.grad, atol=1e-12, rtol=0)
