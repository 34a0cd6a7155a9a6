"""Expert-choice routing (Zhou et al., 2022): experts pick tokens."""

from __future__ import annotations

import torch
from torch import Tensor

from sparta.moe.dispatch import expert_capacity
from sparta.moe.routers.base import LinearRouter, RouterOutput, router_z_loss


class ExpertChoiceRouter(LinearRouter):
    """Each expert takes the ``C`` tokens with the highest softmax probability for it,
    ``C = min(T, ceil(capacity_factor * T * k / E))`` (``capacity_factor`` None means 1).

    Load is perfectly balanced by construction (no aux loss; ``aux_loss`` is 0), nothing is
    dropped by capacity, but a token may be processed by 0..E experts. It is NOT causal:
    whether a token is picked depends on the other tokens of the batch, so it leaks future
    tokens in autoregressive training and changes under batch composition at inference.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, capacity_factor: float | None = None) -> None:
        super().__init__(d_model, num_experts, top_k)
        self.capacity_factor = 1.0 if capacity_factor is None else capacity_factor

    def capacity(self, num_tokens: int) -> int:
        """Tokens each expert picks from a batch of ``num_tokens``."""
        return min(num_tokens, expert_capacity(num_tokens, self.top_k, self.num_experts, self.capacity_factor))

    def forward(self, x: Tensor) -> RouterOutput:
        logits = self.logits(x)
        probs = torch.softmax(logits, dim=-1)
        per_expert = self.capacity(x.shape[0])
        weight, token_idx = torch.topk(probs.t(), per_expert, dim=1)
        expert_idx = torch.arange(self.num_experts, device=x.device).repeat_interleave(per_expert)
        return RouterOutput(
            logits=logits,
            probs=probs,
            aux_loss=logits.new_zeros(()),
            z_loss=router_z_loss(logits),
            token_idx=token_idx.reshape(-1),
            expert_idx=expert_idx,
            weight=weight.reshape(-1),
        )
