"""The MoE layer on every device this machine has: CPU always, CUDA when present. The same
test bodies run on each, so the CUDA path is the CPU path with another device argument."""

from __future__ import annotations

import copy

import pytest
import torch

from sparta.moe import MoELayer
from tests.moe.moe_reference import reference_forward

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _step(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    x = x.clone().requires_grad_()
    y = layer(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("router", "capacity"), [("topk", None), ("topk", 1.25), ("sigmoid", None), ("expert_choice", None), ("soft", None)]
)
def test_float32_on_device_equals_reference(device: str, router: str, capacity: float | None) -> None:
    """Output and every gradient on ``device`` equal the naive reference's on CPU."""
    cpu = MoELayer(64, 128, 8, router=router, capacity_factor=capacity, activation="swiglu").train()
    layer = copy.deepcopy(cpu).to(device)
    x = torch.randn(4, 32, 64)
    got, got_dx, got_grads = _step(layer, x.to(device))
    ref_x = x.clone().requires_grad_()
    y_ref, aux_ref = reference_forward(cpu, ref_x)
    upstream = torch.linspace(-1, 1, 64)
    params = dict(cpu.named_parameters())
    want = torch.autograd.grad((y_ref * upstream).sum() + aux_ref, [ref_x, *params.values()], allow_unused=True)
    torch.testing.assert_close(got.cpu(), y_ref.detach(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_dx.cpu(), want[0], atol=1e-4, rtol=1e-4)
    for (name, p), w in zip(params.items(), want[1:], strict=True):
        w = torch.zeros_like(p) if w is None else w
        torch.testing.assert_close(got_grads[name].cpu(), w, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_tracks_float32(device: str) -> None:
    """bfloat16 stays within bfloat16 rounding of float32 on the same device."""
    fast = MoELayer(128, 256, 8, activation="gelu").to(device, torch.bfloat16)
    # The float32 reference holds the same (bfloat16-representable) values and input, so both
    # route every token alike (routing runs in float32) and only the GEMMs' rounding differs.
    ref = copy.deepcopy(fast).float()
    x = torch.randn(2048, 128, device=device).to(torch.bfloat16)
    want, want_dx, want_grads = _step(ref, x.float())
    got, got_dx, got_grads = _step(fast, x)
    assert got.dtype == torch.bfloat16 and got_dx.dtype == torch.bfloat16

    def off(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b).norm() / b.norm())

    assert off(got, want) < 2e-2
    assert off(got_dx, want_dx) < 2e-2
    for name, grad in want_grads.items():
        assert got_grads[name].dtype == torch.bfloat16 and off(got_grads[name], grad) < 2e-2, name
