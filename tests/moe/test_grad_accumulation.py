"""Expert weight gradients added straight into an existing ``.grad`` (gradient accumulation)
give what autograd's own accumulation gives, and only where nothing can tell the difference:
``torch.autograd.grad``, ``backward(inputs=...)`` and tensor hooks take the plain path."""

from __future__ import annotations

import copy

import pytest
import torch

import sparta.moe.expert_loop as expert_loop
from sparta.moe import MoELayer

D_MODEL, D_FF, EXPERTS = 8, 12, 4


def _layer(**options: object) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(D_MODEL, D_FF, EXPERTS, expert_gemm="loop", **options).train()


def _seeded(layer: MoELayer) -> dict[str, torch.Tensor]:
    """Give every parameter a ``.grad`` (as after an earlier micro-batch); returns copies."""
    gen = torch.Generator().manual_seed(5)
    for p in layer.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    return {name: p.grad.clone() for name, p in layer.named_parameters()}


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many weights each backward added straight into their ``.grad``."""
    counts: list[int] = []
    real = expert_loop.accumulation_targets

    def spy(params: list[torch.Tensor | None], needed: list[bool]) -> tuple[torch.Tensor | None, ...]:
        targets = real(params, needed)
        counts.append(sum(t is not None for t in targets))
        return targets

    monkeypatch.setattr(expert_loop, "accumulation_targets", spy)
    return counts


@pytest.mark.parametrize(
    "options",
    [
        {"router": "topk", "activation": "gelu"},
        {"router": "topk", "activation": "swiglu", "expert_bias": True, "capacity_factor": 1.0},
        {"router": "expert_choice", "activation": "relu"},
        {"router": "soft", "activation": "gelu", "expert_bias": True},  # rows form
    ],
)
def test_existing_grad_gets_the_same_sum_in_place(options: dict, fused: list[int]) -> None:
    accumulating, plain = _layer(**options), _layer(**options)
    seed = _seeded(accumulating)
    grads_before = {name: p.grad for name, p in accumulating.named_parameters()}
    x = torch.randn(3, 5, D_MODEL)
    up = torch.randn(3, 5, D_MODEL)
    (accumulating(x) * up).sum().backward()
    assert fused == [len(list(accumulating.experts.parameters()))]
    fused.clear()
    (plain(x) * up).sum().backward()
    assert fused == [0]  # no .grad yet: autograd accumulates, as always
    for name, p in accumulating.named_parameters():
        assert p.grad is grads_before[name], f"{name}: .grad replaced instead of added into"
        want = seed[name] + dict(plain.named_parameters())[name].grad
        torch.testing.assert_close(p.grad, want, atol=1e-6, rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_create_graph_takes_the_plain_path(fused: list[int]) -> None:
    layer, plain = _layer(), _layer()
    seed = _seeded(layer)
    x = torch.randn(16, D_MODEL)
    layer(x).square().sum().backward(create_graph=True)
    plain(x).square().sum().backward()
    assert fused == [0, 0]
    torch.testing.assert_close(layer.experts.w1.grad, seed["experts.w1"] + plain.experts.w1.grad)


def test_autograd_grad_and_backward_inputs_leave_grad_alone(fused: list[int]) -> None:
    layer = _layer()
    reference = copy.deepcopy(layer)
    seed = _seeded(layer)
    x = torch.randn(16, D_MODEL, requires_grad=True)
    w1 = layer.experts.w1
    (got,) = torch.autograd.grad(layer(x).square().sum(), [w1])
    layer(x).square().sum().backward(inputs=[x])
    assert fused == [0, 0]
    for name, p in layer.named_parameters():
        assert torch.equal(p.grad, seed[name]), f"{name}: .grad changed by autograd.grad / backward(inputs=...)"
    reference(x).square().sum().backward()
    torch.testing.assert_close(got, reference.experts.w1.grad, atol=1e-6, rtol=1e-6)


def test_hooks_see_what_autograd_gives_them(fused: list[int]) -> None:
    layer, plain = _layer(), _layer()
    seed = _seeded(layer)
    layer.experts.w1.register_hook(lambda g: 2 * g)  # a tensor hook must see the gradient: plain path
    after: dict[str, torch.Tensor] = {}
    layer.experts.w2.register_post_accumulate_grad_hook(lambda p: after.update(w2=p.grad.clone()))
    x = torch.randn(16, D_MODEL)
    layer(x).square().sum().backward()
    assert fused == [1]  # w2 only
    plain(x).square().sum().backward()
    torch.testing.assert_close(layer.experts.w1.grad, seed["experts.w1"] + 2 * plain.experts.w1.grad)
    torch.testing.assert_close(after["w2"], seed["experts.w2"] + plain.experts.w2.grad)
    torch.testing.assert_close(layer.experts.w2.grad, after["w2"])
