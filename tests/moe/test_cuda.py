"""The MoE layer on a CUDA device against the same layer on CPU (skipped without a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from sparta.moe import MoELayer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _step(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    x = x.clone().requires_grad_()
    y = layer(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


@pytest.mark.parametrize("router", ["topk", "sigmoid", "expert_choice", "soft"])
@pytest.mark.parametrize("capacity", [None, 1.25])
def test_cuda_float32_equals_cpu(router: str, capacity: float | None) -> None:
    if router in ("expert_choice", "soft") and capacity is not None:
        pytest.skip("capacity applies to token-choice routers only")
    cpu = MoELayer(64, 128, 8, router=router, capacity_factor=capacity, activation="swiglu").train()
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(4, 32, 64)
    want, want_dx, want_grads = _step(cpu, x)
    got, got_dx, got_grads = _step(gpu, x.cuda())
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_dx.cpu(), want_dx, atol=1e-4, rtol=1e-4)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name].cpu(), grad, atol=1e-4, rtol=1e-4, msg=name)


def test_cuda_bfloat16_grouped_mm_tracks_float32() -> None:
    """bfloat16 on CUDA takes torch._grouped_mm; it stays within bfloat16 rounding of float32."""
    fast = MoELayer(128, 256, 8, activation="gelu").cuda().to(torch.bfloat16)
    # The float32 reference holds the same (bfloat16-representable) values and input, so both
    # route every token alike (routing runs in float32) and only the GEMMs' rounding differs.
    ref = copy.deepcopy(fast).float()
    assert fast.experts._use_grouped_mm(torch.zeros(16, 128, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(2048, 128, device="cuda").to(torch.bfloat16)
    want, _, _ = _step(ref, x.float())
    got, got_dx, _ = _step(fast, x)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got_dx).all()
    assert (got.float() - want).norm() / want.norm() < 2e-2
