"""The model's parts as the planner measures them: the trainer's own modules cut at the
seams a stage split can fall on (`Block`'s two halves, the embedding, the head with its
loss, the MoE half as moeify builds it), the inputs to time them on, and the bytes autograd
saves while they run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from sparta.comm.communicator import Communicator
from sparta.errors import ConfigError
from sparta.moe.experts import check_ff_split
from sparta.parallel.decoder import Block, Decoder, DecoderConfig
from sparta.parallel.experts import MoESpec, moe_layers
from sparta.parallel.parallelize import TP_STYLES

from .costs import FLOAT_BYTES


def saved_activation_bytes(fn: Callable[[], Any], module: nn.Module) -> int:
    """Bytes of the distinct activations autograd saves for backward while ``fn`` runs:
    ``module``'s parameters and buffers, which matmuls save too, are not counted, since the
    stage holds them anyway and they do not grow with the tokens (counted per token, an
    MoE's experts made the one-micro-batch plan's predicted peak 22 % high on an H200)."""

    def storage(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t  # under tp: this rank's shard

    kept = (storage(t) for t in (*module.parameters(), *module.buffers()))
    held = {t.untyped_storage().data_ptr() for t in kept if t.device.type != "meta"}
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = storage(t)
        if local.device.type != "meta" and local.untyped_storage().data_ptr() not in held:
            seen[(local.untyped_storage().data_ptr(), local.storage_offset())] = local.numel() * local.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


class Residual(nn.Module):
    """x + fn(norm(x)): one half of a pre-norm block, [B, T, d] -> [B, T, d]."""

    def __init__(self, norm: nn.Module, fn: nn.Module) -> None:
        super().__init__()
        self.norm, self.fn = norm, fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fn(self.norm(x))


class _Embed(nn.Module):
    """The first stage's extras: ids [B, T] -> [B, T, d]."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class _Head(nn.Module):
    """The last stage's extras and the loss: [B, T, d] -> scalar."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.norm(h))
        targets = torch.zeros(logits.shape[:-1], dtype=torch.long, device=h.device)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def model_parts(cfg: DecoderConfig, moe: MoESpec | None) -> dict[str, nn.Module]:
    """The parts by name ("embed", "attention", "mlp", "head", and "moe" with ``moe``), as
    modules of the trainer's own classes (Block, moeify's MoELayer)."""
    block = Block(cfg)
    parts: dict[str, nn.Module] = {
        "embed": _Embed(cfg),
        "attention": Residual(block.attn_norm, block.attn),
        "mlp": Residual(block.mlp_norm, block.mlp),
        "head": _Head(cfg),
    }
    if moe is not None:
        parts["moe"] = moe_part(cfg, moe, None)
    return parts


def moe_part(cfg: DecoderConfig, moe: MoESpec, ep: Communicator | None, tp: Communicator | None = None) -> nn.Module:
    """A block's MoE half, its experts split over ``ep`` (None: all here) and their hidden
    units over ``tp`` (None: whole), as moe_layers builds it."""
    holder = nn.Module()
    holder.layers = nn.ModuleDict({"0": Block(cfg)})
    moe_layers(holder, dataclasses.replace(moe, every=1), ep, tp=tp)
    moe_block = holder.layers["0"]
    return Residual(moe_block.mlp_norm, moe_block.mlp)


def residual_tp_styles(name: str) -> dict[str, Any]:
    """The trainer's tp plan (Decoder.tp_plan) for one half of a block ("attention" or
    "mlp"), as paths inside its `Residual`."""
    prefix = "attn." if name == "attention" else "mlp."
    return {
        "fn." + path.removeprefix(prefix): TP_STYLES[style]()
        for path, style in Decoder.tp_plan.items()
        if path.startswith(prefix)
    }


def experts_split(model: DecoderConfig, tp: int) -> bool:
    """Whether the trainer can split the experts' hidden units over ``tp`` ranks, in the
    parts' float32 (`sparta.moe.experts.check_ff_split`); a model that cannot is not timed so."""
    try:
        check_ff_split(model.d_ff, tp, FLOAT_BYTES)
    except ConfigError:
        return False
    return True


def token_ids(cfg: DecoderConfig, device: torch.device) -> Callable[[int], torch.Tensor]:
    """tokens -> random ids [tokens / seq_len, seq_len]: the embedding part's input."""
    return lambda tokens: torch.randint(0, cfg.vocab_size, (tokens // cfg.seq_len, cfg.seq_len), device=device)


def hidden_states(cfg: DecoderConfig, device: torch.device) -> Callable[[int], torch.Tensor]:
    """tokens -> random hidden states [tokens / seq_len, seq_len, d_model] that take a
    gradient: every other part's input."""
    return lambda tokens: torch.randn(
        tokens // cfg.seq_len, cfg.seq_len, cfg.d_model, device=device, requires_grad=True
    )
