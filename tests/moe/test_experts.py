"""GroupedExperts: grouped_mm against a per-expert oracle, blocks, empty experts, initialisation."""

from __future__ import annotations

import math

import pytest
import torch

from sparta.errors import ConfigError, InputError
from sparta.moe import GroupedExperts, MoELayer
from sparta.moe.experts import activate


def _per_expert(experts: GroupedExperts, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The oracle: one plain matmul per expert over its slice of rows."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        x = rows[start : start + n]
        start += n

        def linear(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, e: int = e) -> torch.Tensor | None:
            if w is None:
                return None
            return x @ w[e] if b is None else x @ w[e] + b[e]

        hidden = activate(experts.activation, linear(x, experts.w1, experts.b1), linear(x, experts.w3, experts.b3))
        outs.append(linear(hidden, experts.w2, experts.b2))
    return torch.cat(outs)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu", "swiglu"])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [4, 4, 4, 4], [0, 0, 0, 0]])
def test_grouped_mm_equals_per_expert_matmuls(activation: str, counts: list[int], bias: bool) -> None:
    experts = GroupedExperts(4, 8, 12, activation=activation, bias=bias)
    rows = torch.randn(sum(counts), 8, requires_grad=True)
    grads = []
    for run in (lambda: experts(rows, torch.tensor(counts)), lambda: _per_expert(experts, rows, counts)):
        out = run()
        out.sum().backward()  # a broadcast (stride 0) gradient, which grouped_mm alone rejects
        grads.append((out.detach(), rows.grad.clone(), *(p.grad.clone() for p in experts.parameters())))
        rows.grad = None
        experts.zero_grad(set_to_none=True)
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("activation", "bias"), [("gelu", False), ("swiglu", False), ("gelu", True), ("swiglu", True)])
@pytest.mark.parametrize("blocks", [[[3, 0, 2], [1, 4, 0]], [[0, 0, 0], [2, 0, 1], [0, 3, 0]], [[0, 0, 0]]])
def test_blocks_equal_rows_in_expert_order(activation: str, bias: bool, blocks: list[list[int]]) -> None:
    """Rows in per-source blocks give each row the output and gradient it gets in expert
    order, and the weights the same gradients (an expert's rows split over blocks add up)."""
    experts = GroupedExperts(3, 8, 12, activation=activation, bias=bias)
    block_counts = torch.tensor(blocks)
    rows = torch.randn(int(block_counts.sum()), 8, requires_grad=True)
    upstream = torch.randn(rows.shape[0], 8)
    experts.forward_blocks(rows, block_counts).backward(upstream)
    got = [rows.grad.clone(), *(p.grad.clone() for p in experts.parameters())]
    out = experts.forward_blocks(rows.detach(), block_counts)
    expert_of_row = torch.arange(3).repeat(len(blocks)).repeat_interleave(block_counts.reshape(-1))
    order = torch.sort(expert_of_row, stable=True).indices
    rows.grad = None
    experts.zero_grad(set_to_none=True)
    expected = _per_expert(experts, rows[order], block_counts.sum(dim=0).tolist())
    expected.backward(upstream[order])
    want = [rows.grad, *(p.grad for p in experts.parameters())]
    torch.testing.assert_close(out[order], expected.detach(), atol=1e-5, rtol=1e-5)
    for got_grad, want_grad in zip(got, want, strict=True):
        torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-5)


def test_layer_expert_without_tokens_gets_zero_gradient() -> None:
    layer = MoELayer(8, 16, 4, top_k=2, activation="swiglu").train()
    with torch.no_grad():
        layer.router.gate.weight[3] = -10.0  # positive inputs never pick expert 3
    x = torch.rand(20, 8) + 0.1
    layer(x).sum().backward()
    assert layer.last_stats.tokens_per_expert[3] == 0
    for weight in (layer.experts.w1, layer.experts.w2, layer.experts.w3):
        assert torch.equal(weight.grad[3], torch.zeros_like(weight.grad[3]))
        assert weight.grad[:3].abs().sum() > 0


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


def test_bfloat16_rows_track_float32() -> None:
    experts = GroupedExperts(2, 8, 16).to(torch.bfloat16)
    reference = GroupedExperts(2, 8, 16)
    reference.load_state_dict({k: v.float() for k, v in experts.state_dict().items()})
    rows = torch.randn(5, 8, dtype=torch.bfloat16)
    out = experts(rows, torch.tensor([2, 3]))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(rows.float(), torch.tensor([2, 3])), atol=3e-2, rtol=3e-2)


def test_rows_grouped_mm_cannot_take_name_the_fix() -> None:
    experts = GroupedExperts(2, 6, 10)  # 24-byte float32 rows: not 16-byte aligned
    with pytest.raises(InputError, match=r"d_model=6, d_ff=10.*multiples of 4"):
        experts.check_rows(torch.zeros(3, 6))
    with pytest.raises(InputError, match=r"float32 weights.*float64 rows.*layer.to"):
        GroupedExperts(2, 8, 16).check_rows(torch.zeros(3, 8, dtype=torch.float64))
    with pytest.raises(InputError, match=r"d_model=6"):
        MoELayer(6, 10, 2)(torch.randn(4, 6))


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_split_hidden_units_sum_to_the_whole_experts(activation: str) -> None:
    """split_ff's slices (what each rank of a tp group keeps) give partial outputs and input
    gradients whose sums are the whole experts', b2 once; each slice's weight gradients are
    the whole's slices, b2's whole; a whole checkpoint loads."""
    torch.manual_seed(0)
    whole = GroupedExperts(3, 8, 16, activation=activation, bias=True)
    counts = torch.tensor([2, 0, 3])
    rows = torch.randn(5, 8)
    up = torch.randn(5, 8)
    x = rows.clone().requires_grad_()
    (whole(x, counts) * up).sum().backward()
    out, grad_in = torch.zeros(5, 8), torch.zeros(5, 8)
    for rank in range(2):
        part = GroupedExperts(3, 8, 16, activation=activation, bias=True)
        part.load_state_dict(whole.state_dict())
        part.split_ff(rank, 2)
        assert part.ff_range == (8 * rank, 8 * rank + 8) and part.w2.shape == (3, 8, 8)
        gated = {"w3", "b3"} if activation == "swiglu" else set()
        assert {n for n, _ in part.split_weights()} == {"w1", "w2", "b1"} | gated
        xr = rows.clone().requires_grad_()
        y = part(xr, counts)
        (y * up).sum().backward()
        out += y.detach()
        grad_in += xr.grad
        for name, p in part.named_weights():
            want = whole.get_parameter(name).grad
            offsets, size = part.expert_slice(name) or ((0,) * (p.dim() - 1), tuple(p.shape[1:]))
            for dim, (start, length) in enumerate(zip(offsets, p.shape[1:], strict=True)):
                want = want.narrow(dim + 1, start, length)
            torch.testing.assert_close(p.grad, want, msg=name)
        reloaded = GroupedExperts(3, 8, 16, activation=activation, bias=True)
        reloaded.split_ff(rank, 2)
        reloaded.load_state_dict(whole.state_dict())  # whole experts: each rank cuts its slice
        torch.testing.assert_close(reloaded(rows, counts), y.detach())
    torch.testing.assert_close(out, whole(rows, counts).detach())
    torch.testing.assert_close(grad_in, x.grad)
    with pytest.raises(ConfigError, match="already split"):
        part.split_ff(0, 2)


def test_split_experts_initialise_as_slices_of_the_whole_ones() -> None:
    """reset_parameters after split_ff draws the whole experts (nn.Linear's bounds from the
    whole fan-in) and keeps this rank's slice; a slice of another width is refused by name."""
    torch.manual_seed(1)
    whole = GroupedExperts(2, 8, 16, activation="swiglu", bias=True)
    parts = []
    for rank in range(2):
        torch.manual_seed(1)
        part = GroupedExperts(2, 8, 16, activation="swiglu", bias=True)
        part.split_ff(rank, 2)
        torch.manual_seed(1)
        part.reset_parameters()
        parts.append(part)
    torch.testing.assert_close(torch.cat([p.w1 for p in parts], dim=2), whole.w1)
    torch.testing.assert_close(torch.cat([p.w2 for p in parts], dim=1), whole.w2)
    torch.testing.assert_close(torch.cat([p.b3 for p in parts], dim=1), whole.b3)
    torch.testing.assert_close(parts[1].b2, whole.b2)
    quarter = GroupedExperts(2, 8, 16, activation="swiglu", bias=True)
    quarter.split_ff(0, 4)
    with pytest.raises(RuntimeError, match=r"its slice \(0, 4\) of d_ff=16"):
        quarter.load_state_dict(parts[0].state_dict())
