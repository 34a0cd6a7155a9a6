"""GroupedExperts: the MLPs of the experts one rank holds, run over rows grouped by expert."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from sparta.errors import InputError
from sparta.moe.dispatch import DispatchPlan, combine
from sparta.moe.expert_loop import ExpertLoop, LoopWeights, Segment, activate, block_segments, consecutive_segments

# torch._grouped_mm's dtypes per device type; CUDA kernels exist for bfloat16 only.
_GROUPED_MM_DTYPES = {
    "cpu": (torch.float32, torch.bfloat16, torch.float16),
    "cuda": (torch.bfloat16,),
}
# torch._grouped_mm needs every row stride to be a multiple of 16 bytes.
_GROUPED_MM_ALIGN_BYTES = 16


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
    """``num_experts`` independent MLPs ``act(x @ w1[e] + b1[e]) @ w2[e] + b2[e]`` (SwiGLU:
    ``(silu(x @ w1[e] + b1[e]) * (x @ w3[e] + b3[e])) @ w2[e] + b2[e]``); the biases only
    with ``bias=True``.

    Weights: ``w1``, ``w3`` ``[num_experts, d_model, d_ff]``, ``w2`` ``[num_experts, d_ff,
    d_model]``; biases ``b1``, ``b3`` ``[num_experts, d_ff]``, ``b2`` ``[num_experts,
    d_model]``. Local expert ``i`` is global expert ``first_expert + i``; its initial weights
    depend only on the global RNG state and its global id, so a model built with any
    expert-parallel size starts from the same experts. ``state_dict()`` holds one entry per
    expert under its global id (``w1.<id>`` ``[d_model, d_ff]``, ``w2.<id>`` ``[d_ff,
    d_model]``, ``b1.<id>`` ``[d_ff]``, ...), and ``load_state_dict`` takes this rank's experts from any checkpoint that
    contains them, whatever expert-parallel size wrote it.

    ``gemm``: ``"loop"`` runs the experts one after the other with a hand-written backward
    (``sparta.moe.expert_loop``), fastest on CPU; ``"grouped_mm"`` runs each GEMM of all
    experts as one ``torch._grouped_mm`` (float32/bfloat16/float16 on CPU, bfloat16 on CUDA, ``d_model``
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
        bias: bool = False,
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
        self.b1 = nn.Parameter(torch.empty(num_experts, d_ff)) if bias else None
        self.b3 = nn.Parameter(torch.empty(num_experts, d_ff)) if bias and self.w3 is not None else None
        self.b2 = nn.Parameter(torch.empty(num_experts, d_model)) if bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise each expert's matrices and biases as ``nn.Linear`` initialises its
        weight and bias (uniform in ``+-1/sqrt(fan_in)``), from a generator seeded by one
        draw of the global RNG plus the global expert id."""
        base_seed = int(torch.randint(0, 2**62, ()).item())
        pairs = ((self.w1, self.b1), (self.w3, self.b3), (self.w2, self.b2))
        for local in range(self.num_experts):
            generator = torch.Generator().manual_seed(base_seed + self.first_expert + local)
            for weight, bias in pairs:
                if weight is None:
                    continue
                fan_in, fan_out = weight.shape[1], weight.shape[2]
                linear_weight = torch.empty(fan_out, fan_in)
                nn.init.kaiming_uniform_(linear_weight, a=math.sqrt(5), generator=generator)
                weight[local].copy_(linear_weight.t())
                if bias is not None:
                    bound = 1 / math.sqrt(fan_in)
                    bias[local].uniform_(-bound, bound, generator=generator)

    def named_weights(self) -> list[tuple[str, nn.Parameter]]:
        """(name, tensor) of each per-expert parameter: ``w1``, ``w3`` (SwiGLU only),
        ``w2``, then the biases ``b1``, ``b3``, ``b2`` where the experts have them."""
        named = (("w1", self.w1), ("w3", self.w3), ("w2", self.w2), ("b1", self.b1), ("b3", self.b3), ("b2", self.b2))
        return [(name, w) for name, w in named if w is not None]

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
        if self._grouped_mm_takes(rows, rows.shape[0]):
            return self._grouped_mm(rows, counts)
        return self._loop(rows.contiguous(), None, None, consecutive_segments(counts_list))

    def forward_tokens(self, x: Tensor, plan: DispatchPlan) -> Tensor:
        """``[T, d_model]`` tokens -> ``[T, d_model]``: each token's experts' outputs, weighted
        and summed as ``plan`` (a ``plan_dispatch`` result for these experts) says. Equal to
        ``combine(self(rows, ...), plan)`` on the gathered rows, without building them."""
        if self._grouped_mm_takes(x, plan.token_idx.numel()):
            rows = x.index_select(0, plan.token_idx)
            return combine(self._grouped_mm(rows, plan.counts), plan, x.shape[0])
        segments = consecutive_segments(plan.counts_list)
        return self._loop(x.contiguous(), plan.token_idx, plan.weight.to(x.dtype), segments)

    def forward_blocks(self, rows: Tensor, block_counts: Tensor) -> Tensor:
        """``rows`` ``[N, d_model]`` in blocks, each grouped by local expert (block ``b`` holds
        ``block_counts[b, j]`` rows of expert ``j``, ``block_counts`` ``[B, num_experts]``
        int64; what an expert-parallel all-to-all receives, one block per source rank) ->
        ``[N, d_model]``, same order. The loop runs each block's rows where they lie;
        grouped_mm takes them in expert order and puts them back."""
        if self._grouped_mm_takes(rows, rows.shape[0]):
            expert_of_row = torch.arange(self.num_experts, device=rows.device).repeat(block_counts.shape[0])
            row_expert = torch.repeat_interleave(expert_of_row, block_counts.reshape(-1).to(rows.device))
            by_expert = torch.sort(row_expert, stable=True).indices
            out = self._grouped_mm(rows.index_select(0, by_expert), block_counts.sum(dim=0).to(rows.device))
            return torch.empty_like(out).index_copy_(0, by_expert, out)
        return self._loop(rows.contiguous(), None, None, block_segments(block_counts.tolist()))

    def loop_weights(self) -> LoopWeights:
        """The weights as the expert loop takes them."""
        return LoopWeights(self.activation, self.w1, self.w3, self.w2, self.b1, self.b3, self.b2)

    def _loop(self, x: Tensor, token_idx: Tensor | None, weight: Tensor | None, segments: list[Segment]) -> Tensor:
        w = self.loop_weights()
        return ExpertLoop.apply(x, token_idx, weight, segments, w.activation, *w.tensors())

    def _grouped_mm(self, rows: Tensor, counts: Tensor) -> Tensor:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)

        def linear(x: Tensor, w: Tensor | None, b: Tensor | None) -> Tensor | None:
            if w is None:
                return None
            y = torch._grouped_mm(x, w, offs=offsets)
            # output_size: no device-to-host sync for the row count.
            return y if b is None else y + b.repeat_interleave(counts, dim=0, output_size=x.shape[0])

        h1 = linear(rows, self.w1, self.b1)
        assert h1 is not None
        h3 = linear(rows, self.w3, self.b3)
        out = linear(activate(self.activation, h1, h3), self.w2, self.b2)
        return _ContiguousGrad.apply(out)

    def _grouped_mm_takes(self, rows: Tensor, count: int) -> bool:
        """Whether ``count`` rows like ``rows`` go through grouped_mm here. No rows at all take
        the loop: grouped_mm's backward rejects the stride-0 gradient of an empty tensor."""
        return self.uses_grouped_mm(rows) and count > 0

    def uses_grouped_mm(self, rows: Tensor) -> bool:
        """Whether rows like ``rows`` go through ``torch._grouped_mm`` (else the expert loop),
        by device, dtype and widths, not by row count, so every rank of a group agrees;
        raises where ``gemm='grouped_mm'`` cannot take them. (No rows at all always take
        the loop.)"""
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
        return supported

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, d_model={self.d_model}, d_ff={self.d_ff}, "
            f"activation={self.activation}, first_expert={self.first_expert}"
        )
