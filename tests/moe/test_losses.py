"""Aux and z losses: their formulas on hand-computed cases, and their path to the gradient."""

from __future__ import annotations

import copy

import torch

from sparta.moe import MoELayer, TopKRouter
from sparta.moe.routers import load_balancing_loss, router_z_loss


def _identity_router(num_experts: int, top_k: int) -> TopKRouter:
    router = TopKRouter(d_model=num_experts, num_experts=num_experts, top_k=top_k)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(num_experts))  # logits == input
    return router


def test_top1_losses_by_hand() -> None:
    # logits [[1, 0], [2, 0]]: probs [e/(e+1), 1/(e+1)] = [0.7310586, 0.2689414] and
    # [e^2/(e^2+1), 1/(e^2+1)] = [0.8807971, 0.1192029]; both tokens pick expert 0, so
    # f = [1, 0], P_0 = (0.7310586 + 0.8807971) / 2 = 0.8059278, aux = 2 * 1 * P_0.
    # z = mean(log(1+e)^2, log(1+e^2)^2) = mean(1.3132617^2, 2.1269280^2).
    out = _identity_router(2, 1)(torch.tensor([[1.0, 0.0], [2.0, 0.0]]))
    assert out.expert_idx.tolist() == [0, 0]
    torch.testing.assert_close(out.aux_loss, torch.tensor(1.6118557))
    torch.testing.assert_close(out.z_loss, torch.tensor(3.1242395))


def test_top2_losses_by_hand() -> None:
    # logits [[2, 1, 0], [0, 0.5, 3]]: token 0 picks experts {0, 1}, token 1 picks {2, 1}, so
    # f = [1, 2, 1] / 4. probs = [[0.6652410, 0.2447285, 0.0900306],
    # [0.0439865, 0.0725214, 0.8834921]], P = [0.3546137, 0.1586250, 0.4867613];
    # aux = 3 * (0.25 * 0.3546137 + 0.5 * 0.1586250 + 0.25 * 0.4867613) = 0.8689687.
    # logsumexp = [2.4076060, 3.1238730]; z = (2.4076060^2 + 3.1238730^2) / 2 = 7.7775744.
    out = _identity_router(3, 2)(torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.5, 3.0]]))
    assert sorted(out.expert_ids[0].tolist()) == [0, 1]
    assert sorted(out.expert_ids[1].tolist()) == [1, 2]
    torch.testing.assert_close(out.aux_loss, torch.tensor(0.8689687))
    torch.testing.assert_close(out.z_loss, torch.tensor(7.7775744))
    # Token-0 weights renormalised over its two experts: 0.6652410 / 0.9099695.
    torch.testing.assert_close(out.weights[0, 0], torch.tensor(0.7310586))


def test_balance_loss_is_one_when_uniform() -> None:
    probs = torch.full((8, 4), 0.25)
    expert_idx = torch.arange(4).repeat(4)
    torch.testing.assert_close(load_balancing_loss(probs, expert_idx, 4), torch.tensor(1.0))
    torch.testing.assert_close(router_z_loss(torch.zeros(3, 4)), torch.log(torch.tensor(4.0)) ** 2)


def _gate_grad(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    layer.zero_grad()
    (layer(x) * 0).sum().backward()  # the user's loss carries no task gradient at all
    return layer.router.gate.weight.grad.clone()


def test_aux_loss_reaches_router_gradient_without_user_adding_it() -> None:
    layer = MoELayer(8, 16, 4, aux_loss_coef=0.5, z_loss_coef=0.25).train()
    x = torch.randn(32, 8)
    got = _gate_grad(layer, x)

    out = layer.router(x)
    expected = torch.autograd.grad(0.5 * out.aux_loss + 0.25 * out.z_loss, layer.router.gate.weight)[0]
    assert got.abs().max() > 1e-4
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(layer.aux_loss, (0.5 * out.aux_loss + 0.25 * out.z_loss).detach())
    assert not layer.aux_loss.requires_grad


def test_aux_loss_not_applied_in_eval_or_with_zero_coefficients() -> None:
    x = torch.randn(32, 8)
    layer = MoELayer(8, 16, 4).eval()
    assert torch.equal(_gate_grad(layer, x), torch.zeros(4, 8))
    layer = MoELayer(8, 16, 4, aux_loss_coef=0.0, z_loss_coef=0.0).train()
    assert torch.equal(_gate_grad(layer, x), torch.zeros(4, 8))


def test_aux_loss_follows_the_scale_the_loss_is_back_propagated_with() -> None:
    """A loss scaled by s (GradScaler, accumulation over 1/s) scales every gradient by s,
    the aux loss's too once aux_loss_scale says s: balancing keeps its weight."""
    x = torch.randn(32, 8)
    layer = MoELayer(8, 16, 4, aux_loss_coef=0.1).train()
    scaled = copy.deepcopy(layer)
    scaled.aux_loss_scale = 1000.0
    layer(x).sum().backward()
    (1000.0 * scaled(x).sum()).backward()
    for (name, p), q in zip(layer.named_parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, 1000.0 * p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_output_can_be_modified_in_place() -> None:
    """A residual written into the output in place trains as the out-of-place sum does."""
    layer = MoELayer(8, 16, 4).train()
    twin = copy.deepcopy(layer)
    x = torch.randn(6, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y = layer(x)
    y += x  # must not trip autograd
    (y * torch.arange(8.0)).sum().backward()
    (((twin(x2) + x2)) * torch.arange(8.0)).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    for (name, p), q in zip(layer.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
