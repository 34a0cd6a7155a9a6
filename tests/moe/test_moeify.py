"""moeify on real model code: Hugging Face GPT-2 and Llama built from configs (no download),
and a plain PyTorch transformer. Converted models keep their interface and train."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from torch import nn

from sparta.errors import ConfigError
from sparta.moe import MoELayer, moeify, read_dense_mlp

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


def llama(hidden_act: str = "silu") -> nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_act=hidden_act,
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
        (gpt2, None, ["transformer.h.0.mlp", "transformer.h.1.mlp"], "gelu_tanh"),
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


@pytest.mark.parametrize("build", [llama, PlainLM, gpt2, gpt2_exact_gelu])
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
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sparta.moe"):
        moeify(gpt2(), num_experts=2, top_k=1, router="switch", expert_bias=False)
    assert "transformer.h.0.mlp has biases but expert_bias=False" in caplog.text
    # one expert a token: its weight is the probability, so the start is no longer exact, and said
    assert "upcycled at top_k=1: each token's weight is its expert's probability" in caplog.text
    assert caplog.text.count("upcycled at top_k=1") == 1 and "use router='topk' with top_k >= 2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sparta.moe"):
        moeify(gpt2(), num_experts=2, top_k=2)
    assert "top_k=1" not in caplog.text


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
    with pytest.raises(ConfigError, match=r"cannot upcycle transformer.h.0.mlp, a gelu_tanh MLP, into swiglu"):
        moeify(gpt2(), 4, activation="swiglu")
    with pytest.raises(ConfigError, match=r"top_k=5 exceeds num_experts=4"):
        moeify(llama(), 4, top_k=5)


HIDDEN = 24
ACTS = transformers.activations


class TwoLinear(nn.Module):
    """fc1 -> activation -> fc2 with biases; the activation a child module, or (module=None)
    applied in forward from `config.hidden_act` or by `apply` alone."""

    def __init__(self, act: nn.Module | None = None, hidden_act: str | None = None, apply: Any = None) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D_MODEL, HIDDEN), nn.Linear(HIDDEN, D_MODEL)
        self.act = act
        self.config = SimpleNamespace(hidden_act=hidden_act) if hidden_act else None
        self.fn = apply

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.act is not None:
            return self.fc2(self.act(h))
        if self.config is not None:  # as Hugging Face code does: ACT2FN[name] outside the module tree
            return self.fc2(ACTS.ACT2FN[self.config.hidden_act](h))
        return self.fc2(self.fn(h))


class Holder(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def upcycled_equals_dense(mlp: nn.Module, want: str, **options: Any) -> None:
    """moeify(top-2 of 4 copies) computes what the dense MLP did; the other GELU form would
    not pass the same tolerance."""
    torch.manual_seed(0)
    model = Holder(mlp).eval()
    x = 3 * torch.randn(2, 7, D_MODEL)
    with torch.no_grad():
        before = model(x)
        moeify(model, num_experts=4, top_k=2, match="mlp", **options)
        after = model(x)
    assert model.mlp.config.activation == want
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    if want in ("gelu", "gelu_tanh"):
        h = mlp.fc1(x)
        other = nn.functional.gelu(h, approximate="none" if want == "gelu_tanh" else "tanh")
        assert (mlp.fc2(other) - before).abs().max() > 1e-4  # ten times the tolerance


@pytest.mark.parametrize(
    ("act", "want"),
    [
        (nn.GELU(), "gelu"),
        (nn.GELU(approximate="tanh"), "gelu_tanh"),
        (nn.ReLU(), "relu"),
        (nn.SiLU(), "silu"),
        (ACTS.GELUActivation(), "gelu"),
        (ACTS.NewGELUActivation(), "gelu_tanh"),
        (ACTS.GELUTanh(), "gelu_tanh"),
        (ACTS.PytorchGELUTanh(), "gelu_tanh"),
        (ACTS.FastGELUActivation(), "gelu_tanh"),
        (ACTS.AccurateGELUActivation(), "gelu_tanh"),
        (ACTS.SiLUActivation(), "silu"),
    ],
    ids=lambda v: type(v).__name__ + str(getattr(v, "approximate", "")) if isinstance(v, nn.Module) else v,
)
def test_each_activation_module_upcycles_exactly(act: nn.Module, want: str) -> None:
    upcycled_equals_dense(TwoLinear(act), want)


@pytest.mark.parametrize(
    ("hidden_act", "want"),
    [
        ("gelu", "gelu"),
        ("gelu_python", "gelu"),
        ("gelu_new", "gelu_tanh"),
        ("gelu_pytorch_tanh", "gelu_tanh"),
        ("gelu_python_tanh", "gelu_tanh"),
        ("gelu_fast", "gelu_tanh"),
        ("gelu_accurate", "gelu_tanh"),
        ("relu", "relu"),
        ("silu", "silu"),
        ("swish", "silu"),
    ],
)
def test_each_hidden_act_name_upcycles_exactly(hidden_act: str, want: str) -> None:
    upcycled_equals_dense(TwoLinear(hidden_act=hidden_act), want)


def test_an_activation_only_the_forward_knows_is_named_by_the_caller() -> None:
    with pytest.raises(ConfigError, match=r"cannot tell which activation mlp \(TwoLinear\) applies.*pass activation="):
        moeify(Holder(TwoLinear(apply=torch.relu)), 4, match="mlp")
    upcycled_equals_dense(TwoLinear(apply=torch.relu), "relu", activation="relu")


def test_what_no_expert_computes_exactly_is_refused_unless_not_upcycled() -> None:
    with pytest.raises(ConfigError, match=r"mlp has the activation act \(QuickGELUActivation\), which no expert"):
        moeify(Holder(TwoLinear(ACTS.QuickGELUActivation())), 4, match="mlp")
    with pytest.raises(ConfigError, match=r"the activation config.hidden_act='quick_gelu'"):
        moeify(Holder(TwoLinear(hidden_act="quick_gelu")), 4, match="mlp")
    with pytest.raises(ConfigError, match=r"the activation act \(Tanh\)"):
        moeify(Holder(TwoLinear(nn.Tanh())), 4, match="mlp", activation="gelu")  # naming another does not help
    with pytest.raises(ConfigError, match=r"the modules act \(GELU\), norm \(LayerNorm\) besides its linear maps"):
        mlp = TwoLinear(nn.GELU())
        mlp.norm = nn.LayerNorm(HIDDEN)
        moeify(Holder(mlp), 4, match="mlp")
    with pytest.raises(ConfigError, match=r"another order than linear, activation, linear"):
        moeify(Holder(nn.Sequential(nn.Linear(D_MODEL, 8), nn.Linear(8, D_MODEL), nn.ReLU())), 4, match="mlp")
    with pytest.raises(ConfigError, match=r"a gelu_tanh gate \(gate_proj\), where gated experts gate with SiLU"):
        moeify(llama(hidden_act="gelu_pytorch_tanh"), 4)  # Gemma's GeGLU
    model = Holder(TwoLinear(ACTS.QuickGELUActivation()))
    moeify(model, 4, match="mlp", upcycle=False, activation="gelu")  # fresh experts: any activation
    assert model.mlp.config.activation == "gelu"
