"""A naive MoE written independently of sparta.moe: dense [tokens, experts] gate matrices,
boolean masks and a Python loop over experts. It reads the layer's parameters, so its
output and gradients must equal the layer's."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from sparta.moe import MoELayer


def expert_mlp(layer: MoELayer, e: int, rows: Tensor) -> Tensor:
    experts = layer.experts

    def linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return x @ w[e] if b is None else x @ w[e] + b[e]

    hidden = linear(rows, experts.w1, experts.b1)
    if layer.config.activation == "swiglu":
        hidden = nn.functional.silu(hidden) * linear(rows, experts.w3, experts.b3)
    elif layer.config.activation == "gelu":
        hidden = nn.functional.gelu(hidden)
    elif layer.config.activation == "gelu_tanh":
        hidden = nn.functional.gelu(hidden, approximate="tanh")
    elif layer.config.activation == "silu":
        hidden = nn.functional.silu(hidden)
    else:
        hidden = nn.functional.relu(hidden)
    return linear(hidden, experts.w2, experts.b2)


def balance_loss(probs: Tensor, chosen: Tensor) -> Tensor:
    """E * sum_e f_e * P_e with f from the boolean [T, E] choice matrix."""
    fraction = chosen.float().sum(0) / chosen.sum()
    return probs.shape[1] * (fraction * probs.mean(0)).sum()


def z_loss(logits: Tensor) -> Tensor:
    return (torch.log(torch.exp(logits).sum(-1)) ** 2).mean()


def route(layer: MoELayer, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(gates [T, E] combine weight of every chosen pair, 0 elsewhere; aux; z)."""
    cfg, router = layer.config, layer.router
    num_tokens, num_experts, k = tokens.shape[0], cfg.num_experts, cfg.top_k
    if cfg.router == "xmoe":
        t = nn.functional.normalize(tokens @ router.proj.weight.t(), dim=-1)
        emb = nn.functional.normalize(router.expert_embeddings, dim=-1)
        logits = t @ emb.t() / router.temperature
    else:
        logits = tokens @ router.gate.weight.t()
    if cfg.router == "expert_choice":
        probs = logits.softmax(-1)
        per_expert = min(num_tokens, math.ceil((cfg.capacity_factor or 1.0) * num_tokens * k / num_experts))
        columns = []
        for e in range(num_experts):
            picked = probs[:, e].argsort(descending=True, stable=True)[:per_expert]
            mask = torch.zeros(num_tokens, dtype=torch.bool)
            mask[picked] = True
            columns.append(torch.where(mask, probs[:, e], 0.0))
        gates = torch.stack(columns, dim=1)
        return gates, torch.zeros(()), z_loss(logits)
    if cfg.router == "sigmoid":
        scores = torch.sigmoid(logits)
        ids = (scores + router.expert_bias).topk(k, dim=-1).indices
        chosen = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, ids, True)
        picked = torch.where(chosen, scores, 0.0)
        gates = picked / picked.sum(-1, keepdim=True)
        probs = scores / scores.sum(-1, keepdim=True)
        return gates, balance_loss(probs, chosen), z_loss(logits)
    probs = logits.softmax(-1)
    ids = probs.topk(k, dim=-1).indices
    chosen = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, ids, True)
    picked = torch.where(chosen, probs, 0.0)
    gates = picked / picked.sum(-1, keepdim=True) if k > 1 else picked
    return gates, balance_loss(probs, chosen), z_loss(logits)


def apply_capacity(gates: Tensor, capacity: int) -> Tensor:
    """Each expert keeps its `capacity` highest-weight tokens (ties: lower token first)."""
    kept = torch.zeros_like(gates, dtype=torch.bool)
    for e in range(gates.shape[1]):
        candidates = [t for t in range(gates.shape[0]) if gates[t, e] > 0]
        candidates.sort(key=lambda t: -gates[t, e].item())
        kept[candidates[:capacity], e] = True
    return torch.where(kept, gates, 0.0)


def sparse_forward(layer: MoELayer, x: Tensor) -> tuple[Tensor, Tensor]:
    cfg = layer.config
    tokens = x.reshape(-1, cfg.d_model)
    gates, aux, z = route(layer, tokens)
    if cfg.capacity_factor is not None and cfg.router != "expert_choice":
        pairs = tokens.shape[0] * cfg.top_k
        gates = apply_capacity(gates, math.ceil(cfg.capacity_factor * pairs / cfg.num_experts))
    y = torch.zeros_like(tokens)
    for e in range(cfg.num_experts):
        mask = gates[:, e] > 0
        if mask.any():
            contribution = gates[mask, e].unsqueeze(1) * expert_mlp(layer, e, tokens[mask])
            y = y.index_put((mask,), contribution, accumulate=True)
    return y.view(x.shape), cfg.aux_loss_coef * aux + cfg.z_loss_coef * z


def soft_forward(layer: MoELayer, x: Tensor) -> Tensor:
    cfg = layer.config
    per_expert = cfg.slots_per_expert
    sequences = x.reshape(-1, x.shape[-2], cfg.d_model)
    outputs = []
    for seq in sequences:
        logits = seq @ layer.router.slot_embeddings.t()
        slots = logits.softmax(0).t() @ seq
        slot_out = torch.cat(
            [expert_mlp(layer, e, slots[e * per_expert : (e + 1) * per_expert]) for e in range(cfg.num_experts)]
        )
        outputs.append(logits.softmax(1) @ slot_out)
    return torch.stack(outputs).view(x.shape)


def reference_forward(layer: MoELayer, x: Tensor) -> tuple[Tensor, Tensor]:
    """(output, weighted aux + z loss the layer must apply in backward)."""
    if layer.config.router == "soft":
        return soft_forward(layer, x), torch.zeros(())
    return sparse_forward(layer, x)
