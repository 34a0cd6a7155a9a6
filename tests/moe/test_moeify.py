"""moeify on real model code: Hugging Face GPT-2 and Llama built from configs (no download),
and a plain PyTorch transformer. Converted models keep their interface and train."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from sparta.errors import ConfigError
from sparta.moe import MoELayer, moeify, read_dense_mlp

transformers = pytest.importorskip("transformers")

VOCAB, D_MODEL, LAYERS = 64, 32, 2


def gpt2(activation_function: str = "gelu_new") -> nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=D_MODEL,
        n_layer=LAYERS,
        n_head=2,
        activation_function=activation_function,
    )
    return transformers.GPT2LMHeadModel(cfg)


def gpt2_exact_gelu() -> nn.Module:
    """GPT-2 with the erf GELU the experts compute (its default is the tanh approximation)."""
    return gpt2("gelu")


def llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=48,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(cfg)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D_MODEL)
        self.attn = nn.MultiheadAttention(D_MODEL, 2, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(D_MODEL, 64, bias=False), nn.ReLU(), nn.Linear(64, D_MODEL, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.ffn(h)


class PlainLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def train_losses(model: nn.Module, steps: int = 25) -> list[float]:
    ids = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        out = logits(model, ids[:, :-1])
        loss = nn.functional.cross_entropy(out.flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    ("build", "match", "paths", "activation"),
    [
        (gpt2, None, ["transformer.h.0.mlp", "transformer.h.1.mlp"], "gelu"),
        (llama, None, ["model.layers.0.mlp", "model.layers.1.mlp"], "swiglu"),
        (PlainLM, r"blocks\.\d+\.ffn", ["blocks.0.ffn", "blocks.1.ffn"], "relu"),
    ],
)
def test_converted_model_trains(build: type, match: str | None, paths: list[str], activation: str) -> None:
    model = build()
    replaced = moeify(model, num_experts=4, top_k=2, match=match)
    assert replaced == paths
    for path in paths:
        moe = model.get_submodule(path)
        assert isinstance(moe, MoELayer) and moe.config.activation == activation and moe.name == path
    losses = train_losses(model)
    assert losses[-1] < losses[0] - 1.0, losses
    assert all(model.get_submodule(p).last_stats.tokens_dropped == 0 for p in paths)


@pytest.mark.parametrize("build", [llama, PlainLM, gpt2_exact_gelu])
def test_upcycled_model_computes_what_it_did(build: type) -> None:
    """Every expert is the dense MLP, biases included, and top-2 weights sum to 1: the same
    function."""
    model = build().eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = logits(model, ids)
        moeify(model, num_experts=4, top_k=2, match=r"blocks\.\d+\.ffn" if build is PlainLM else None)
        after = logits(model, ids)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_gpt2_biases_are_upcycled_unless_turned_off(caplog: pytest.LogCaptureFixture) -> None:
    model = gpt2()
    mlp = model.transformer.h[0].mlp
    dense = read_dense_mlp(mlp)
    assert dense is not None and dense.has_bias and (dense.d_model, dense.d_ff) == (D_MODEL, 4 * D_MODEL)
    w1 = mlp.c_fc.weight.detach().clone()  # Conv1D: already [in, out]
    b1, b2 = mlp.c_fc.bias.detach().clone(), mlp.c_proj.bias.detach().clone()
    moeify(model, num_experts=2, top_k=1, router="switch")
    experts = model.transformer.h[0].mlp.experts
    assert model.transformer.h[0].mlp.config.expert_bias
    torch.testing.assert_close(experts.w1[1], w1)
    torch.testing.assert_close(experts.b1[1], b1)
    torch.testing.assert_close(experts.b2[0], b2)
    assert "transformer.h.0.mlp.experts.b1.1" in model.state_dict()
    with caplog.at_level(logging.WARNING, logger="sparta.moe"):
        moeify(gpt2(), num_experts=2, top_k=1, router="switch", expert_bias=False)
    assert "transformer.h.0.mlp has biases but expert_bias=False" in caplog.text


def test_no_upcycle_keeps_fresh_experts_and_options_reach_the_layer() -> None:
    model = llama()
    gate = model.model.layers[0].mlp.gate_proj.weight.detach().t().clone()
    moeify(model, 4, 1, router="switch", capacity_factor=1.25, upcycle=False)
    moe = model.model.layers[0].mlp
    assert moe.config.router == "switch" and moe.config.capacity_factor == 1.25
    assert not torch.equal(moe.experts.w1[0], gate)


def test_errors_name_the_problem() -> None:
    with pytest.raises(ConfigError, match=r"found no module matching 'nothing\\\\.here'"):
        moeify(PlainLM(), 4, match=r"nothing\.here")
    with pytest.raises(ConfigError, match=r"blocks.0.attn \(MultiheadAttention\) is not an MLP"):
        moeify(PlainLM(), 4, match=r"blocks\.0\.attn")
    with pytest.raises(ConfigError, match=r"cannot upcycle transformer.h.0.mlp, a gelu MLP, into swiglu"):
        moeify(gpt2(), 4, activation="swiglu")
    with pytest.raises(ConfigError, match=r"top_k=5 exceeds num_experts=4"):
        moeify(llama(), 4, top_k=5)
