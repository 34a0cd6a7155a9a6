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

Node-deduplicated dispatch (``dedup``, `_Dedup`) sends each token across to a node once, its
k weights and the node's expert slots (small integers, exact in the rows' dtype: up to 256
experts a node in bfloat16) in the same row, so that no message of its own queues behind the
transfers in flight; the relay there sends one row per pair inside the node, and sums the
weighted outputs before the one row goes back. Where the link is the bottleneck that pays
(the emulated 2-node cluster at 100 Mbit/s: one block's step 0.73 -> 0.62 s); where the
cores are, the relay's extra hop costs as much as it saves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sparta.comm import HierarchicalAllToAll, all_to_all
from sparta.errors import ConfigError
from sparta.moe.dispatch import DispatchPlan, combine, gather_rows, plan_dispatch
from sparta.moe.layer import MoELayer, stats_vector
from sparta.moe.routers.base import RouterOutput, router_z_loss
from sparta.scheduling.microbatch import Routed, overlapped_block
from sparta.scheduling.pipeline import exchange_counts

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
    """The whole batch's routing, filled in as its micro-batches route, and what each
    micro-batch leaves for the steps after its exchange (index i: micro-batch i)."""

    tokens: int  # N: tokens in the batch
    num_experts: int
    counts: Tensor  # [E] float32: (token, expert) pairs routed to each expert so far
    probs: Tensor  # [E] float32: the routers' probabilities summed over tokens so far (detached)
    z: Tensor  # 0-dim float32: sum over tokens of logsumexp(logits)^2 so far (detached)
    plans: list[DispatchPlan] = field(default_factory=list)  # flat: each micro-batch's dispatch
    sent: list[Tensor] = field(default_factory=list)  # dedup: each micro-batch's token per row sent
    combined: int = 0  # micro-batches `after` has combined


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
    layer: MoELayer,
    x: Tensor,
    microbatches: int,
    dense: Dense,
    params: Sequence[Tensor],
    dedup: HierarchicalAllToAll | None = None,
) -> Tensor:
    """``residual + layer(moe_input)``, with ``(residual, moe_input) = dense(piece)``, for
    each of ``microbatches`` cuts of ``x``'s dim 0 (``[B, ...]``, B >= microbatches),
    pipelined so that one cut's ``dense`` computes while another's rows travel: ``[B, ...,
    d_model]``, equal to the plain block (module doc). ``params``: every tensor ``dense``
    and the layer read that needs a gradient (a block's parameters); their gradients come
    back through autograd, summed over the cuts.

    ``dedup``: a two-level all-to-all over the layer's ``comm`` (its nodes x local ranks):
    each token crosses to each node that holds one of its experts once, to the rank of its
    own local index there, which hands its rows to the experts' ranks on that node and sums
    their weighted outputs before the one row goes back (DeepEP's node-deduplicated
    dispatch; the node's share of the combine moves to it). With top-2 of 8 experts over 2
    nodes that is about a fifth fewer rows across nodes.

    Collective over the layer's exchange (``dedup``'s groups with it): every rank of it
    calls this with the same ``microbatches`` and ``dedup``. ConfigError where
    `overlap_problem` has one; `last_stats` and `aux_loss` are the whole batch's, as after a
    plain forward."""
    problem = overlap_problem(layer)
    if problem is None and dedup is not None and list(dedup.ranks) != list(layer.comm.ranks):  # type: ignore[union-attr]
        problem = f"dedup spans world ranks {list(dedup.ranks)}, not the expert-parallel group's"
    if problem is not None:
        raise ConfigError(f"MoE layer {layer.name!r} cannot overlap micro-batches: {problem}")
    cfg = layer.config
    zeros = torch.zeros(cfg.num_experts, dtype=torch.float32, device=layer.experts.w1.device)
    batch = _Batch(x.numel() // x.shape[-1], cfg.num_experts, zeros, zeros.clone(), zeros.new_zeros(()))
    stats: list[Tensor] = []

    def route(tokens: Tensor) -> tuple[RouterOutput, Tensor]:
        """The router on a micro-batch's tokens [T, d]: its output, and its pairs' weights
        [T * k] carrying the micro-batch's share of the aux and z losses."""
        out = layer.router(tokens)
        assert out.expert_idx is not None and out.weight is not None
        routed = torch.bincount(out.expert_idx, minlength=cfg.num_experts)
        stats.append(stats_vector(routed, routed, routed.new_zeros(())))  # dropless: all kept
        batch.counts += routed.float()
        probs_sum, z_sum = out.probs.float().sum(0), router_z_loss(out.logits) * tokens.shape[0]
        batch.probs += probs_sum.detach()
        batch.z += z_sum.detach()
        balance = _WholeBatchBalance.apply(probs_sum / batch.tokens, batch)
        total = cfg.aux_loss_coef * balance + cfg.z_loss_coef * z_sum / batch.tokens
        return out, layer.attach_aux_loss(out.weight, total)

    # the flat exchange spans the layer's group: its counts carry the load summed over it,
    # with no all-reduce of its own (one round trip a layer, behind the rows in flight)
    carry = dedup is None and layer.stats_comm is layer.comm
    summed: list[Tensor] = []
    if dedup is None:
        pieces: _Flat | _Dedup = _Flat(layer, batch, dense, route, stats if carry else None)
    else:
        pieces = _Dedup(layer, batch, dense, route, dedup)
    exchange = (layer.exchange or layer.comm) if dedup is None else dedup.inter
    assert exchange is not None
    into = summed if carry else None
    out = overlapped_block(x, microbatches, pieces.before, pieces.compute, pieces.after, exchange, params, carried=into)
    local = torch.stack(stats).sum(0)
    # the carry came back through the host: the router's state may live on a GPU
    layer.record_counts(local, torch.stack(summed).sum(0).to(local.device) if carry else None)
    fraction = batch.counts / batch.counts.sum().clamp(min=1)
    balance = cfg.num_experts * torch.dot(fraction, batch.probs / batch.tokens)
    layer.aux_loss = cfg.aux_loss_coef * balance + cfg.z_loss_coef * batch.z / batch.tokens
    return out


Route = Callable[[Tensor], tuple[RouterOutput, Tensor]]


class _Flat:
    """Rows to their experts' ranks directly, one per (token, expert) pair, as the layer's
    own forward sends them; the combine at home."""

    def __init__(self, layer: MoELayer, batch: _Batch, dense: Dense, route: Route, stats: list[Tensor] | None) -> None:
        self.layer, self.batch, self.dense, self.route = layer, batch, dense, route
        self.stats = stats  # where given, each micro-batch's load rides with its counts

    def before(self, piece: Tensor) -> Routed:
        cfg = self.layer.config
        residual, h = self.dense(piece)
        tokens = h.reshape(-1, cfg.d_model)
        out, weight = self.route(tokens)
        assert out.expert_ids is not None
        plan = plan_dispatch(out.token_idx, out.expert_idx, weight, cfg.num_experts, None, out.expert_ids.shape[1])  # type: ignore[arg-type]
        self.batch.plans.append(plan)
        assert plan.weight is not None
        carry = self.stats[-1] if self.stats is not None else None
        return Routed(gather_rows(tokens, plan), plan.counts, (residual, plan.weight), carry)

    def compute(self, rows: Tensor, counts: Tensor) -> Tensor:
        return self.layer.experts.forward_blocks(rows, counts.to(rows.device))

    def after(self, back: Tensor, side: tuple[Tensor, ...]) -> Tensor:
        residual, weight = side
        plan = dataclasses.replace(self.batch.plans[self.batch.combined], weight=weight)
        self.batch.combined += 1
        n = residual.numel() // self.layer.config.d_model
        return residual + combine(back, plan, n).view(residual.shape)


class _Dedup:
    """One row per (token, node holding one of its experts) across nodes, to the rank of the
    sender's local index there (the relay), with the token's k weights beside it (zero for
    experts elsewhere); the relay sends a row per pair to the node's experts, sums their
    weighted outputs, and one row goes back, which the sender adds up over nodes."""

    def __init__(self, layer: MoELayer, batch: _Batch, dense: Dense, route: Route, hier: HierarchicalAllToAll) -> None:
        self.layer, self.batch, self.dense, self.route, self.hier = layer, batch, dense, route, hier
        per_rank = layer.config.num_local_experts
        owner = [hier.position[e // per_rank] for e in range(layer.config.num_experts)]  # (node, local) per expert
        device = layer.experts.w1.device
        self.node_of = torch.tensor([n for n, _ in owner], device=device)
        # an expert's slot among its node's: its rank's local index, then its own index there
        self.slot_of = torch.tensor([lo * per_rank + e % per_rank for e, (_, lo) in enumerate(owner)], device=device)
        exact = round(2 / torch.finfo(layer.experts.w1.dtype).eps)  # integers a float holds exactly: 2^(mantissa + 1)
        if hier.local_size * per_rank > exact:
            raise ConfigError(
                f"MoE layer {layer.name!r}: dedup numbers a node's {hier.local_size * per_rank} experts in the rows' "
                f"{layer.experts.w1.dtype}, exact only up to {exact}: leave dedup off, or use fewer experts per node"
            )

    def before(self, piece: Tensor) -> Routed:
        d, nodes = self.layer.config.d_model, self.hier.num_nodes
        residual, h = self.dense(piece)
        tokens = h.reshape(-1, d)
        out, weight = self.route(tokens)
        ids = out.expert_ids
        assert ids is not None
        k = ids.shape[1]
        node = self.node_of[ids]  # [T, k]
        need = torch.zeros(tokens.shape[0], nodes, dtype=torch.bool, device=tokens.device)
        need.scatter_(1, node, True)
        to_node, token = need.t().nonzero(as_tuple=True)  # by node, then token
        here = node.index_select(0, token) == to_node.unsqueeze(1)  # [R, k]: the pairs on that node
        pair_weight = weight.view(-1, k).index_select(0, token) * here
        # which of the node's experts each pair is for, -1 for none, as exact small integers in
        # the rows' dtype: in the rows, not a message of their own, which would queue behind
        # the transfers in flight on the same group
        slots = torch.where(here, self.slot_of[ids].index_select(0, token), -1).to(tokens.dtype)
        rows = torch.cat([tokens.index_select(0, token), pair_weight.to(tokens.dtype), slots], 1)  # [R, d + 2k]
        self.batch.sent.append(token)
        return Routed(rows, torch.bincount(to_node, minlength=nodes), (residual,))

    def compute(self, rows: Tensor, counts: Tensor) -> Tensor:
        """At the relay: ``rows`` [M, d + 2k] from each node's sender of this local index ->
        [M, d], each row its experts' weighted outputs on this node."""
        hier, experts = self.hier, self.layer.experts
        d, per_rank, local = self.layer.config.d_model, self.layer.config.num_local_experts, hier.local_size
        k = (rows.shape[1] - d) // 2
        slots = rows[:, d + k :].detach().round().long()
        row, pair = (slots >= 0).nonzero(as_tuple=True)
        slot = slots[row, pair]
        order = torch.sort(slot, stable=True).indices  # by local rank, then its expert
        row, pair, slot = row[order], pair[order], slot[order]
        mine = torch.bincount(slot, minlength=local * per_rank).cpu()
        theirs = exchange_counts(mine, hier.intra)[0].view(local, per_rank)
        out_splits, in_splits = mine.view(local, per_rank).sum(1).tolist(), theirs.sum(1).tolist()
        got = all_to_all(rows[:, :d].index_select(0, row), out_splits, in_splits, hier.intra, check=False)
        done = experts.forward_blocks(got, theirs.to(rows.device))
        back = all_to_all(done, in_splits, out_splits, hier.intra, check=False)
        weighted = back * rows[:, d : d + k][row, pair].unsqueeze(1)
        return rows.new_zeros(rows.shape[0], d).index_add(0, row, weighted)

    def after(self, back: Tensor, side: tuple[Tensor, ...]) -> Tensor:
        (residual,) = side
        token = self.batch.sent[self.batch.combined]
        self.batch.combined += 1
        n = residual.numel() // self.layer.config.d_model
        return residual + back.new_zeros(n, back.shape[1]).index_add(0, token, back).view(residual.shape)
