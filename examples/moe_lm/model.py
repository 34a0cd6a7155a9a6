"""A small GPT whose MLPs are Sparta MoE layers (pre-norm blocks, tied LM head)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sparta.comm import Communicator
from sparta.errors import ConfigError
from sparta.moe import ROUTERS, MoELayer


@dataclass
class ModelConfig:
    """Shape of the model. ``d_ff`` is each expert's hidden width; ``ep_size`` the number of
    ranks the experts are sharded over (``num_experts`` must divide by it)."""

    vocab_size: int = 4096
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    d_ff: int = 256
    router: str = "topk"
    capacity_factor: float | None = None
    aux_loss_coef: float = 1e-2
    ep_size: int = 1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "num_experts", "top_k", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.vocab_size < 257:
            raise ConfigError(f"vocab_size={self.vocab_size} must exceed the 256 byte tokens of a byte-level BPE")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.router not in ROUTERS:
            raise ConfigError(f"router={self.router!r} is unknown: choose one of {', '.join(ROUTERS)}")
        if self.num_experts % self.ep_size:
            raise ConfigError(
                f"num_experts={self.num_experts} must be divisible by the {self.ep_size} expert-parallel ranks: "
                f"pick a multiple of {self.ep_size} or launch fewer ranks"
            )
        # The remaining MoE rules (top_k <= experts, switch needs top_k=1, ...) are MoEConfig's to check.


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, comm: Communicator | None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.moe = MoELayer(
            cfg.d_model,
            cfg.d_ff,
            cfg.num_experts,
            top_k=cfg.top_k,
            router=cfg.router,
            capacity_factor=cfg.capacity_factor,
            ep_size=cfg.ep_size,
            aux_loss_coef=cfg.aux_loss_coef,
            comm=comm,
            name=f"blocks.{index}.moe",
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoEGPT(nn.Module):
    """``forward(ids [B, T]) -> logits [B, T, vocab]``.

    Build it after seeding the global RNG identically on every rank: the dense weights then
    agree everywhere, and each rank's experts equal the same experts of a one-process model
    (``GroupedExperts`` seeds each expert from one global draw plus its global id).
    """

    def __init__(self, cfg: ModelConfig, comm: Communicator | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i, comm) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # GPT-2's small normal init for the dense weights; the experts keep Sparta's own init.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [block.moe for block in self.blocks]

    def expert_parameters(self) -> list[nn.Parameter]:
        """Parameters sharded over the expert-parallel ranks (each rank holds different ones)."""
        return [p for moe in self.moe_layers for p in moe.experts.parameters()]

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters replicated on every rank."""
        sharded = {id(p) for p in self.expert_parameters()}
        return [p for p in self.parameters() if id(p) not in sharded]

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok_emb(ids) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        # Tied head: the output projection is the token embedding, which saves vocab * d_model weights.
        return nn.functional.linear(self.ln_f(x), self.tok_emb.weight)
