"""The router interface: what every router returns, and the losses routers share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class RouterOutput:
    """Routing decisions for ``T`` tokens over ``E`` experts.

    Sparse routers describe their decisions as ``P`` flat (token, expert, weight) pairs, so
    token-choice routers (``P = T * k``) and expert choice (``P = E * C``, a token may be
    picked by 0..E experts) go through the same dispatch. Token-choice routers also fill
    ``expert_ids`` / ``weights`` ``[T, k]``, the same pairs laid out per token.

    Soft MoE has no pairs: it fills ``dispatch_weights`` (softmax over tokens, per slot) and
    ``combine_weights`` (softmax over slots, per token), both ``[G, L, S]`` for ``G``
    sequences of ``L`` tokens and ``S = num_experts * slots_per_expert`` slots.

    ``aux_loss`` and ``z_loss`` are unscaled float32 scalars in the graph; the layer
    multiplies them by their coefficients.
    """

    logits: Tensor
    probs: Tensor
    aux_loss: Tensor
    z_loss: Tensor
    token_idx: Tensor | None = None
    expert_idx: Tensor | None = None
    weight: Tensor | None = None
    expert_ids: Tensor | None = None
    weights: Tensor | None = None
    dispatch_weights: Tensor | None = None
    combine_weights: Tensor | None = None


def load_balancing_loss(probs: Tensor, expert_idx: Tensor, num_experts: int) -> Tensor:
    """GShard / Switch balance loss ``E * sum_e f_e * P_e``.

    ``f_e`` is the fraction of the ``P`` routed (token, expert) pairs that chose expert ``e``
    (counted before any capacity drop) and ``P_e`` the mean router probability of ``e``.
    Its minimum, 1, is reached by uniform routing.
    """
    pairs = expert_idx.numel()
    if pairs == 0:
        return probs.sum() * 0.0
    fraction = torch.bincount(expert_idx, minlength=num_experts).to(probs.dtype) / pairs
    return num_experts * torch.dot(fraction, probs.mean(dim=0))


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE z-loss ``mean_t logsumexp(logits_t)^2``: keeps logits small so that float32
    softmax and bfloat16 casts stay exact."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits, dim=-1).square().mean()


def topk_pairs(expert_ids: Tensor, weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Flatten ``[T, k]`` choices into token-major (token, expert, weight) pairs."""
    num_tokens, k = expert_ids.shape
    token_idx = torch.arange(num_tokens, device=expert_ids.device).repeat_interleave(k)
    return token_idx, expert_ids.reshape(-1), weights.reshape(-1)


def token_choice_output(logits: Tensor, probs: Tensor, expert_ids: Tensor, weights: Tensor) -> RouterOutput:
    """The ``RouterOutput`` of a token-choice router: each token's ``[T, k]`` chosen experts
    and weights, with the balance loss over ``probs`` ``[T, E]`` and the z-loss of ``logits``."""
    token_idx, expert_idx, weight = topk_pairs(expert_ids, weights)
    return RouterOutput(
        logits=logits,
        probs=probs,
        aux_loss=load_balancing_loss(probs, expert_idx, logits.shape[-1]),
        z_loss=router_z_loss(logits),
        token_idx=token_idx,
        expert_idx=expert_idx,
        weight=weight,
        expert_ids=expert_ids,
        weights=weights,
    )


class Router(nn.Module):
    """Base class: ``forward(x [T, d_model]) -> RouterOutput``.

    ``name`` identifies the owning layer in error messages; the layer (or ``moeify``) sets it.
    Routing runs in float32 whatever the input dtype: bfloat16 logits tie and overflow.
    Non-finite logits propagate as in any torch layer: checking them would make every
    forward wait for the device.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.num_experts = num_experts
        self.top_k = top_k
        self.name = "moe"

    def forward(self, x: Tensor) -> RouterOutput:
        raise NotImplementedError

    def update_load(self, load: Tensor) -> None:
        """Receive the (token, expert) pairs each expert got in the last training forward,
        ``[E]`` int64. Only routers that balance without a loss use it."""


class LinearRouter(Router):
    """A router whose logits are ``x @ gate.T`` with ``gate`` an ``nn.Linear(d, E)``."""

    def __init__(self, d_model: int, num_experts: int, top_k: int) -> None:
        super().__init__(d_model, num_experts, top_k)
        self.gate = nn.Linear(d_model, num_experts, bias=False)

    def logits(self, x: Tensor) -> Tensor:
        """Router logits ``[T, num_experts]`` in float32 for tokens ``x [T, d_model]``."""
        logits = nn.functional.linear(x.float(), self.gate.weight.float())
        return logits
