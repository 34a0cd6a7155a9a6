"""GroupedExperts: the MLPs of the experts one rank holds, run over rows grouped by expert."""

from __future__ import annotations

import itertools
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


Segment = tuple[int, int, int]
"""``(local expert, first row, end row)``: a run of rows one expert processes."""


def consecutive_segments(counts_list: list[int]) -> list[Segment]:
    """Segments of rows grouped by expert: expert ``e`` has the ``counts_list[e]`` rows after
    those of experts ``0 .. e - 1``."""
    ends = list(itertools.accumulate(counts_list))
    return [(e, end - count, end) for e, (count, end) in enumerate(zip(counts_list, ends, strict=True))]


# glibc serves allocations of at least this size (its largest dynamic mmap threshold) by
# mmap and gives them back to the OS on free; smaller ones come from the heap, whose freed
# pages stay resident. Pre-activations are stored in blocks of this size so that backward
# returns each block's memory as soon as it is done with it.
_RELEASABLE_BYTES = 32 << 20


class _PreActivations:
    """The ``[rows, width]`` pre-activations of a run of segments, stored in blocks of
    consecutive segments, each of at least ``_RELEASABLE_BYTES``; ``take(i)`` hands out
    segment ``i``'s rows and frees a block once its last segment has been taken (segments
    are taken in order)."""

    def __init__(self, segments: list[Segment], width: int, like: Tensor) -> None:
        row_bytes = width * like.element_size()
        self._where: list[tuple[int, int, int]] = []  # per segment: block, first row, end row
        self._last: list[int] = []  # per block: its last segment
        sizes: list[int] = []
        for i, (_, start, end) in enumerate(segments):
            if not sizes or sizes[-1] * row_bytes >= _RELEASABLE_BYTES:
                sizes.append(0)
                self._last.append(i)
            self._where.append((len(sizes) - 1, sizes[-1], sizes[-1] + end - start))
            sizes[-1] += end - start
            self._last[-1] = i
        self._blocks: list[Tensor | None] = [like.new_empty(n, width) for n in sizes]

    def segment(self, i: int) -> Tensor:
        block, start, end = self._where[i]
        stored = self._blocks[block]
        assert stored is not None
        return stored[start:end]

    def take(self, i: int) -> Tensor:
        rows = self.segment(i)
        block = self._where[i][0]
        if self._last[block] == i:
            self._blocks[block] = None
        return rows


class _ExpertLoop(torch.autograd.Function):
    """All experts' MLPs, one run of rows at a time, forward and backward written out.

    ``segments`` lists ``(expert, start, end)`` runs; an expert may own several. Two forms:
    with ``token_idx`` None, the segments tile the rows of ``x`` ``[N, d]`` and the output is
    those rows' outputs, in place; rows that arrive in several blocks each grouped by expert
    (an all-to-all's output: by source rank, then by expert) run where they lie, with no
    gather or scatter. With ``token_idx`` / ``weight`` ``[N]`` (a dispatch plan, consecutive
    segments), ``x`` is the ``[T, d]`` tokens and the output ``[T, d]`` is ``sum_i weight[i]
    * expert(x[token_idx[i]])`` added into token ``token_idx[i]``: gather, experts and
    combine fused, so no ``[N, d]`` row tensor is ever built.

    Why by hand: each run's rows, hidden activations and gradients are produced and
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
        segments: list[Segment],
        activation: str,
        w1: Tensor,
        w3: Tensor | None,
        w2: Tensor,
    ) -> Tensor:
        out = x.new_empty(x.shape[0], w2.shape[2]) if token_idx is None else x.new_zeros(x.shape[0], w2.shape[2])
        pre1 = _PreActivations(segments, w1.shape[2], x)
        pre3 = _PreActivations(segments, w1.shape[2], x) if w3 is not None else None
        for i, (e, start, end) in enumerate(segments):
            xe = x[start:end] if token_idx is None else x.index_select(0, token_idx[start:end])
            h1 = torch.mm(xe, w1[e], out=pre1.segment(i))
            h3 = torch.mm(xe, w3[e], out=pre3.segment(i)) if pre3 is not None else None
            act = _activate(activation, h1, h3)
            if token_idx is None:
                torch.mm(act, w2[e], out=out[start:end])
            else:
                ye = torch.mm(act, w2[e]).mul_(weight[start:end, None])
                out.index_add_(0, token_idx[start:end], ye)
                del ye
            # This segment's temporaries go before the next one allocates its own, so the
            # peak holds one segment's worth, not two.
            del xe, h1, h3, act
        # Intermediates, not inputs or outputs: kept on ctx so that backward can drop them.
        ctx.pre1, ctx.pre3 = pre1, pre3
        ctx.segments, ctx.activation = segments, activation
        ctx.save_for_backward(x, token_idx, weight, w1, w3, w2)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, token_idx, weight, w1, w3, w2 = ctx.saved_tensors
        swiglu = ctx.activation == "swiglu"
        need_x, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        grad_x = None
        if need_x:
            grad_x = torch.empty_like(x) if token_idx is None else torch.zeros_like(x)
        grad_weight = torch.empty_like(weight) if need_weight else None
        grad_w1, grad_w2 = torch.empty_like(w1), torch.empty_like(w2)
        grad_w3 = torch.empty_like(w3) if w3 is not None else None
        grads = [g for g in (grad_w1, grad_w3, grad_w2) if g is not None]
        seen: set[int] = set()

        def weight_grad(into: Tensor, a: Tensor, b: Tensor, e: int) -> None:
            # An expert's first run writes its gradient, later runs add to it.
            if e in seen:
                into[e].addmm_(a, b)
            else:
                torch.mm(a, b, out=into[e])

        for i, (e, start, end) in enumerate(ctx.segments):
            h1 = ctx.pre1.take(i)
            h3 = ctx.pre3.take(i) if swiglu else None
            act = _activate(ctx.activation, h1, h3)
            if token_idx is None:
                xe, grad = x[start:end], grad_out[start:end]
                grad_act = grad @ w2[e].t()
            else:
                idx, w = token_idx[start:end], weight[start:end, None]
                xe, grad = x.index_select(0, idx), grad_out.index_select(0, idx)
                grad_act = grad @ w2[e].t()
                if need_weight:
                    # d/dw <grad, w * act @ w2> = <grad @ w2.T, act>: no [N, d] output is kept.
                    torch.linalg.vecdot(grad_act, act, out=grad_weight[start:end])
                grad.mul_(w)
                grad_act.mul_(w)
            weight_grad(grad_w2, act.t(), grad, e)
            del act, grad
            if swiglu:
                grad_h3 = grad_act * nn.functional.silu(h1)
                grad_h1 = torch.ops.aten.silu_backward(grad_act.mul_(h3), h1)
                weight_grad(grad_w3, xe.t(), grad_h3, e)
            elif ctx.activation == "gelu":
                grad_h1 = torch.ops.aten.gelu_backward(grad_act, h1)
            else:
                grad_h1 = torch.ops.aten.threshold_backward(grad_act, h1, 0)
            del grad_act
            weight_grad(grad_w1, xe.t(), grad_h1, e)
            seen.add(e)
            if need_x:
                if token_idx is None:
                    grad_xe = torch.mm(grad_h1, w1[e].t(), out=grad_x[start:end])
                else:
                    grad_xe = grad_h1 @ w1[e].t()
                if swiglu:
                    grad_xe.addmm_(grad_h3, w3[e].t())
                if token_idx is not None:
                    grad_x.index_add_(0, token_idx[start:end], grad_xe)
                del grad_xe
            del xe, grad_h1, h1, h3
            if swiglu:
                del grad_h3
        for e in set(range(w1.shape[0])) - seen:
            for g in grads:
                g[e].zero_()
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
        return self._loop(rows.contiguous(), None, None, consecutive_segments(counts_list))

    def forward_tokens(self, x: Tensor, plan: DispatchPlan) -> Tensor:
        """``[T, d_model]`` tokens -> ``[T, d_model]``: each token's experts' outputs, weighted
        and summed as ``plan`` (a ``plan_dispatch`` result for these experts) says. Equal to
        ``combine(self(rows, ...), plan)`` on the gathered rows, without building them."""
        if self._use_grouped_mm(x) and plan.token_idx.numel() > 0:
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
        if self._use_grouped_mm(rows) and rows.shape[0] > 0:
            expert_of_row = torch.arange(self.num_experts, device=rows.device).repeat(block_counts.shape[0])
            row_expert = torch.repeat_interleave(expert_of_row, block_counts.reshape(-1).to(rows.device))
            by_expert = torch.sort(row_expert, stable=True).indices
            out = self._grouped_mm(rows.index_select(0, by_expert), block_counts.sum(dim=0).to(rows.device))
            return torch.empty_like(out).index_copy_(0, by_expert, out)
        flat = block_counts.reshape(-1).tolist()
        segments = [(i % self.num_experts, start, end) for i, start, end in consecutive_segments(flat)]
        return self._loop(rows.contiguous(), None, None, segments)

    def _loop(self, x: Tensor, token_idx: Tensor | None, weight: Tensor | None, segments: list[Segment]) -> Tensor:
        return _ExpertLoop.apply(x, token_idx, weight, segments, self.activation, self.w1, self.w3, self.w2)

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
