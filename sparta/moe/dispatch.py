"""Dispatch: group token rows by expert; combine: put expert outputs back in token order.

Sparse routing is sort-based: the (token, expert) pairs are stably sorted by expert, the
token rows gathered in that order, and the outputs index-added back. Where every token has
exactly ``k`` pairs (token choice, dropless) the sort is a permutation of the ``T * k`` pairs,
and both directions are gathers by it or its inverse, forward and backward: no atomic
index-add (on an H200, bf16 index_add of 32k rows of 2048 took 0.56 ms, a tenth of the
layer's step beside its GEMMs), and deterministic. Memory is
``O(pairs * d_model)``, never a dense ``[tokens, experts, capacity]`` mask. Because the rows
come out grouped by expert, and an expert-parallel rank owns a contiguous range of experts,
they are also grouped by destination rank: the per-expert counts are the all-to-all splits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

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
    # dropless, ``k`` pairs a token (pair p is token p // k): ``inverse[p]`` is pair p's grouped
    # position, ``order`` its inverse ([N] each); None otherwise
    order: Tensor | None = None
    inverse: Tensor | None = None


@dataclass(kw_only=True)
class Dispatched(DispatchPlan):
    """A plan and its rows ``[N, d]``: expert 0's rows, then expert 1's, ... (row ``i`` is
    ``x[token_idx[i]]``). ``token_idx`` is the permutation that ``combine`` undoes."""

    rows: Tensor


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Pairs an expert may take: ``ceil(capacity_factor * num_tokens * top_k / num_experts)``,
    in exact arithmetic on the factor as written (1.1 x 100 x 2 / 4 is 55, where floats give
    55.00000000000001 and a ceiling of 56)."""
    return math.ceil(Fraction(str(capacity_factor)) * num_tokens * top_k / num_experts)


def plan_dispatch(
    token_idx: Tensor,
    expert_idx: Tensor,
    weight: Tensor,
    num_experts: int,
    capacity: int | None = None,
    pairs_per_token: int | None = None,
) -> DispatchPlan:
    """Group ``P`` (token, expert, weight) pairs by expert.

    Within an expert, pairs keep their order. With ``capacity``, each expert keeps its
    ``capacity`` highest-weight pairs (ties: earlier pair first) and the rest are dropped:
    their tokens get nothing from that expert. Dropless planning never synchronises with the
    host; a capacity does once (the number of pairs kept sizes the result).
    ``pairs_per_token``: the pairs are token-major, ``k`` a token (as token-choice routers
    make them), so a dropless plan is a permutation that `gather_rows` and `combine` invert
    by gathers (see the module docstring).
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
    inverse = None
    if capacity is None and pairs_per_token is not None:
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return DispatchPlan(
        counts=counts,
        routed=routed,
        dropped=routed.sum() - counts.sum(),
        token_idx=token_idx[order],
        weight=weight[order],
        order=order if inverse is not None else None,
        inverse=inverse,
    )


class _GatherPairs(torch.autograd.Function):
    """``x[src]`` where ``src`` reaches every row of ``x`` ``[T, d]`` exactly ``k`` times,
    pair ``p`` of row ``p // k`` at position ``inverse[p]``: backward gathers the gradient
    back by ``inverse`` and sums each row's ``k``, where index_select's backward index-adds."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, src: Tensor, inverse: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, src)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (inverse,) = ctx.saved_tensors
        per_pair = grad.index_select(0, inverse)
        summed = per_pair if ctx.k == 1 else per_pair.view(-1, ctx.k, grad.shape[1]).sum(1)
        return summed, None, None, None


def gather_rows(x: Tensor, plan: DispatchPlan) -> Tensor:
    """The rows of ``x`` ``[T, d]`` in the plan's grouped order, ``[N, d]``."""
    assert plan.token_idx is not None
    if plan.inverse is None or x.shape[0] == 0:
        return x.index_select(0, plan.token_idx)
    return _GatherPairs.apply(x, plan.token_idx, plan.inverse, plan.inverse.numel() // x.shape[0])


def dispatch(
    x: Tensor,
    token_idx: Tensor,
    expert_idx: Tensor,
    weight: Tensor,
    num_experts: int,
    capacity: int | None = None,
    pairs_per_token: int | None = None,
) -> Dispatched:
    """``plan_dispatch``, then gather the rows of ``x`` ``[T, d]`` in the planned order."""
    plan = plan_dispatch(token_idx, expert_idx, weight, num_experts, capacity, pairs_per_token)
    return Dispatched(**vars(plan), rows=gather_rows(x, plan))


def combine(expert_out: Tensor, plan: DispatchPlan, num_tokens: int) -> Tensor:
    """Weighted sum of each token's expert outputs, ``[num_tokens, d]``: row ``i`` of
    ``expert_out`` ``[N, d]`` (in the plan's order) times ``plan.weight[i]`` is added into
    token ``plan.token_idx[i]``. A token whose pairs were all dropped gets zeros."""
    assert plan.token_idx is not None and plan.weight is not None
    if plan.inverse is not None and plan.order is not None and num_tokens > 0:
        # each token's k outputs side by side: a gather by the inverse permutation, whose
        # gradient is the gather by the permutation itself
        k = plan.inverse.numel() // num_tokens
        per_token = _GatherPairs.apply(expert_out, plan.inverse, plan.order, 1).view(num_tokens, k, -1)
        weight = plan.weight.index_select(0, plan.inverse).to(expert_out.dtype).view(num_tokens, k, 1)
        return (per_token * weight).sum(1)
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
