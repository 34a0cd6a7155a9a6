"""Micro-batch overlap of a block around an expert-parallel MoE layer: one micro-batch's
dense layers compute while another's rows travel.

A transformer block runs attention, then the MoE layer. The exchange needs attention's
output, so inside one batch the network idles while attention runs, and the cores idle
while the rows travel; chunking the exchange (``pipeline_degree``) hides only the experts'
own compute. Cut the block's batch into micro-batches of whole sequences and the dense
layers of one hide the exchange of another (`sparta.scheduling.overlapped_block`, fed here
by the layer's own router, experts and combine):

    attention 0 | attention 1 | experts 0 | experts 1 | combine 0 | combine 1   (this thread)
                | rows out 0  | rows out 1  | back 0    | back 1                (network)

DeepSeek-V3's DualPipe and SGLang's two-batch overlap pair two micro-batches this way; here
the count is given (``MoESpec.overlap``) or tuned (``pipeline_degree="auto"``).

Outputs and every gradient equal the plain block's, because each piece treats sequences
apart: attention per sequence, routing and experts per token. The one batch-wide term is the
balance loss, ``E * sum_e f_e * P_e`` over the whole batch: each micro-batch contributes its
tokens' probabilities weighted by the whole batch's fractions ``f``, which its backward
reads once every micro-batch has routed (`_WholeBatchBalance`); the z-loss, a mean over
tokens, is each micro-batch's share of it.

Dropless token-choice routing only (a capacity would drop per micro-batch, not per batch;
Soft MoE and expert choice mix tokens across the batch), on an expert-parallel layer without
expert tensor parallelism (`overlap_problem` says which).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sparta.errors import ConfigError
from sparta.moe.dispatch import DispatchPlan, combine, gather_rows, plan_dispatch
from sparta.moe.layer import MoELayer, stats_vector
from sparta.moe.routers.base import router_z_loss
from sparta.scheduling.microbatch import Routed, overlapped_block

Dense = Callable[[Tensor], tuple[Tensor, Tensor]]
"""dense(micro-batch [b, ...]) -> (residual, the MoE layer's input), both [b, ..., d_model]."""


def overlap_problem(layer: MoELayer) -> str | None:
    """Why ``layer`` cannot run under `overlapped_moe_block`, or None. Pure."""
    cfg = layer.config
    if layer.comm is None:
        return "it is not expert-parallel (ep_size 1), so there is no exchange to overlap"
    if cfg.router in ("soft", "expert_choice"):
        return f"router {cfg.router!r} chooses across the batch's tokens; use a token-choice router"
    if cfg.capacity_factor is not None:
        return f"capacity_factor={cfg.capacity_factor} would drop pairs per micro-batch, not per batch; use dropless"
    if layer.tp is not None:
        return "its experts' hidden units are split over tp (expert tensor parallelism)"
    return None


@dataclass
class _Batch:
    """The whole batch's routing, filled in as its micro-batches route."""

    tokens: int  # N: tokens in the batch
    num_experts: int
    counts: Tensor  # [E] float32: (token, expert) pairs routed to each expert so far
    probs: Tensor  # [E] float32: the routers' probabilities summed over tokens so far (detached)
    z: Tensor  # 0-dim float32: sum over tokens of logsumexp(logits)^2 so far (detached)
    plans: list[DispatchPlan] = field(default_factory=list)
    combined: int = 0  # micro-batches whose outputs `after` has combined


class _WholeBatchBalance(torch.autograd.Function):
    """``E * dot(f, share)`` with ``f`` the whole batch's expert fractions, which only exist
    once every micro-batch has routed: forward gives 0 (the value is reported from the
    totals, `overlapped_moe_block`), backward ``E * f`` (by then ``f`` is known)."""

    @staticmethod
    def forward(ctx: Any, share: Tensor, batch: _Batch) -> Tensor:
        ctx.batch = batch
        return share.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        b: _Batch = ctx.batch
        return grad * b.num_experts * b.counts / b.counts.sum().clamp(min=1), None


def overlapped_moe_block(
    layer: MoELayer, x: Tensor, microbatches: int, dense: Dense, params: Sequence[Tensor]
) -> Tensor:
    """``residual + layer(moe_input)``, with ``(residual, moe_input) = dense(piece)``, for
    each of ``microbatches`` cuts of ``x``'s dim 0 (``[B, ...]``, B >= microbatches),
    pipelined so that one cut's ``dense`` computes while another's rows travel: ``[B, ...,
    d_model]``, equal to the plain block (module doc). ``params``: every tensor ``dense``
    and the layer read that needs a gradient (a block's parameters); their gradients come
    back through autograd, summed over the cuts. Collective over the layer's exchange: every
    rank of it calls this with the same ``microbatches``. ConfigError where
    `overlap_problem` has one; `last_stats` and `aux_loss` are the whole batch's, as after
    a plain forward."""
    problem = overlap_problem(layer)
    if problem is not None:
        raise ConfigError(f"MoE layer {layer.name!r} cannot overlap micro-batches: {problem}")
    cfg, experts = layer.config, layer.experts
    exchange = layer.exchange or layer.comm
    assert exchange is not None
    device = experts.w1.device
    zeros = torch.zeros(cfg.num_experts, dtype=torch.float32, device=device)
    batch = _Batch(x.numel() // x.shape[-1], cfg.num_experts, zeros, zeros.clone(), zeros.new_zeros(()))
    stats: list[Tensor] = []

    def before(piece: Tensor) -> Routed:
        residual, h = dense(piece)
        tokens = h.reshape(-1, cfg.d_model)
        route = layer.router(tokens)
        assert route.expert_idx is not None and route.expert_ids is not None and route.weight is not None
        batch.counts += torch.bincount(route.expert_idx, minlength=cfg.num_experts).float()
        probs_sum, z_sum = route.probs.float().sum(0), router_z_loss(route.logits) * tokens.shape[0]
        batch.probs += probs_sum.detach()
        batch.z += z_sum.detach()
        balance = _WholeBatchBalance.apply(probs_sum / batch.tokens, batch)
        total = cfg.aux_loss_coef * balance + cfg.z_loss_coef * z_sum / batch.tokens
        weight = layer.attach_aux_loss(route.weight, total)
        plan = plan_dispatch(
            route.token_idx, route.expert_idx, weight, cfg.num_experts, None, route.expert_ids.shape[1]
        )
        batch.plans.append(plan)
        stats.append(stats_vector(plan))
        assert plan.weight is not None
        return Routed(gather_rows(tokens, plan), plan.counts, (residual, plan.weight))

    def compute(rows: Tensor, counts: Tensor) -> Tensor:
        return experts.forward_blocks(rows, counts.to(rows.device))

    def after(back: Tensor, side: tuple[Tensor, ...]) -> Tensor:
        residual, weight = side
        plan = dataclasses.replace(batch.plans[batch.combined], weight=weight)
        batch.combined += 1
        n = residual.numel() // cfg.d_model
        return residual + combine(back, plan, n).view(residual.shape)

    out = overlapped_block(x, microbatches, before, compute, after, exchange, params)
    layer.record_counts(torch.stack(stats).sum(0))
    fraction = batch.counts / batch.counts.sum().clamp(min=1)
    balance = cfg.num_experts * torch.dot(fraction, batch.probs / batch.tokens)
    layer.aux_loss = cfg.aux_loss_coef * balance + cfg.z_loss_coef * batch.z / batch.tokens
    return out
