"""X-MoE routing: cosine similarity in a low-dimensional routing space."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from sparta.moe.routers.base import Router, RouterOutput
from sparta.moe.routers.topk import softmax_topk

# X-MoE's initial temperature; the floor keeps a diverging temperature from dividing by ~0.
_INIT_TEMPERATURE = 0.07
_MIN_TEMPERATURE = 1e-2


class XMoERouter(Router):
    """X-MoE (Chi et al., 2022): tokens are projected to ``routing_dim`` features and
    L2-normalised, expert embeddings are L2-normalised, and the logits are their cosine
    similarities divided by a learned temperature; then softmax top-k (``softmax_topk``).

    Routing on a low-dimensional sphere keeps the expert embeddings from collapsing onto
    the dominant directions of the token representations.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, routing_dim: int = 16) -> None:
        super().__init__(d_model, num_experts, top_k)
        self.proj = nn.Linear(d_model, routing_dim, bias=False)
        self.expert_embeddings = nn.Parameter(torch.empty(num_experts, routing_dim))
        self.temperature = nn.Parameter(torch.tensor(_INIT_TEMPERATURE))
        nn.init.normal_(self.expert_embeddings, std=1.0 / math.sqrt(routing_dim))

    def logits(self, x: Tensor) -> Tensor:
        """Cosine similarity of the projected tokens and the expert embeddings over the temperature, ``[T,
        num_experts]``."""
        projected = nn.functional.linear(x.float(), self.proj.weight.float())
        tokens = nn.functional.normalize(projected, dim=-1)
        experts = nn.functional.normalize(self.expert_embeddings.float(), dim=-1)
        logits = tokens @ experts.t() / self.temperature.float().clamp(min=_MIN_TEMPERATURE)
        return logits

    def forward(self, x: Tensor) -> RouterOutput:
        return softmax_topk(self.logits(x), self.top_k)
