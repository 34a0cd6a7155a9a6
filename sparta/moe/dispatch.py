"""Dispatch: group token rows by expert; combine: put expert outputs back in token order.

Sparse routing is sort-based: the (token, expert) pairs are stably sorted by expert, the
token rows gathered in that order, and the outputs index-added back. Memory is
``O(pairs * d_model)``, never a dense ``[tokens, experts, capacity]`` mask. Because the rows
come out grouped by expert, and an expert-parallel rank owns a contiguous range of experts,
they are also grouped by destination rank: the per-expert counts are the all-to-all splits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class DispatchPlan:
    """Where the kept (token, expert) pairs go, grouped by expert.

    ``counts`` ``[E]`` int64 says how many pairs each expert keeps; pair ``i`` of the grouped
    order comes from token ``token_idx[i]`` and is combined with weight ``weight[i]`` (both
    ``[N]``; None for Soft MoE, whose rows are slots). ``routed`` ``[E]`` int64 counts the
    pairs routed to each expert before capacity; ``dropped`` (a 0-dim int64 tensor) the pairs
    capacity removed. Every tensor lives on the routed tokens' device.
    """

    counts: Tensor
    routed: Tensor
    dropped: Tensor
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
    their tokens get nothing from that expert. Dropless planning never synchronises with the
    host; a capacity does once (the number of pairs kept sizes the result).
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
    return DispatchPlan(
        counts=counts,
        routed=routed,
        dropped=routed.sum() - counts.sum(),
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
    assert plan.token_idx is not None
    return Dispatched(**vars(plan), rows=x.index_select(0, plan.token_idx))


def combine(expert_out: Tensor, plan: DispatchPlan, num_tokens: int) -> Tensor:
    """Weighted sum of each token's expert outputs, ``[num_tokens, d]``: row ``i`` of
    ``expert_out`` ``[N, d]`` (in the plan's order) times ``plan.weight[i]`` is added into
    token ``plan.token_idx[i]``. A token whose pairs were all dropped gets zeros."""
    assert plan.token_idx is not None and plan.weight is not None
    weighted = expert_out * plan.weight.to(expert_out.dtype).unsqueeze(1)
    return expert_out.new_zeros(num_tokens, expert_out.shape[1]).index_add(0, plan.token_idx, weighted)


def soft_dispatch(x: Tensor, dispatch_weights: Tensor, num_experts: int) -> Dispatched:
    """Soft MoE: mix the tokens of each of ``G`` sequences ``x`` ``[G, L, d]`` into slots
    (``dispatch_weights`` ``[G, L, S]``) and group the ``G * S`` slots by expert."""
    slots = torch.bmm(dispatch_weights.transpose(1, 2).to(x.dtype), x)
    groups, num_slots, d = slots.shape
    slots_per_expert = num_slots // num_experts
    per_expert = groups * slots_per_expert
    rows = slots.view(groups, num_experts, slots_per_expert, d).transpose(0, 1).reshape(-1, d)
    counts = torch.full((num_experts,), per_expert, dtype=torch.int64, device=x.device)
    return Dispatched(rows=rows, counts=counts, routed=counts, dropped=counts.new_zeros(()))


def soft_combine(expert_out: Tensor, combine_weights: Tensor, num_experts: int) -> Tensor:
    """Soft MoE: each token's output, ``[G, L, d]``, as its ``combine_weights`` ``[G, L, S]``
    mix of the slot outputs (``expert_out``, grouped by expert as ``soft_dispatch`` made them)."""
    groups, _, num_slots = combine_weights.shape
    d = expert_out.shape[1]
    per_group = num_slots // num_experts
    slots = expert_out.view(num_experts, groups, per_group, d).transpose(0, 1).reshape(groups, num_slots, d)
    return torch.bmm(combine_weights.to(expert_out.dtype), slots)
