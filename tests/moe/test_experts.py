"""GroupedExperts: kernels agree, empty experts, initialisation."""

from __future__ import annotations

import math

import pytest
import torch

from sparta.moe import GroupedExperts, MoELayer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["gelu", "relu", "swiglu"])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [4, 4, 4, 4], [0, 0, 0, 0]])
def test_grouped_mm_equals_loop(activation: str, counts: list[int], bias: bool) -> None:
    fast = GroupedExperts(4, 8, 12, activation=activation, gemm="grouped_mm", bias=bias)
    slow = GroupedExperts(4, 8, 12, activation=activation, gemm="loop", bias=bias)
    slow.load_state_dict(fast.state_dict())
    rows = torch.randn(sum(counts), 8, requires_grad=True)
    count_tensor = torch.tensor(counts)
    outs, grads = [], []
    for experts in (fast, slow):
        out = experts(rows, count_tensor, counts)
        out.sum().backward()  # a broadcast gradient, which grouped_mm alone rejects
        outs.append(out)
        grads.append([rows.grad.clone(), *(p.grad.clone() for p in experts.parameters())])
        rows.grad = None
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for fast_grad, slow_grad in zip(*grads, strict=True):
        torch.testing.assert_close(fast_grad, slow_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gemm", ["grouped_mm", "loop"])
@pytest.mark.parametrize(("activation", "bias"), [("gelu", False), ("swiglu", False), ("gelu", True), ("swiglu", True)])
@pytest.mark.parametrize("blocks", [[[3, 0, 2], [1, 4, 0]], [[0, 0, 0], [2, 0, 1], [0, 3, 0]], [[0, 0, 0]]])
def test_blocks_equal_rows_in_expert_order(gemm: str, activation: str, bias: bool, blocks: list[list[int]]) -> None:
    """Rows in per-source blocks give each row the output and gradient it gets in expert
    order, and the weights the same gradients (an expert's rows split over blocks add up)."""
    experts = GroupedExperts(3, 8, 12, activation=activation, gemm=gemm, bias=bias)
    block_counts = torch.tensor(blocks)
    rows = torch.randn(int(block_counts.sum()), 8, requires_grad=True)
    upstream = torch.randn(rows.shape[0], 8)
    experts.forward_blocks(rows, block_counts).backward(upstream)
    got = [rows.grad.clone(), *(p.grad.clone() for p in experts.parameters())]
    out = experts.forward_blocks(rows.detach(), block_counts)
    # The oracle: the same rows sorted by expert through the ordinary forward.
    expert_of_row = torch.arange(3).repeat(len(blocks)).repeat_interleave(block_counts.reshape(-1))
    order = torch.sort(expert_of_row, stable=True).indices
    rows.grad = None
    experts.zero_grad(set_to_none=True)
    counts = block_counts.sum(dim=0)
    expected = experts(rows[order], counts, counts.tolist())
    expected.backward(upstream[order])
    want = [rows.grad, *(p.grad for p in experts.parameters())]
    torch.testing.assert_close(out[order], expected.detach(), atol=1e-5, rtol=1e-5)
    for got_grad, want_grad in zip(got, want, strict=True):
        torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gemm", ["grouped_mm", "loop"])
def test_expert_without_tokens_gets_zero_gradient(gemm: str) -> None:
    experts = GroupedExperts(3, 8, 16, activation="swiglu", gemm=gemm)
    counts = [4, 0, 2]
    experts(torch.randn(6, 8), torch.tensor(counts), counts).square().sum().backward()
    for weight in (experts.w1, experts.w2, experts.w3):
        assert torch.equal(weight.grad[1], torch.zeros_like(weight.grad[1]))
        assert weight.grad[0].abs().sum() > 0


@pytest.mark.parametrize("gemm", ["auto", "loop"])
def test_layer_expert_without_tokens_gets_zero_gradient(gemm: str) -> None:
    layer = MoELayer(8, 16, 4, top_k=2, expert_gemm=gemm).train()
    with torch.no_grad():
        layer.router.gate.weight[3] = -10.0  # positive inputs never pick expert 3
    x = torch.rand(20, 8) + 0.1
    layer(x).sum().backward()
    assert layer.last_stats.tokens_per_expert[3] == 0
    assert torch.equal(layer.experts.w1.grad[3], torch.zeros(8, 16))
    assert torch.equal(layer.experts.w2.grad[3], torch.zeros(16, 8))
    assert layer.experts.w1.grad[:3].abs().sum() > 0


def test_init_like_linear_and_deterministic() -> None:
    torch.manual_seed(7)
    a = GroupedExperts(4, 64, 256)
    torch.manual_seed(7)
    b = GroupedExperts(4, 64, 256)
    assert torch.equal(a.w1, b.w1) and torch.equal(a.w2, b.w2)
    # nn.Linear(fan_in, fan_out) draws U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    for weight, fan_in in ((a.w1, 64), (a.w2, 256)):
        bound = 1 / math.sqrt(fan_in)
        assert weight.abs().max() <= bound
        assert weight.abs().max() > 0.99 * bound
        torch.testing.assert_close(weight.std(), torch.tensor(bound / math.sqrt(3)), rtol=0.02, atol=0)
    assert not torch.equal(a.w1[0], a.w1[1])


def test_init_independent_of_expert_parallel_layout() -> None:
    torch.manual_seed(3)
    whole = GroupedExperts(4, 8, 16, activation="swiglu")
    torch.manual_seed(3)
    second_half = GroupedExperts(2, 8, 16, activation="swiglu", first_expert=2)
    for name in ("w1", "w2", "w3"):
        assert torch.equal(getattr(whole, name)[2:], getattr(second_half, name))


def test_bfloat16_rows_run_on_grouped_mm() -> None:
    experts = GroupedExperts(2, 8, 16, gemm="grouped_mm").to(torch.bfloat16)
    reference = GroupedExperts(2, 8, 16, gemm="loop").to(torch.bfloat16)
    reference.load_state_dict(experts.state_dict())
    rows = torch.randn(5, 8, dtype=torch.bfloat16)
    out = experts(rows, torch.tensor([2, 3]), [2, 3])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(rows, torch.tensor([2, 3]), [2, 3]), atol=2e-2, rtol=2e-2)


def test_pre_activation_blocks_are_released_after_their_last_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    from sparta.moe import expert_loop as experts_module

    # Blocks of at least 3 rows of width 2 (24 bytes): segments [2, 0, 2, 1, 4] form blocks
    # {0, 1, 2} (4 rows), {3, 4} (5 rows).
    monkeypatch.setattr(experts_module, "_RELEASABLE_BYTES", 3 * 2 * 4)
    segments = experts_module.consecutive_segments([2, 0, 2, 1, 4])
    pre = experts_module.PreActivations(segments, 2, torch.empty(0))
    for i, (_, start, end) in enumerate(segments):
        pre.segment(i).copy_(torch.arange(start, end).float()[:, None].expand(-1, 2))
    assert [b.shape[0] for b in pre._blocks if b is not None] == [4, 5]
    for i, (_, start, end) in enumerate(segments):
        rows = pre.take(i)
        assert torch.equal(rows[:, 0], torch.arange(start, end).float())
        assert [b is None for b in pre._blocks] == [i >= 2, i >= 4]
