"""HybridOptimizer in one process: a torch Optimizer whose parts step like the optimizers
they wrap, LR schedulers included."""

from __future__ import annotations

import torch

from sparta.embedding import HybridOptimizer


def params() -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return torch.nn.Parameter(torch.randn(5, 3, generator=gen)), torch.nn.Parameter(torch.randn(4, generator=gen))


def loss(a: torch.Tensor, b: torch.Tensor, step: int) -> torch.Tensor:
    return (a.sin() * (step + 1)).sum() + (b**2).sum()


def test_hybrid_optimizer_steps_its_parts_under_an_lr_scheduler() -> None:
    a, b = params()
    ref_a, ref_b = (p.detach().clone().requires_grad_() for p in (a, b))
    calls: list[str] = []
    opt = HybridOptimizer(
        {"sparse": torch.optim.SGD([a], lr=0.1, momentum=0.9), "dense": torch.optim.Adam([b], lr=0.05)},
        {"sparse": lambda: calls.append("sparse"), "dense": lambda: calls.append("dense")},
    )
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    refs = [torch.optim.SGD([ref_a], lr=0.1, momentum=0.9), torch.optim.Adam([ref_b], lr=0.05)]
    ref_scheds = [torch.optim.lr_scheduler.StepLR(r, step_size=2, gamma=0.5) for r in refs]
    for step in range(5):
        loss(a, b, step).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        loss(ref_a, ref_b, step).backward()
        for r, s in zip(refs, ref_scheds, strict=True):
            r.step()
            r.zero_grad()
            s.step()
    assert calls == ["sparse", "dense"] * 5  # each part's wait runs just before it steps
    assert [g["lr"] for g in opt.parts["sparse"].param_groups] == [0.1 * 0.5**2]
    assert sched.get_last_lr() == [0.1 * 0.5**2, 0.05 * 0.5**2]
    torch.testing.assert_close(a, ref_a, rtol=0, atol=0)
    torch.testing.assert_close(b, ref_b, rtol=0, atol=0)
    # state round-trips, and zero_grad(set_to_none=False) zeroes every part's gradients
    state = opt.state_dict()
    assert set(state) == {"sparse", "dense"} and state["dense"]["state"][0]["step"] == 5
    opt.load_state_dict(state)
    loss(a, b, 0).backward()
    opt.zero_grad(set_to_none=False)
    assert a.grad is not None and not a.grad.any() and not b.grad.any()  # type: ignore[union-attr]
