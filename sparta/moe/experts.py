"""GroupedExperts: the MLPs of the experts one rank holds, run over rows grouped by expert."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from sparta.errors import InputError
from sparta.moe.dispatch import DispatchPlan, combine

# torch._grouped_mm's dtypes per device type; CUDA kernels exist for bfloat16 only.
_GROUPED_MM_DTYPES = {
    "cpu": (torch.float32, torch.bfloat16, torch.float16),
    "cuda": (torch.bfloat16,),
}
# torch._grouped_mm needs every row stride to be a multiple of 16 bytes.
_GROUPED_MM_ALIGN_BYTES = 16


def _activate(activation: str, h1: Tensor, h3: Tensor | None) -> Tensor:
    if activation == "swiglu":
        return nn.functional.silu(h1) * h3
    if activation == "gelu":
        return nn.functional.gelu(h1)
    return nn.functional.relu(h1)


class _ExpertLoop(torch.autograd.Function):
    """All experts' MLPs, one expert at a time, forward and backward written out.

    Two forms: with ``token_idx`` None, ``x`` ``[N, d]`` holds the rows grouped by expert and
    the output is the same rows' outputs. With ``token_idx`` / ``weight`` ``[N]`` (a dispatch
    plan), ``x`` is the ``[T, d]`` tokens and the output ``[T, d]`` is
    ``sum_i weight[i] * expert(x[token_idx[i]])`` added into token ``token_idx[i]``: gather,
    experts and combine fused, so no ``[N, d]`` row tensor is ever built.

    Why by hand: each expert's rows, hidden activations and gradients are produced and
    consumed while still cache-resident, outputs go straight into preallocated buffers (no
    cat / split / stack copies), and only the pre-activations are saved (the activation
    output is recomputed in backward). In benchmarks/moe_layer.py on one CPU thread this is
    faster than autograd over per-expert ``torch.mm`` and than ``torch._grouped_mm`` (which
    streams the whole ``[N, d_ff]`` hidden tensor through memory between GEMMs), and on par
    with one dense GEMM over all rows.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        token_idx: Tensor | None,
        weight: Tensor | None,
        counts_list: list[int],
        activation: str,
        w1: Tensor,
        w3: Tensor | None,
        w2: Tensor,
    ) -> Tensor:
        rows = sum(counts_list)
        out = x.new_empty(rows, w2.shape[2]) if token_idx is None else x.new_zeros(x.shape[0], w2.shape[2])
        pre1 = x.new_empty(rows, w1.shape[2])
        pre3 = torch.empty_like(pre1) if w3 is not None else None
        start = 0
        for e, count in enumerate(counts_list):
            end = start + count
            xe = x[start:end] if token_idx is None else x.index_select(0, token_idx[start:end])
            h1 = torch.mm(xe, w1[e], out=pre1[start:end])
            h3 = torch.mm(xe, w3[e], out=pre3[start:end]) if pre3 is not None else None
            act = _activate(activation, h1, h3)
            if token_idx is None:
                torch.mm(act, w2[e], out=out[start:end])
            else:
                ye = torch.mm(act, w2[e]).mul_(weight[start:end, None])
                out.index_add_(0, token_idx[start:end], ye)
            start = end
        ctx.counts_list, ctx.activation = counts_list, activation
        ctx.save_for_backward(x, token_idx, weight, pre1, pre3, w1, w3, w2)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, token_idx, weight, pre1, pre3, w1, w3, w2 = ctx.saved_tensors
        swiglu = ctx.activation == "swiglu"
        need_x = ctx.needs_input_grad[0]
        grad_x = None
        if need_x:
            grad_x = torch.empty_like(x) if token_idx is None else torch.zeros_like(x)
        grad_weight = torch.empty_like(weight) if weight is not None else None
        grad_w1, grad_w2 = torch.empty_like(w1), torch.empty_like(w2)
        grad_w3 = torch.empty_like(w3) if w3 is not None else None
        start = 0
        for e, count in enumerate(ctx.counts_list):
            end = start + count
            h1 = pre1[start:end]
            h3 = pre3[start:end] if pre3 is not None else None
            act = _activate(ctx.activation, h1, h3)
            if token_idx is None:
                xe, grad = x[start:end], grad_out[start:end]
                grad_act = grad @ w2[e].t()
            else:
                idx, w = token_idx[start:end], weight[start:end, None]
                xe, grad = x.index_select(0, idx), grad_out.index_select(0, idx)
                grad_act = grad @ w2[e].t()
                # d/dw <grad, w * act @ w2> = <grad @ w2.T, act>: no [N, d] output is kept.
                torch.linalg.vecdot(grad_act, act, out=grad_weight[start:end])
                grad.mul_(w)
                grad_act.mul_(w)
            torch.mm(act.t(), grad, out=grad_w2[e])
            if swiglu:
                grad_h3 = grad_act * nn.functional.silu(h1)
                grad_h1 = torch.ops.aten.silu_backward(grad_act.mul_(h3), h1)
                torch.mm(xe.t(), grad_h3, out=grad_w3[e])
            elif ctx.activation == "gelu":
                grad_h1 = torch.ops.aten.gelu_backward(grad_act, h1)
            else:
                grad_h1 = torch.ops.aten.threshold_backward(grad_act, h1, 0)
            torch.mm(xe.t(), grad_h1, out=grad_w1[e])
            if need_x:
                if token_idx is None:
                    grad_xe = torch.mm(grad_h1, w1[e].t(), out=grad_x[start:end])
                else:
                    grad_xe = grad_h1 @ w1[e].t()
                if swiglu:
                    grad_xe.addmm_(grad_h3, w3[e].t())
                if token_idx is not None:
                    grad_x.index_add_(0, token_idx[start:end], grad_xe)
            start = end
        return grad_x, None, grad_weight, None, None, grad_w1, grad_w3, grad_w2


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's backward
    rejects the broadcast (stride 0) gradients that e.g. ``y.sum().backward()`` produces."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


class GroupedExperts(nn.Module):
    """``num_experts`` independent MLPs ``act(x @ w1[e]) @ w2[e]`` (SwiGLU:
    ``(silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]``), no biases.

    Weights: ``w1``, ``w3`` ``[num_experts, d_model, d_ff]``, ``w2`` ``[num_experts, d_ff,
    d_model]``. Local expert ``i`` is global expert ``first_expert + i``; its initial weights
    depend only on the global RNG state and its global id, so a model built with any
    expert-parallel size starts from the same experts. ``state_dict()`` holds one entry per
    expert under its global id (``w1.<id>`` ``[d_model, d_ff]``, ``w2.<id>`` ``[d_ff,
    d_model]``), and ``load_state_dict`` takes this rank's experts from any checkpoint that
    contains them, whatever expert-parallel size wrote it.

    ``gemm``: ``"loop"`` runs the experts one after the other with a hand-written backward
    (``_ExpertLoop``), fastest on CPU; ``"grouped_mm"`` runs each GEMM of all experts as one
    ``torch._grouped_mm`` (float32/bfloat16/float16 on CPU, bfloat16 on CUDA, ``d_model``
    and ``d_ff`` rows 16-byte aligned), the choice for GPUs; ``"auto"`` takes grouped_mm on
    CUDA where it applies and the loop otherwise.
    """

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        d_ff: int,
        activation: str = "gelu",
        gemm: str = "auto",
        first_expert: int = 0,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.d_model = d_model
        self.d_ff = d_ff
        self.activation = activation
        self.gemm = gemm
        # A plain attribute, not a buffer: a checkpoint must not pin the expert-parallel layout.
        self.first_expert = first_expert
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w3 = nn.Parameter(torch.empty(num_experts, d_model, d_ff)) if activation == "swiglu" else None
        self.w2 = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise each expert's matrices as ``nn.Linear`` initialises its weight
        (uniform in ``+-1/sqrt(fan_in)``), from a generator seeded by one draw of the global
        RNG plus the global expert id."""
        base_seed = int(torch.randint(0, 2**62, ()).item())
        for local in range(self.num_experts):
            generator = torch.Generator().manual_seed(base_seed + self.first_expert + local)
            for _, weight in self.named_weights():
                fan_in, fan_out = weight.shape[1], weight.shape[2]
                linear_weight = torch.empty(fan_out, fan_in)
                nn.init.kaiming_uniform_(linear_weight, a=math.sqrt(5), generator=generator)
                weight[local].copy_(linear_weight.t())

    def named_weights(self) -> list[tuple[str, nn.Parameter]]:
        """(name, weight) of each expert weight, ``w3`` only for SwiGLU."""
        return [(name, w) for name, w in (("w1", self.w1), ("w3", self.w3), ("w2", self.w2)) if w is not None]

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        # One entry per expert under its global id ("w1.5": [d_model, d_ff]), so that a
        # checkpoint does not depend on how the experts were split over ranks.
        for name, weight in self.named_weights():
            tensor = weight if keep_vars else weight.detach()
            for local in range(self.num_experts):
                destination[f"{prefix}{name}.{self.first_expert + local}"] = tensor[local]

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Takes this rank's experts from a checkpoint holding any superset of the experts
        # (one rank's shard of the same split, or all of them): other experts' entries are
        # not "unexpected", they belong to other ranks.
        for name, weight in self.named_weights():
            for local in range(self.num_experts):
                key = f"{prefix}{name}.{self.first_expert + local}"
                if key not in state_dict:
                    missing_keys.append(key)
                    continue
                value = state_dict[key]
                if value.shape != weight.shape[1:]:
                    error_msgs.append(
                        f"size mismatch for {key}: the checkpoint has {tuple(value.shape)}, this expert "
                        f"{tuple(weight.shape[1:])}: build the layer with the checkpoint's d_model and d_ff"
                    )
                    continue
                with torch.no_grad():
                    weight[local].copy_(value)
        if strict:
            ours = {name for name, _ in self.named_weights()}
            unexpected_keys.extend(
                key for key in state_dict if key.startswith(prefix) and key[len(prefix) :].split(".")[0] not in ours
            )

    def forward(self, rows: Tensor, counts: Tensor, counts_list: list[int]) -> Tensor:
        """``rows`` ``[N, d_model]`` grouped by local expert, ``counts`` ``[num_experts]``
        int64 (``counts_list`` the same on the host) -> ``[N, d_model]``, same order."""
        if len(counts_list) != self.num_experts or sum(counts_list) != rows.shape[0]:
            raise InputError(
                f"GroupedExperts got counts {counts_list} for {rows.shape[0]} rows and "
                f"{self.num_experts} experts: pass one count per local expert summing to the rows"
            )
        if self._use_grouped_mm(rows):
            return self._grouped_mm(rows, counts)
        args = (counts_list, self.activation, self.w1, self.w3, self.w2)
        return _ExpertLoop.apply(rows.contiguous(), None, None, *args)

    def forward_tokens(self, x: Tensor, plan: DispatchPlan) -> Tensor:
        """``[T, d_model]`` tokens -> ``[T, d_model]``: each token's experts' outputs, weighted
        and summed as ``plan`` (a ``plan_dispatch`` result for these experts) says. Equal to
        ``combine(self(rows, ...), plan)`` on the gathered rows, without building them."""
        if self._use_grouped_mm(x) and plan.token_idx.numel() > 0:
            rows = x.index_select(0, plan.token_idx)
            return combine(self._grouped_mm(rows, plan.counts), plan, x.shape[0])
        weight = plan.weight.to(x.dtype)
        args = (plan.counts_list, self.activation, self.w1, self.w3, self.w2)
        return _ExpertLoop.apply(x.contiguous(), plan.token_idx, weight, *args)

    def _grouped_mm(self, rows: Tensor, counts: Tensor) -> Tensor:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        h1 = torch._grouped_mm(rows, self.w1, offs=offsets)
        h3 = torch._grouped_mm(rows, self.w3, offs=offsets) if self.w3 is not None else None
        out = torch._grouped_mm(_activate(self.activation, h1, h3), self.w2, offs=offsets)
        return _ContiguousGrad.apply(out)

    def _use_grouped_mm(self, rows: Tensor) -> bool:
        if self.gemm == "loop" or (self.gemm == "auto" and rows.device.type == "cpu"):
            return False
        supported = (
            hasattr(torch, "_grouped_mm")
            and rows.dtype in _GROUPED_MM_DTYPES.get(rows.device.type, ())
            and self.w1.dtype == rows.dtype
            and rows.is_contiguous()
            and all(n * rows.element_size() % _GROUPED_MM_ALIGN_BYTES == 0 for n in (self.d_model, self.d_ff))
        )
        if self.gemm == "grouped_mm" and not supported:
            raise InputError(
                f"expert_gemm='grouped_mm' cannot run {rows.dtype} rows on {rows.device.type} "
                f"with d_model={self.d_model}, d_ff={self.d_ff}: it needs "
                f"{_GROUPED_MM_DTYPES.get(rows.device.type, ())} and 16-byte aligned rows; "
                "use expert_gemm='auto' to fall back to a loop"
            )
        # No rows at all: grouped_mm's backward rejects the stride-0 gradient of an empty tensor.
        return supported and rows.shape[0] > 0

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, d_model={self.d_model}, d_ff={self.d_ff}, "
            f"activation={self.activation}, first_expert={self.first_expert}"
        )
