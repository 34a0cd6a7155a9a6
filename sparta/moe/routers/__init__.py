"""Routers: ``forward(x [T, d_model]) -> RouterOutput``, one class per routing rule.

``build_router(config)`` makes the one named by ``MoEConfig.router``.
"""

from __future__ import annotations

from sparta.moe.config import MoEConfig
from sparta.moe.routers.base import (
    LinearRouter,
    Router,
    RouterOutput,
    load_balancing_loss,
    router_z_loss,
)
from sparta.moe.routers.expert_choice import ExpertChoiceRouter
from sparta.moe.routers.sigmoid import SigmoidRouter
from sparta.moe.routers.soft import SoftRouter
from sparta.moe.routers.topk import SwitchRouter, TopKRouter, softmax_topk
from sparta.moe.routers.xmoe import XMoERouter


def build_router(config: MoEConfig) -> Router:
    """The router named by ``config.router``, sized by ``config``."""
    d, e, k = config.d_model, config.num_experts, config.top_k
    builders = {
        "topk": lambda: TopKRouter(d, e, k, jitter_eps=config.jitter_eps),
        "switch": lambda: SwitchRouter(d, e, jitter_eps=config.jitter_eps),
        "sigmoid": lambda: SigmoidRouter(d, e, k, bias_update_rate=config.bias_update_rate),
        "xmoe": lambda: XMoERouter(d, e, k, routing_dim=config.xmoe_dim),
        "expert_choice": lambda: ExpertChoiceRouter(d, e, k, config.capacity_factor),
        "soft": lambda: SoftRouter(d, e, slots_per_expert=config.slots_per_expert),
    }
    return builders[config.router]()


__all__ = [
    "ExpertChoiceRouter",
    "LinearRouter",
    "Router",
    "RouterOutput",
    "SigmoidRouter",
    "SoftRouter",
    "SwitchRouter",
    "TopKRouter",
    "XMoERouter",
    "build_router",
    "load_balancing_loss",
    "router_z_loss",
    "softmax_topk",
]
