"""Token-choice softmax routers: top-k (GShard) and its top-1 special case (Switch)."""

from __future__ import annotations

import torch
from torch import Tensor

from sparta.moe.routers.base import LinearRouter, RouterOutput, token_choice_output


def softmax_topk(logits: Tensor, top_k: int) -> RouterOutput:
    """Softmax over experts, each token keeps its ``top_k`` most probable experts.

    For ``top_k > 1`` the kept probabilities are renormalised to sum to 1 per token; for
    ``top_k = 1`` the raw probability is the weight, so the router still gets a task gradient.
    """
    probs = torch.softmax(logits, dim=-1)
    top_probs, expert_ids = torch.topk(probs, top_k, dim=-1)
    weights = top_probs
    if top_k > 1:
        weights = top_probs / top_probs.sum(dim=-1, keepdim=True)
    return token_choice_output(logits, probs, expert_ids, weights)


class TopKRouter(LinearRouter):
    """GShard top-k routing over a linear gate (see ``softmax_topk``).

    In training, ``jitter_eps > 0`` multiplies the router input by noise drawn uniformly
    from ``[1 - eps, 1 + eps]`` (Switch), which spreads tokens over experts early on.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, jitter_eps: float = 0.0) -> None:
        super().__init__(d_model, num_experts, top_k)
        self.jitter_eps = jitter_eps

    def forward(self, x: Tensor) -> RouterOutput:
        if self.training and self.jitter_eps > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
        return softmax_topk(self.logits(x), self.top_k)


class SwitchRouter(TopKRouter):
    """Switch Transformer routing: every token goes to its single most probable expert,
    weighted by that probability."""

    def __init__(self, d_model: int, num_experts: int, jitter_eps: float = 0.0) -> None:
        super().__init__(d_model, num_experts, top_k=1, jitter_eps=jitter_eps)
