"""Sort-based dispatch and combine: grouping, capacity, gradients."""

from __future__ import annotations

import torch

from sparta.moe import combine, dispatch, expert_capacity
from sparta.moe.dispatch import soft_combine, soft_dispatch


def test_rows_grouped_by_expert_in_pair_order() -> None:
    x = torch.arange(5.0).unsqueeze(1).repeat(1, 3)  # row t is all t
    token_idx = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    expert_idx = torch.tensor([2, 0, 0, 1, 2, 0, 1, 2, 0, 2])
    weight = torch.rand(10)
    out = dispatch(x, token_idx, expert_idx, weight, num_experts=4)
    assert out.counts.tolist() == [4, 2, 4, 0]
    assert out.token_idx.tolist() == [0, 1, 2, 4, 1, 3, 0, 2, 3, 4]
    assert out.rows[:, 0].tolist() == [0, 1, 2, 4, 1, 3, 0, 2, 3, 4]
    assert out.dropped == 0
    # send_splits for 2 expert-parallel ranks of 2 experts each: rows are already grouped.
    assert out.counts.view(2, 2).sum(1).tolist() == [6, 4]


def test_capacity_keeps_highest_weights_and_counts_drops() -> None:
    x = torch.randn(6, 4)
    token_idx = torch.arange(6)
    expert_idx = torch.tensor([0, 0, 0, 0, 1, 0])
    weight = torch.tensor([0.1, 0.9, 0.5, 0.7, 0.2, 0.3])
    out = dispatch(x, token_idx, expert_idx, weight, num_experts=2, capacity=2)
    assert out.counts.tolist() == [2, 1]
    assert out.routed.tolist() == [5, 1]
    assert out.dropped == 3
    assert out.token_idx.tolist() == [1, 3, 4]  # expert 0 keeps weights 0.9, 0.7
    y = combine(out.rows, out, num_tokens=6)
    assert torch.equal(y[[0, 2, 5]], torch.zeros(3, 4))  # dropped tokens contribute zeros
    torch.testing.assert_close(y[1], 0.9 * x[1])


def test_expert_capacity_rounds_up() -> None:
    assert expert_capacity(num_tokens=10, top_k=2, num_experts=8, capacity_factor=1.25) == 4
    # exact where the product is whole: 1.1 * 100 * 2 / 4 is 55 (in floats 55.00000000000001)
    assert expert_capacity(num_tokens=100, top_k=2, num_experts=4, capacity_factor=1.1) == 55
    assert expert_capacity(num_tokens=16, top_k=1, num_experts=4, capacity_factor=1.0) == 4


def test_dispatch_combine_round_trip_and_gradients() -> None:
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    w = torch.rand(14, dtype=torch.float64, requires_grad=True)
    token_idx = torch.arange(7).repeat_interleave(2)
    expert_idx = torch.randint(0, 3, (14,))

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = dispatch(x, token_idx, expert_idx, w, num_experts=3, capacity=4)
        return combine(out.rows * 2.0, out, num_tokens=7)

    assert torch.autograd.gradcheck(run, (x, w))
    # Dropless identity experts with weights summing to 1 per token give x back.
    half = torch.full((14,), 0.5, dtype=torch.float64)
    out = dispatch(x, token_idx, expert_idx, half, num_experts=3)
    torch.testing.assert_close(combine(out.rows, out, 7), x)


def test_token_major_pairs_gather_both_ways_as_the_index_add_path() -> None:
    """k pairs a token, dropless: the plan is a permutation, gathered forward and backward
    (no index-add); the rows, outputs and gradients are those of the general path."""
    token_idx = torch.arange(7).repeat_interleave(2)
    expert_idx = torch.randint(0, 3, (14,), generator=torch.Generator().manual_seed(0))

    def run(x: torch.Tensor, w: torch.Tensor, k: int | None) -> torch.Tensor:
        out = dispatch(x, token_idx, expert_idx, w, num_experts=3, pairs_per_token=k)
        assert (out.inverse is not None) == (k is not None)
        return combine(out.rows.sin(), out, num_tokens=7)

    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    w = torch.rand(14, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: run(x, w, 2), (x, w))
    fast = torch.autograd.grad(run(x, w, 2).square().sum(), (x, w))
    general = torch.autograd.grad(run(x, w, None).square().sum(), (x, w))
    torch.testing.assert_close(run(x, w, 2), run(x, w, None))
    for a, b in zip(fast, general, strict=True):
        torch.testing.assert_close(a, b)
    plan = dispatch(x, token_idx, expert_idx, w, num_experts=3, pairs_per_token=2)
    assert torch.equal(plan.order[plan.inverse], torch.arange(14))
    assert torch.equal(plan.token_idx, plan.order // 2)
    # a capacity drops pairs: no permutation, the general path
    assert dispatch(x, token_idx, expert_idx, w, num_experts=3, capacity=4, pairs_per_token=2).inverse is None


def test_soft_dispatch_groups_slots_by_expert() -> None:
    groups, length, experts, per_expert, d = 2, 5, 3, 2, 4
    x = torch.randn(groups, length, d)
    weights = torch.rand(groups, length, experts * per_expert).softmax(dim=1)
    out = soft_dispatch(x, weights, experts)
    assert out.counts.tolist() == [groups * per_expert] * experts
    slots = torch.einsum("gls,gld->gsd", weights, x)
    # Expert 1's rows: slots 2, 3 of sequence 0, then of sequence 1.
    torch.testing.assert_close(out.rows[4:8], torch.cat([slots[0, 2:4], slots[1, 2:4]]))
    y = soft_combine(out.rows, weights, experts)
    torch.testing.assert_close(y, torch.einsum("gls,gsd->gld", weights, slots))
