"""Sigmoid routing with aux-loss-free balancing (DeepSeek-V3)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from sparta.moe.routers.base import LinearRouter, RouterOutput, token_choice_output

# Guards the weight normalisation when every chosen score underflows to 0.
_EPS = 1e-20


class SigmoidRouter(LinearRouter):
    """Independent sigmoid score per expert; each token keeps the ``k`` experts with the
    highest ``score + expert_bias`` and weights them by their scores normalised over the
    chosen ``k``.

    ``expert_bias`` (a buffer, no gradient) steers selection only, never the weights: after
    each training forward the layer reports the load and the bias moves by
    ``bias_update_rate * sign(mean_load - load_e)``, so over-loaded experts become less
    attractive without a loss term pulling on the router's representations.

    ``aux_loss`` is still computed (the balance formula with scores normalised per token as
    ``P``) for DeepSeek-V3's small complementary loss; set ``aux_loss_coef=0`` to rely on
    the bias alone. Under data parallelism the bias must see the same load on every
    replica: report a load summed over replicas, or synchronise the buffer. Not under
    activation recomputation: a recomputed forward would route with the bias its first
    forward already moved, and move it again (the trainer refuses recompute with it).
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, bias_update_rate: float = 1e-3) -> None:
        super().__init__(d_model, num_experts, top_k)
        self.bias_update_rate = bias_update_rate
        self.register_buffer("expert_bias", torch.zeros(num_experts))

    def forward(self, x: Tensor) -> RouterOutput:
        logits = self.logits(x)
        scores = torch.sigmoid(logits)
        expert_ids = torch.topk(scores.detach() + self.expert_bias, self.top_k, dim=-1).indices
        chosen = scores.gather(1, expert_ids)
        weights = chosen / (chosen.sum(dim=-1, keepdim=True) + _EPS)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + _EPS)
        return token_choice_output(logits, probs, expert_ids, weights)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> SigmoidRouter:
        # .to(bfloat16) would round away bias steps of 1e-3 once |bias| > ~0.25: keep float32.
        super()._apply(fn, recurse)
        self.expert_bias = self.expert_bias.float()
        return self

    @torch.no_grad()
    def update_load(self, load: Tensor) -> None:
        """Move each expert's bias against its load ``[num_experts]`` (tokens routed there): up when under the mean,
        down when over."""
        load = load.to(self.expert_bias.dtype)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
