"""Sparta's reference decoder: a GPT-style language model laid out for the 3D trainer.

It follows torchtitan's convention, which is what `parallelize` relies on:
- the top-level children registered before ``layers`` (``tok_emb``, ``pos_emb``) run on the
  first pipeline stage, those after it (``norm``, ``output``) on the last;
- ``layers`` is an ``nn.ModuleDict`` keyed "0".."n-1", so a stage that deletes the others
  keeps the full model's parameter names (checkpoints load under any layout);
- ``forward`` skips whatever is None, taking ids [B, T] where ``tok_emb`` is present and
  hidden states [B, T, d_model] otherwise;
- ``tp_plan`` names, per layer, each module's tensor-parallel style (data, not code); the
  attention reshapes with -1 heads, so a rank with ``n_heads / tp`` of them runs unchanged.
Its MLPs are plain ``FeedForward``s; `parallelize` turns them into MoE layers when asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sparta.comm import HierarchicalAllToAll
from sparta.errors import ConfigError, InputError
from sparta.moe import MoELayer, overlap_problem, overlapped_moe_block


@dataclass(frozen=True)
class DecoderConfig:
    """Shape of the decoder. ``d_ff`` is the MLP's hidden width (each expert's, once MoE)."""

    vocab_size: int = 4096
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 256

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"DecoderConfig.{name}={value!r} must be a positive integer")
        if self.d_model % self.n_heads:
            raise ConfigError(f"DecoderConfig: d_model={self.d_model} must be divisible by n_heads={self.n_heads}")


class Attention(nn.Module):
    """Causal multi-head self-attention. [B, T, d_model] -> [B, T, d_model]."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.wq = nn.Linear(cfg.d_model, cfg.d_model)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        # heads from the last dim alone (-1: under tensor parallelism wq/wk/wv hold this rank's
        # heads only), so that an empty batch (an empty micro-batch of a block) has a shape too
        q, k, v = (w(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    """fc1 -> GELU -> fc2. [B, T, d_model] -> [B, T, d_model]."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x)).

    ``overlap`` > 1 (`set_overlap`; its MLP an expert-parallel MoELayer): the block cuts its
    batch into that many micro-batches of whole sequences, so that one's attention computes
    while another's rows travel (`sparta.moe.overlapped_moe_block`); ``dedup`` (a two-level
    all-to-all over the layer's group): each token crosses to a node once. Same outputs and
    gradients. A batch of fewer sequences than ``overlap`` runs whole."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp: nn.Module = FeedForward(cfg)
        self.overlap = 1
        self.dedup: HierarchicalAllToAll | None = None

    def set_overlap(self, microbatches: int, dedup: HierarchicalAllToAll | None = None) -> None:
        """Micro-batches the block cuts its batch into (1: none), and the two-level
        all-to-all over its MoE layer's group that sends each token to a node once (None:
        rows go straight to their experts). ConfigError unless (1, None), or the MLP is an
        MoE layer that can overlap (`sparta.moe.overlap_problem`). Every rank of the layer's
        expert-parallel group must set the same."""
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ConfigError(f"Block.set_overlap({microbatches!r}): give an int >= 1 (1: no micro-batches)")
        if microbatches > 1 or dedup is not None:
            problem = overlap_problem(self.mlp) if isinstance(self.mlp, MoELayer) else "its MLP is not an MoE layer"
            if problem is not None:
                raise ConfigError(f"Block.set_overlap({microbatches}): cannot overlap micro-batches: {problem}")
        self.overlap, self.dedup = microbatches, dedup

    def _attend(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = x + self.attn(self.attn_norm(x))
        return h, self.mlp_norm(h)

    def forward(self, x: Tensor) -> Tensor:
        # whatever this rank's row count (empty micro-batches where it is small): its expert-
        # parallel peers may hold more rows and take this path, and the exchanges must pair
        if self.overlap > 1 or self.dedup is not None:
            params = [p for p in self.parameters() if p.requires_grad]
            return overlapped_moe_block(self.mlp, x, self.overlap, self._attend, params, self.dedup)  # type: ignore[arg-type]
        h, moe_input = self._attend(x)
        return h + self.mlp(moe_input)


class Decoder(nn.Module):
    """``forward(ids [B, T]) -> logits [B, T, vocab_size]`` (see the module docstring for
    what a pipeline stage of it takes and returns).

    Build it after seeding the global RNG identically on every rank: every rank then holds
    the same full model before `parallelize` cuts it.
    """

    # module path inside one layer -> tensor-parallel style ("colwise" | "rowwise")
    tp_plan: dict[str, str] = {
        "attn.wq": "colwise",
        "attn.wk": "colwise",
        "attn.wv": "colwise",
        "attn.wo": "rowwise",
        "mlp.fc1": "colwise",
        "mlp.fc2": "rowwise",
    }

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb: nn.Module | None = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = nn.LayerNorm(cfg.d_model)
        self.output: nn.Module | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # GPT-2's small normal init
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    @property
    def max_length(self) -> int:
        """The longest sequence the model takes: its position table's rows."""
        return self.cfg.seq_len

    def forward(self, x: Tensor) -> Tensor:
        if self.tok_emb is not None:
            # a tok_emb with takes_vectors (embedding stages' rows, vocab_stages.py) takes them instead
            if x.dtype not in (torch.int32, torch.int64) and not getattr(self.tok_emb, "takes_vectors", False):
                raise InputError(f"Decoder first stage takes token ids [B, T] (int64), got {x.dtype}")
            h = self.tok_emb(x)
            if self.pos_emb is not None:
                h = h + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        else:
            h = x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h
