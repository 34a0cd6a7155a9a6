"""Dispatch: group token rows by expert; combine: put expert outputs back in token order.

Sparse routing is sort-based: the (token, expert) pairs are stably sorted by expert, the
token rows gathered in that order, and the outputs index-added back. Memory is
``O(pairs * d_model)``, never a dense ``[tokens, experts, capacity]`` mask. Because the rows
come out grouped by expert, and an expert-parallel rank owns a contiguous range of experts,
they are also grouped by destination rank: the per-expert counts are the all-to-all splits.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class DispatchPlan:
    """Where the kept (token, expert) pairs go, grouped by expert.

    ``counts`` ``[E]`` int64 (and ``counts_list``, the same numbers on the host) says how
    many pairs each expert keeps; pair ``i`` of the grouped order comes from token
    ``token_idx[i]`` and is combined with weight ``weight[i]`` (both ``[N]``; None for Soft
    MoE, whose rows are slots). ``routed`` ``[E]`` int64 counts the pairs routed to each
    expert before capacity; ``dropped`` the pairs capacity removed.
    """

    counts: Tensor
    counts_list: list[int]
    routed: Tensor
    dropped: int
    token_idx: Tensor | None = None
    weight: Tensor | None = None


@dataclass(kw_only=True)
class Dispatched(DispatchPlan):
    """A plan and its rows ``[N, d]``: expert 0's rows, then expert 1's, ... (row ``i`` is
    ``x[token_idx[i]]``). ``token_idx`` is the permutation that ``combine`` undoes."""

    rows: Tensor


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Pairs an expert may take: ``ceil(capacity_factor * num_tokens * top_k / num_experts)``."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def plan_dispatch(
    token_idx: Tensor,
    expert_idx: Tensor,
    weight: Tensor,
    num_experts: int,
    capacity: int | None = None,
) -> DispatchPlan:
    """Group ``P`` (token, expert, weight) pairs by expert.

    Within an expert, pairs keep their order. With ``capacity``, each expert keeps its
    ``capacity`` highest-weight pairs (ties: earlier pair first) and the rest are dropped:
    their tokens get nothing from that expert.
    """
    routed = torch.bincount(expert_idx, minlength=num_experts)
    if capacity is None:
        order = torch.sort(expert_idx, stable=True).indices
        counts = routed
    else:
        by_weight = torch.sort(weight.detach(), descending=True, stable=True).indices
        sorted_experts, regroup = torch.sort(expert_idx[by_weight], stable=True)
        order = by_weight[regroup]
        first_of_expert = torch.cumsum(routed, 0) - routed
        rank_in_expert = torch.arange(order.numel(), device=order.device) - first_of_expert[sorted_experts]
        order = order[rank_in_expert < capacity]
        counts = routed.clamp(max=capacity)
    counts_list = counts.tolist()
    return DispatchPlan(
        counts=counts,
        counts_list=counts_list,
        routed=routed,
        dropped=expert_idx.numel() - sum(counts_list),
        token_idx=token_idx[order],
        weight=weight[order],
    )


def dispatch(
    x: Tensor,
    token_idx: Tensor,
    expert_idx: Tensor,
    weight: Tensor,
    num_experts: int,
    capacity: int | None = None,
) -> Dispatched:
    """``plan_dispatch``, then gather the rows of ``x`` ``[T, d]`` in the planned order."""
    plan = plan_dispatch(token_idx, expert_idx, weight, num_experts, capacity)
    return Dispatched(**vars(plan), rows=x.index_select(0, plan.token_idx))


# Rows the combine weighs, and the row-wise dot multiplies, at a time: their temporary stays
# in cache and comes from the heap's recycled memory, where an [N, d] one would take fresh
# pages (a fault per 4 KiB, each about a microsecond on a virtual machine) every step.
_CHUNK_BYTES = 512 << 10


def _chunks(rows: Tensor) -> Iterator[tuple[int, int, Tensor]]:
    """``(start, end, buffer)`` over the rows of ``rows`` ``[N, width]``, a few hundred KiB
    at a time; ``buffer`` is an ``[end - start, width]`` view of one buffer every chunk reuses."""
    step = max(1, _CHUNK_BYTES // max(1, rows.shape[1] * rows.element_size()))
    buffer = rows.new_empty(min(step, rows.shape[0]), rows.shape[1])
    for start in range(0, rows.shape[0], step):
        end = min(start + step, rows.shape[0])
        yield start, end, buffer[: end - start]


def rowwise_dot(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """``out[i] = <a[i], b[i]>`` for ``a``, ``b`` ``[N, k]`` (``torch.linalg.vecdot``, real
    tensors), multiplying a few hundred KiB of rows at a time into one small buffer."""
    out = a.new_empty(a.shape[0]) if out is None else out
    for start, end, product in _chunks(a):
        torch.sum(torch.mul(a[start:end], b[start:end], out=product), 1, out=out[start:end])
    return out


def weighted_index_add(out: Tensor, token_idx: Tensor, rows: Tensor, weight: Tensor) -> Tensor:
    """``out[token_idx[i]] += weight[i] * rows[i]`` in place (``rows`` ``[N, d]``, ``token_idx``
    and ``weight`` ``[N]``), weighing a few hundred KiB of rows at a time; returns ``out``."""
    for start, end, weighed in _chunks(rows):
        out.index_add_(0, token_idx[start:end], torch.mul(rows[start:end], weight[start:end, None], out=weighed))
    return out


class _WeightedCombine(torch.autograd.Function):
    """``out[token_idx[i]] += weight[i] * rows[i]``.

    Autograd's own graph for this (mul, index_add) allocates three ``[N, d]`` temporaries in
    backward; here the gathered gradient is reused in place and the weight gradient is a
    row-wise dot product, which on CPU saves a few percent of a whole MoE layer step. The
    forward weighs the rows a chunk at a time, so it allocates no ``[N, d]`` temporary.
    """

    @staticmethod
    def forward(ctx: Any, rows: Tensor, token_idx: Tensor, weight: Tensor, num_tokens: int) -> Tensor:
        ctx.save_for_backward(rows, token_idx, weight)
        return weighted_index_add(rows.new_zeros(num_tokens, rows.shape[1]), token_idx, rows, weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, Tensor | None, None]:
        rows, token_idx, weight = ctx.saved_tensors
        grad_rows = grad.index_select(0, token_idx)
        grad_weight = rowwise_dot(grad_rows, rows) if ctx.needs_input_grad[2] else None
        return grad_rows.mul_(weight.unsqueeze(1)), None, grad_weight, None


def combine(expert_out: Tensor, plan: DispatchPlan, num_tokens: int) -> Tensor:
    """Weighted sum of each token's expert outputs, ``[num_tokens, d]``: row ``i`` of
    ``expert_out`` ``[N, d]`` (in the plan's order) times ``plan.weight[i]`` is added into
    token ``plan.token_idx[i]``. A token whose pairs were all dropped gets zeros."""
    weight = plan.weight.to(expert_out.dtype)
    return _WeightedCombine.apply(expert_out, plan.token_idx, weight, num_tokens)


def soft_dispatch(x: Tensor, dispatch_weights: Tensor, num_experts: int) -> Dispatched:
    """Soft MoE: mix the tokens of each of ``G`` sequences ``x`` ``[G, L, d]`` into slots
    (``dispatch_weights`` ``[G, L, S]``) and group the ``G * S`` slots by expert."""
    slots = torch.bmm(dispatch_weights.transpose(1, 2).to(x.dtype), x)
    groups, num_slots, d = slots.shape
    slots_per_expert = num_slots // num_experts
    per_expert = groups * slots_per_expert
    rows = slots.view(groups, num_experts, slots_per_expert, d).transpose(0, 1).reshape(-1, d)
    counts = torch.full((num_experts,), per_expert, dtype=torch.int64, device=x.device)
    return Dispatched(rows=rows, counts=counts, counts_list=[per_expert] * num_experts, routed=counts, dropped=0)


def soft_combine(expert_out: Tensor, combine_weights: Tensor, num_experts: int) -> Tensor:
    """Soft MoE: each token's output, ``[G, L, d]``, as its ``combine_weights`` ``[G, L, S]``
    mix of the slot outputs (``expert_out``, grouped by expert as ``soft_dispatch`` made them)."""
    groups, _, num_slots = combine_weights.shape
    d = expert_out.shape[1]
    per_group = num_slots // num_experts
    slots = expert_out.view(num_experts, groups, per_group, d).transpose(0, 1).reshape(groups, num_slots, d)
    return torch.bmm(combine_weights.to(expert_out.dtype), slots)
