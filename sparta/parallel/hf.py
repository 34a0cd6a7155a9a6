"""Hugging Face Llama and GPT-2 laid out as Sparta's reference decoder, for `parallelize`.

``from_hf(model)`` takes a ``transformers`` ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` and
returns an adapter (``HFLlama``, ``HFGPT2``) with the torchtitan layout `parallelize` expects
(see ``sparta.parallel.decoder``): ``tok_emb`` (and GPT-2's ``pos_emb``), ``layers`` (an
``nn.ModuleDict`` "0".."n-1" of the model's own decoder blocks), ``norm`` and ``output`` (the
LM head). ``forward`` takes ids [B, T] (int64) where ``tok_emb`` is present and hidden states
[B, T, d_model] otherwise, skips every piece that is None (so a pipeline stage is a deep copy
with the other stages' pieces deleted) and returns logits [B, T, vocab] where ``output`` is
present, hidden states [B, T, d_model] otherwise.

What the adapters change, and why:

- Nothing is copied: the adapter holds the model's modules, so training it trains them (the
  model itself stays usable, e.g. for ``save_pretrained`` after a one-process run). The one
  exception is a tied LM head, below.
- Causal attention with no mask: blocks get ``attention_mask=None``, and HF's ``sdpa``
  attention then calls ``scaled_dot_product_attention(..., is_causal=True)`` (its
  ``is_causal = q_length > 1 and attention_mask is None and module.is_causal``, checked in
  transformers 5.24). Its ``eager`` attention would apply no mask at all, i.e. look ahead, so
  any other implementation is refused. No padding mask: every sequence is full length.
- Positions are ``0..T-1`` for every sequence, as HF computes them without a cache.
- Llama's rotary embedding (``rotary``: buffers only, no parameters) feeds every block, so it
  must be on every pipeline stage that has layers; the cut keeps every parameter-free child on
  every stage (``sparta.parallel.pipeline.ModelParts``), which covers it and GPT-2's
  embedding dropout ``emb_drop``.
- Tied LM head (GPT-2's default ``tie_word_embeddings=True``): the embedding runs on the
  first pipeline stage and the head on the last, so one shared weight cannot stay shared.
  The adapter refuses it (ConfigError) unless built with ``untie=True``, which gives the head
  its own copy of the embedding weight (equal logits at the start; the two train apart from
  then on, as an untied model does). Silently training a different model than the user built
  is what the refusal avoids.
- Dropout: the blocks' and GPT-2's embedding dropout act in training mode and draw from each
  rank's RNG, so parity with one process holds for dropout 0 (set ``attention_dropout``,
  ``resid_pdrop``, ``embd_pdrop``, ``attn_pdrop`` to 0 for such runs).

Tensor parallelism: ``tp_plan`` names, per layer, each module's style as the reference decoder
does. Llama: q/k/v/gate/up column-wise, o/down row-wise; its attention reshapes with -1
heads (``view(*input_shape, -1, head_dim)``, ``reshape(*input_shape, -1)``) and repeats k/v
by ``num_attention_heads // num_key_value_heads``, a ratio a shard keeps, so a rank holding
``heads / tp`` query and ``kv_heads / tp`` key/value heads runs unchanged. ``check_tp``
refuses a tp that does not divide the heads or the MLP width. GPT-2 has no plan: its
attention and MLP are HF ``Conv1D`` layers (weight ``[in, out]``), which torch's
``ColwiseParallel``/``RowwiseParallel`` do not shard (``nn.Linear`` and ``nn.Embedding``
only), and its ``c_attn`` fuses q, k, v into one output split at a fixed ``split_size``, so a
column shard would mix q, k and v heads; ``check_tp`` refuses tp > 1 for it.

MoE: ``mlp_class`` (``LlamaMLP``, ``GPT2MLP``) is the ``match=`` for
``sparta.moe.moeify``; both are read exactly by ``read_dense_mlp`` (SwiGLU experts for Llama,
``gelu_tanh`` experts with biases for GPT-2's ``gelu_new``).
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from sparta.errors import ConfigError, InputError

__all__ = ["HFDecoder", "HFGPT2", "HFLlama", "from_hf"]


def _check_attention(model: nn.Module) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa":
        raise ConfigError(
            f"{type(model).__name__} uses attn_implementation={impl!r}; the Sparta adapter passes no attention mask, "
            "which only HF's 'sdpa' attention turns into causal attention (others would look ahead): call "
            "model.set_attn_implementation('sdpa') or build it with attn_implementation='sdpa'"
        )


def _head(model: nn.Module, embedding: nn.Embedding, untie: bool) -> nn.Module:
    """The model's LM head, or a copy of it with its own weight where it shares the embedding's."""
    head = model.get_output_embeddings()
    if head.weight is not embedding.weight:
        return head
    if not untie:
        raise ConfigError(
            f"{type(model).__name__}'s lm_head shares the token embedding's weight (tie_word_embeddings=True); "
            "pipeline stages put the embedding on the first stage and the head on the last, so the tie cannot be "
            "kept: pass untie=True to give the head its own copy (the two then train apart), or build the model "
            "with tie_word_embeddings=False"
        )
    # a deep copy of the head alone copies the shared Parameter too: the copy owns its weight
    return copy.deepcopy(head)


def _positions(h: Tensor) -> Tensor:
    """Positions 0..T-1, [1, T] int64, as HF computes them without a cache."""
    return torch.arange(h.shape[1], device=h.device).unsqueeze(0)


class HFDecoder(nn.Module):
    """Base of the adapters: the decoder layout over a Hugging Face causal LM's modules.

    Read by `parallelize` and ``moeify``: ``tp_plan`` (class attribute: module path inside
    one layer -> "colwise" | "rowwise"), ``check_tp(tp)`` (raises ConfigError where the plan
    cannot shard this model over tp ranks) and ``mlp_class`` (the dense MLP class, ``match=``
    for ``moeify``).
    """

    tp_plan: ClassVar[dict[str, str]] = {}

    tok_emb: nn.Module | None
    layers: nn.ModuleDict
    norm: nn.Module | None
    output: nn.Module | None

    def __init__(self, config: Any) -> None:
        super().__init__()
        # the HF config, kept for check_tp and for users (not a module, not copied per stage)
        self.config = config

    @property
    def mlp_class(self) -> type[nn.Module]:
        """The model's dense MLP class: ``moeify(adapter, ..., match=adapter.mlp_class)``."""
        raise NotImplementedError

    def check_tp(self, tp_size: int) -> None:
        """ConfigError unless ``tp_plan`` shards this model correctly over ``tp_size`` ranks."""
        raise NotImplementedError

    def _embed(self, x: Tensor) -> Tensor:
        # a tok_emb with takes_vectors (embedding stages' rows, vocab_stages.py) takes them instead
        if x.dtype not in (torch.int32, torch.int64) and not getattr(self.tok_emb, "takes_vectors", False):
            raise InputError(
                f"{type(self).__name__}'s first stage takes token ids [B, T] (int64), got {x.dtype} {tuple(x.shape)}"
            )
        assert self.tok_emb is not None
        return self.tok_emb(x)

    def _blocks(self, h: Tensor) -> Tensor:
        for layer in self.layers.values():
            h = layer(h)
        return h

    def forward(self, x: Tensor) -> Tensor:
        """ids [B, T] (where ``tok_emb`` is present) or hidden [B, T, d_model] -> logits
        [B, T, vocab] (where ``output`` is present) or hidden [B, T, d_model]."""
        h = self._embed(x) if self.tok_emb is not None else x
        if len(self.layers):
            h = self._blocks(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


class HFLlama(HFDecoder):
    """A ``LlamaForCausalLM`` as a decoder: tok_emb = ``model.embed_tokens``, layers = its
    ``LlamaDecoderLayer``s, norm = its final RMSNorm, output = ``lm_head``; ``rotary`` (its
    ``LlamaRotaryEmbedding``) gives every block cos/sin [1, T, head_dim]."""

    tp_plan: ClassVar[dict[str, str]] = {
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    }

    def __init__(self, model: nn.Module, *, untie: bool = False) -> None:
        from transformers import LlamaForCausalLM

        if not isinstance(model, LlamaForCausalLM):
            raise ConfigError(f"HFLlama takes a transformers LlamaForCausalLM, got {type(model).__name__}")
        _check_attention(model)
        super().__init__(model.config)
        inner = model.model
        # registration order is the stage order: children before `layers` go to the first
        # stage, those after it to the last (see sparta.parallel.decoder)
        self.tok_emb = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(inner.layers)})
        self.norm = inner.norm
        self.output = _head(model, inner.embed_tokens, untie)

    @property
    def mlp_class(self) -> type[nn.Module]:
        """The Hugging Face MLP class that moeify replaces."""
        from transformers.models.llama.modeling_llama import LlamaMLP

        return LlamaMLP

    def check_tp(self, tp_size: int) -> None:
        """ConfigError unless ``tp_size`` divides the heads (and the MLP width while it is dense)."""
        cfg = self.config
        sizes = [("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads", cfg.num_key_value_heads)]
        # the MLP width counts only while a dense MLP is left: moeify's experts are not in the
        # tp plan (parallelize checks their own split, MoESpec.expert_tp)
        if any(isinstance(layer.mlp, self.mlp_class) for layer in self.layers.values()):
            sizes.append(("intermediate_size", cfg.intermediate_size))
        for name, value in sizes:
            if value % tp_size:
                raise ConfigError(
                    f"tp={tp_size} does not divide the Llama config's {name}={value}: each tensor-parallel rank "
                    f"holds an equal share of the heads and of the MLP width; pick tp among "
                    f"{[d for d in range(1, value + 1) if value % d == 0]} or change the model"
                )

    def _blocks(self, h: Tensor) -> Tensor:
        if self.rotary is None:
            raise ConfigError(
                "HFLlama stage has layers but no rotary embedding: a pipeline cut must keep the parameter-free "
                "`rotary` on every stage (as sparta.parallel.pipeline.stage_module does)"
            )
        cos_sin = self.rotary(h, _positions(h))
        for layer in self.layers.values():
            h = layer(h, attention_mask=None, position_embeddings=cos_sin)
        return h


class HFGPT2(HFDecoder):
    """A ``GPT2LMHeadModel`` as a decoder: tok_emb = ``wte``, pos_emb = ``wpe`` (with the
    embedding dropout ``emb_drop``), layers = its ``GPT2Block``s, norm = ``ln_f``, output =
    ``lm_head`` (see the module docstring for a tied one). No tensor-parallel plan."""

    tp_plan: ClassVar[dict[str, str]] = {}

    def __init__(self, model: nn.Module, *, untie: bool = False) -> None:
        from transformers import GPT2LMHeadModel

        if not isinstance(model, GPT2LMHeadModel):
            raise ConfigError(f"HFGPT2 takes a transformers GPT2LMHeadModel, got {type(model).__name__}")
        if model.config.add_cross_attention:
            raise ConfigError(
                "HFGPT2 takes a decoder-only GPT-2, got add_cross_attention=True (its cross-attention weights would "
                "get no gradient): build it with add_cross_attention=False"
            )
        _check_attention(model)
        super().__init__(model.config)
        inner = model.transformer
        self.tok_emb = inner.wte
        self.pos_emb: nn.Module | None = inner.wpe
        self.emb_drop: nn.Module | None = inner.drop
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(inner.h)})
        self.norm = inner.ln_f
        self.output = _head(model, inner.wte, untie)

    @property
    def max_length(self) -> int:
        """The longest sequence GPT-2 takes: its learned positions (n_positions)."""
        return int(self.config.n_positions)

    @property
    def mlp_class(self) -> type[nn.Module]:
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

        return GPT2MLP

    def check_tp(self, tp_size: int) -> None:
        if tp_size > 1:
            raise ConfigError(
                f"tp={tp_size} for GPT-2: its attention and MLP are Hugging Face Conv1D layers (weight [in, out]), "
                "which torch's ColwiseParallel/RowwiseParallel do not shard, and its c_attn fuses q, k and v into "
                "one output, so a column shard would mix them; train GPT-2 with tp=1 (pp, dp and ep work), or use "
                "a Llama-style model (sparta.parallel.hf.HFLlama) for tensor parallelism"
            )

    def _embed(self, x: Tensor) -> Tensor:
        h = super()._embed(x)
        if self.pos_emb is not None:
            limit = self.config.n_positions
            if x.shape[1] > limit:
                raise InputError(
                    f"GPT-2 sequence length {x.shape[1]} exceeds its n_positions={limit}: shorten the sequences "
                    "or build the model with a larger n_positions"
                )
            h = h + self.pos_emb(_positions(h))
        if self.emb_drop is not None:
            h = self.emb_drop(h)
        return h


def from_hf(model: nn.Module, *, untie: bool = False) -> HFDecoder:
    """The decoder adapter for a Hugging Face ``LlamaForCausalLM`` or ``GPT2LMHeadModel``.

    ``untie``: give a head that shares the embedding's weight its own copy (see the module
    docstring); without it such a model is refused. Raises ConfigError for any other model,
    a non-sdpa attention, or a GPT-2 with cross-attention.
    """
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    if isinstance(model, LlamaForCausalLM):
        return HFLlama(model, untie=untie)
    if isinstance(model, GPT2LMHeadModel):
        return HFGPT2(model, untie=untie)
    raise ConfigError(
        f"from_hf takes a transformers LlamaForCausalLM or GPT2LMHeadModel, got {type(model).__name__}; other "
        "models need the same layout by hand (tok_emb, layers as an nn.ModuleDict, norm, output: see "
        "sparta.parallel.decoder)"
    )
