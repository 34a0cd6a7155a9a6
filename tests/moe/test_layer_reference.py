"""MoELayer's output and every gradient equal the naive reference's, for every router,
with and without capacity, every activation, with and without expert biases."""

from __future__ import annotations

import pytest
import torch

from sparta.moe import ACTIVATIONS, ROUTERS, MoELayer
from tests.moe.moe_reference import reference_forward

D_MODEL, D_FF, EXPERTS = 16, 32, 8
CASES = [
    (router, capacity, activation, False)
    for router in ROUTERS
    for capacity in (None, 1.25)
    for activation in ACTIVATIONS
    if not (router == "soft" and capacity is not None)
] + [
    (router, capacity, activation, True)
    for router in ROUTERS
    for capacity in (None, 1.25)
    for activation in ("gelu", "swiglu")
    if not (router == "soft" and capacity is not None)
]


def _layer(router: str, capacity: float | None, activation: str, bias: bool = False) -> MoELayer:
    layer = MoELayer(
        D_MODEL,
        D_FF,
        EXPERTS,
        top_k=1 if router == "switch" else 2,
        router=router,
        capacity_factor=capacity,
        activation=activation,
        aux_loss_coef=0.1,
        z_loss_coef=0.01,
        expert_bias=bias,
        slots_per_expert=2,
    )
    if router == "sigmoid":
        with torch.no_grad():
            layer.router.expert_bias.copy_(torch.randn(EXPERTS) * 0.1)
    return layer.train()


@pytest.mark.parametrize(("router", "capacity", "activation", "bias"), CASES)
def test_output_and_gradients_match_reference(router: str, capacity: float | None, activation: str, bias: bool) -> None:
    layer = _layer(router, capacity, activation, bias)
    # Shifted input with 3 sequences of 11 tokens: routing is uneven enough that a capacity
    # of 1.25 drops pairs, and Soft MoE sees several sequences.
    x = (torch.randn(3, 11, D_MODEL) + 0.5).requires_grad_()
    upstream = torch.randn(3, 11, D_MODEL)
    params = dict(layer.named_parameters())

    y_ref, aux_ref = reference_forward(layer, x)
    ref_grads = torch.autograd.grad((y_ref * upstream).sum() + aux_ref, [x, *params.values()], allow_unused=True)

    y = layer(x)
    grads = torch.autograd.grad((y * upstream).sum(), [x, *params.values()], allow_unused=True)

    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.aux_loss, aux_ref.detach(), atol=1e-6, rtol=1e-5)
    for name, got, want in zip(["input", *params], grads, ref_grads, strict=True):
        want = torch.zeros_like(got) if want is None else want
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    if capacity is not None and router in ("topk", "switch", "xmoe", "sigmoid"):
        assert layer.last_stats.tokens_dropped > 0, "the capacity case must actually drop pairs"


@pytest.mark.parametrize("router", ROUTERS)
def test_any_leading_dims_keep_shape_including_no_tokens(router: str) -> None:
    layer = MoELayer(D_MODEL, D_FF, EXPERTS, router=router, top_k=1 if router == "switch" else 2).train()
    for shape in [(5, D_MODEL), (2, 3, D_MODEL), (2, 2, 2, D_MODEL), (0, D_MODEL), (2, 0, D_MODEL)]:
        x = torch.randn(shape, requires_grad=True)
        y = layer(x)
        assert y.shape == shape
        y.sum().backward()
        assert x.grad.shape == shape


def test_input_without_grad_gives_same_parameter_gradients() -> None:
    layer = MoELayer(D_MODEL, D_FF, EXPERTS, activation="swiglu").train()
    x = torch.randn(12, D_MODEL)
    grads = []
    for requires_grad in (True, False):
        layer.zero_grad()
        (layer(x.clone().requires_grad_(requires_grad)) ** 2).sum().backward()
        grads.append([p.grad.clone() for p in layer.parameters()])
    for with_x, without_x in zip(*grads, strict=True):
        torch.testing.assert_close(with_x, without_x)


def test_bfloat16_layer() -> None:
    layer = MoELayer(D_MODEL, D_FF, EXPERTS)
    x = torch.randn(10, D_MODEL)
    y32 = layer(x)
    y16 = layer.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), y32, atol=5e-2, rtol=5e-2)


def test_backward_twice_with_retain_graph_accumulates() -> None:
    """``backward(retain_graph=True)`` twice adds the same gradients twice, and
    ``torch.autograd.grad`` (what zero-bubble pipeline schedules call) leaves ``.grad`` alone."""
    layer = _layer("topk", 1.25, "swiglu", bias=True)
    x = torch.randn(24, D_MODEL, requires_grad=True)
    y = layer(x)
    y.square().sum().backward(retain_graph=True)
    once = {n: p.grad.clone() for n, p in layer.named_parameters()}
    y.square().sum().backward()
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[name], msg=name)
    grads = torch.autograd.grad(layer(x).square().sum(), list(layer.parameters()))
    for (name, p), g in zip(layer.named_parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, 2 * once[name], msg=name)
        torch.testing.assert_close(g, once[name], msg=name)
