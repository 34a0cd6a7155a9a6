"""Each router's defining property, checked on the router alone or through the layer."""

from __future__ import annotations

import math

import pytest
import torch

from sparta.moe import (
    ExpertChoiceRouter,
    MoELayer,
    SigmoidRouter,
    SoftRouter,
    SwitchRouter,
    TopKRouter,
    XMoERouter,
)


def test_topk_picks_k_distinct_experts_with_weights_summing_to_one() -> None:
    router = TopKRouter(d_model=8, num_experts=6, top_k=3)
    out = router(torch.randn(20, 8))
    assert out.expert_ids.shape == (20, 3)
    assert all(len(set(row)) == 3 for row in out.expert_ids.tolist())
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(20))
    # The chosen experts are the most probable ones.
    kth_best = out.probs.sort(dim=-1, descending=True).values[:, 2]
    assert (out.probs.gather(1, out.expert_ids) >= kth_best.unsqueeze(1)).all()
    assert out.token_idx.tolist() == [t for t in range(20) for _ in range(3)]


def test_topk_jitter_only_in_training() -> None:
    router = TopKRouter(d_model=8, num_experts=4, top_k=2, jitter_eps=0.5)
    x = torch.randn(10, 8)
    router.eval()
    torch.testing.assert_close(router(x).logits, router(x).logits)
    router.train()
    assert not torch.equal(router(x).logits, router(x).logits)


def test_switch_routes_each_token_to_exactly_one_expert() -> None:
    router = SwitchRouter(d_model=8, num_experts=4)
    out = router(torch.randn(15, 8))
    assert out.expert_ids.shape == (15, 1)
    assert out.token_idx.tolist() == list(range(15))
    # Weight is the raw top-1 probability (not renormalised to 1), so the router learns.
    torch.testing.assert_close(out.weight, out.probs.max(dim=-1).values)
    assert (out.weight < 1).all()


@pytest.mark.parametrize("capacity_factor", [None, 1.25, 0.5])
def test_expert_choice_gives_each_expert_exactly_c_tokens(capacity_factor: float | None) -> None:
    tokens, experts, k = 24, 4, 2
    router = ExpertChoiceRouter(d_model=8, num_experts=experts, top_k=k, capacity_factor=capacity_factor)
    out = router(torch.randn(tokens, 8))
    expected = math.ceil((capacity_factor or 1.0) * tokens * k / experts)
    assert torch.bincount(out.expert_idx, minlength=experts).tolist() == [expected] * experts
    for e in range(experts):
        picked = out.token_idx[out.expert_idx == e]
        assert len(set(picked.tolist())) == expected  # distinct tokens
        # ... and they are the expert's top tokens by probability.
        top = out.probs[:, e].topk(expected).indices
        assert set(picked.tolist()) == set(top.tolist())
    # A token may be picked by any number of experts, including none.
    per_token = torch.bincount(out.token_idx, minlength=tokens)
    assert per_token.sum() == expected * experts


def test_expert_choice_capacity_is_capped_by_tokens() -> None:
    router = ExpertChoiceRouter(d_model=8, num_experts=2, top_k=2, capacity_factor=4.0)
    out = router(torch.randn(5, 8))
    assert torch.bincount(out.expert_idx).tolist() == [5, 5]


def test_sigmoid_bias_selects_but_does_not_weigh() -> None:
    router = SigmoidRouter(d_model=8, num_experts=4, top_k=2)
    x = torch.randn(12, 8)
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([100.0, 100.0, 0.0, 0.0]))
    out = router(x)
    assert (out.expert_ids.sort(dim=-1).values == torch.tensor([0, 1])).all()
    scores = torch.sigmoid(out.logits[:, :2])
    expected = (scores / scores.sum(-1, keepdim=True)).sort(dim=-1).values
    torch.testing.assert_close(out.weights.sort(dim=-1).values, expected)


def test_sigmoid_bias_moves_load_toward_balance() -> None:
    layer = MoELayer(8, 16, 4, top_k=1, router="sigmoid", bias_update_rate=0.01, aux_loss_coef=0.0).train()
    with torch.no_grad():
        layer.router.gate.weight[0] += 1.0  # expert 0 wins on inputs shifted along ones
    x = torch.randn(256, 8) + 0.5

    def imbalance() -> float:
        load = torch.tensor(layer.last_stats.routed_per_expert, dtype=torch.float)
        return float(load.max() / load.mean())

    layer(x)
    first = imbalance()
    assert first > 3.0  # skewed: nearly all tokens on expert 0
    for _ in range(40):
        layer(x)
    assert imbalance() < 1.2 < first
    assert layer.router.expert_bias[0] < 0 < layer.router.expert_bias[1:].min()


def test_sigmoid_bias_stays_float32_in_a_bfloat16_model() -> None:
    layer = MoELayer(8, 16, 4, router="sigmoid", bias_update_rate=1e-3).to(torch.bfloat16).train()
    with torch.no_grad():
        layer.router.expert_bias.fill_(0.5)
    layer(torch.randn(16, 8, dtype=torch.bfloat16))
    bias = layer.router.expert_bias
    assert bias.dtype == torch.float32
    moved = (bias - 0.5).abs()
    assert ((moved - 1e-3).abs() < 1e-6).any()  # a 1e-3 step survives (bfloat16 would round it off)
    assert (((moved - 1e-3).abs() < 1e-6) | (moved == 0)).all()


def test_sigmoid_bias_frozen_in_eval() -> None:
    layer = MoELayer(8, 16, 4, router="sigmoid", bias_update_rate=0.05).eval()
    layer(torch.randn(16, 8))
    assert torch.equal(layer.router.expert_bias, torch.zeros(4))


def test_xmoe_logits_are_cosines_over_temperature() -> None:
    router = XMoERouter(d_model=8, num_experts=4, top_k=2, routing_dim=3)
    out = router(torch.randn(30, 8) * 100)
    bound = 1.0 / router.temperature.item()
    assert out.logits.abs().max() <= bound * (1 + 1e-5)
    assert router.proj.weight.shape == (3, 8)
    assert router.expert_embeddings.shape == (4, 3)


def test_soft_dispatch_weights_are_convex_combinations() -> None:
    router = SoftRouter(d_model=8, num_experts=3, slots_per_expert=2)
    out = router(torch.randn(4, 10, 8))
    dispatch, combine = out.dispatch_weights, out.combine_weights
    assert dispatch.shape == combine.shape == (4, 10, 6)
    assert (dispatch >= 0).all() and (combine >= 0).all()
    torch.testing.assert_close(dispatch.sum(dim=1), torch.ones(4, 6))  # per slot, over tokens
    torch.testing.assert_close(combine.sum(dim=2), torch.ones(4, 10))  # per token, over slots


def test_soft_layer_is_not_causal_but_keeps_sequences_apart() -> None:
    layer = MoELayer(8, 16, 2, router="soft").eval()
    x = torch.randn(2, 6, 8)
    y = layer(x)
    changed = x.clone()
    changed[0, -1] += 1.0  # the last token of sequence 0
    y2 = layer(changed)
    assert not torch.allclose(y[0, 0], y2[0, 0])  # earlier tokens see later ones
    torch.testing.assert_close(y[1], y2[1])  # the other sequence does not
    assert layer.last_stats.tokens_dropped == 0


@pytest.mark.parametrize("router", ["topk", "sigmoid", "xmoe", "expert_choice", "soft"])
def test_non_finite_input_propagates_without_a_host_check(router: str) -> None:
    """As in any torch layer, NaN in gives NaN out (no check that waits for the device)."""
    layer = MoELayer(8, 16, 4, router=router, name="blocks.3.mlp")
    x = torch.randn(2, 5, 8)
    x[0, 1, 2] = float("nan")
    assert torch.isnan(layer(x)).any()
