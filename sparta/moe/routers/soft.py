"""Soft MoE (Puigcerver et al., 2023): experts process weighted averages of tokens."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from sparta.moe.routers.base import Router, RouterOutput


class SoftRouter(Router):
    """Each of ``S = num_experts * slots_per_expert`` slots is a convex combination of the
    tokens of one sequence (dispatch weights: softmax over tokens, per slot); each token's
    output is a convex combination of the slots' outputs (combine weights: softmax over
    slots, per token). Slots ``[e * slots_per_expert, (e + 1) * slots_per_expert)`` belong
    to expert ``e``.

    Input ``[G, L, d]`` is ``G`` independent sequences of ``L`` tokens; ``[T, d]`` is one.
    It is NOT causal: every slot mixes all tokens of its sequence, so a token's output
    depends on later tokens; use it in encoders, not in autoregressive decoders. It never
    drops tokens and has no balance loss (every slot is used); ``aux_loss`` and ``z_loss``
    are 0.
    """

    def __init__(self, d_model: int, num_experts: int, slots_per_expert: int = 1) -> None:
        super().__init__(d_model, num_experts, top_k=1)
        self.slots_per_expert = slots_per_expert
        num_slots = num_experts * slots_per_expert
        self.slot_embeddings = nn.Parameter(torch.empty(num_slots, d_model))
        nn.init.normal_(self.slot_embeddings, std=1.0 / math.sqrt(d_model))

    def forward(self, x: Tensor) -> RouterOutput:
        groups = x if x.dim() == 3 else x.unsqueeze(0)
        logits = nn.functional.linear(groups.float(), self.slot_embeddings.float())
        combine = torch.softmax(logits, dim=2)
        zero = logits.new_zeros(())
        return RouterOutput(
            logits=logits,
            probs=combine,
            aux_loss=zero,
            z_loss=zero,
            dispatch_weights=torch.softmax(logits, dim=1),
            combine_weights=combine,
        )
