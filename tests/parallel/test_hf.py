"""The Hugging Face adapters (sparta.parallel.hf) in one process: the adapter computes what
the HF model computes (logits and gradients), a pipeline split of it (deep copy, other
stages' pieces deleted) chained stage by stage computes the whole, moeify on it is exact,
and every refusal names its fix. Training through `parallelize` on several ranks is in
tests/dist/hf_checks.py."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

from sparta.errors import ConfigError, InputError
from sparta.moe import MoELayer, moeify
from sparta.parallel.hf import HFGPT2, HFDecoder, HFLlama, from_hf
from sparta.parallel.pipeline import ModelParts, stage_module

VOCAB, D_MODEL, LAYERS, SEQ = 64, 32, 4, 12


def llama(**overrides: object) -> transformers.LlamaForCausalLM:
    """4 query heads over 2 key/value heads, so grouped-query attention is exercised."""
    torch.manual_seed(0)
    options = dict(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=48,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    options.update(overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**options))


def gpt2(**overrides: object) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    options = dict(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=D_MODEL,
        n_layer=LAYERS,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
    )
    options.update(overrides)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**options))


def ids(batch: int = 3, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def stage(adapter: HFDecoder, layers: list[str], first: bool, last: bool) -> nn.Module:
    """One pipeline stage as `parallelize` cuts it (a deep copy, the other stages' pieces
    deleted or None, parameter-free children kept)."""
    parts = ModelParts.of(adapter)
    return stage_module(adapter, parts, layers, first, last)


@pytest.mark.parametrize("build", [llama, gpt2])
def test_adapter_computes_what_the_model_computes(build) -> None:
    model = build()
    adapter = from_hf(model)
    x, y = ids(), ids(seed=2)
    ours = adapter(x)
    theirs = model(x).logits
    assert ours.shape == (3, SEQ, VOCAB)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    # the adapter holds the model's own parameters (nothing copied), under decoder names
    assert {id(p) for p in adapter.parameters()} == {id(p) for p in model.parameters()}
    tops = {name.split(".")[0] for name, _ in adapter.named_parameters()}
    assert tops == {"tok_emb", "layers", "norm", "output"} | ({"pos_emb"} if isinstance(adapter, HFGPT2) else set())
    # GPT-2's learned positions bound its length, which parallelize checks before any step
    assert getattr(adapter, "max_length", None) == (32 if isinstance(adapter, HFGPT2) else None)
    loss = nn.functional.cross_entropy(ours.flatten(0, 1), y.flatten())
    grads = torch.autograd.grad(loss, list(adapter.parameters()))
    ref_loss = nn.functional.cross_entropy(theirs.flatten(0, 1), y.flatten())
    ref_grads = torch.autograd.grad(ref_loss, list(adapter.parameters()))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=0)


def test_causal_without_a_mask() -> None:
    """No mask goes in, yet a token's logits do not depend on later tokens (sdpa's is_causal)."""
    for build in (llama, gpt2):
        adapter = from_hf(build())
        x = ids()
        changed = x.clone()
        changed[:, 6:] = (changed[:, 6:] + 1) % VOCAB
        with torch.no_grad():
            a, b = adapter(x), adapter(changed)
        torch.testing.assert_close(a[:, :6], b[:, :6], atol=0, rtol=0)
        assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-3


@pytest.mark.parametrize("build", [llama, gpt2])
def test_stages_chained_compute_the_whole(build) -> None:
    adapter = from_hf(build())
    parts = [
        stage(adapter, ["layers.0"], first=True, last=False),
        stage(adapter, ["layers.1", "layers.2"], first=False, last=False),
        stage(adapter, ["layers.3"], first=False, last=True),
    ]
    x = ids()
    with torch.no_grad():
        h = x
        for part in parts:
            h = part(h)
        whole = adapter(x)
    torch.testing.assert_close(h, whole, atol=1e-6, rtol=0)
    # the stages keep the full model's parameter names, and hold them between them once
    names = [n for part in parts for n, _ in part.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in adapter.named_parameters())
    assert parts[1].tok_emb is None and parts[1].output is None
    if isinstance(adapter, HFLlama):
        assert all(part.rotary is not None for part in parts)


def test_llama_stage_without_rotary_says_what_the_split_must_keep() -> None:
    part = stage(from_hf(llama()), ["layers.1"], first=False, last=False)
    part.rotary = None
    with pytest.raises(ConfigError, match="rotary"):
        part(torch.zeros(2, SEQ, D_MODEL))


@pytest.mark.parametrize("build", [llama, gpt2])
def test_moeify_on_the_adapter_is_exact(build) -> None:
    adapter = from_hf(build()).eval()
    x = ids()
    with torch.no_grad():
        before = adapter(x)
        replaced = moeify(adapter, num_experts=4, top_k=2, match=adapter.mlp_class, router="topk")
        after = adapter(x)
    assert replaced == [f"layers.{i}.mlp" for i in range(LAYERS)]
    assert all(isinstance(adapter.layers[str(i)].mlp, MoELayer) for i in range(LAYERS))
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_llama_tp_plan_names_the_linear_maps_and_checks_the_degree() -> None:
    adapter = from_hf(llama())
    block = adapter.layers["0"]
    for path, style in adapter.tp_plan.items():
        assert isinstance(block.get_submodule(path), nn.Linear)
        assert style in ("colwise", "rowwise")
    assert {p for p, s in adapter.tp_plan.items() if s == "rowwise"} == {"self_attn.o_proj", "mlp.down_proj"}
    adapter.check_tp(1)
    adapter.check_tp(2)
    with pytest.raises(ConfigError, match="num_key_value_heads=2"):
        adapter.check_tp(4)
    wide = from_hf(llama(num_key_value_heads=4, intermediate_size=50))
    with pytest.raises(ConfigError, match="intermediate_size=50"):
        wide.check_tp(4)
    # once the MLPs are experts (not tensor-parallel), their width no longer counts
    moeify(wide, num_experts=2, top_k=1, match=wide.mlp_class)
    wide.check_tp(4)


def test_llama_attention_runs_on_a_shard_of_its_heads() -> None:
    """What column-wise q/k/v and row-wise o do, by hand: each of 2 ranks keeps half the query
    and half the key/value heads; the attention, unchanged, computes its part of o_proj's
    output, and the parts sum to the whole (the -1-heads reshape and the k/v repeat ratio hold)."""
    adapter = from_hf(llama())
    attn = adapter.layers["0"].self_attn
    h = torch.randn(2, SEQ, D_MODEL, generator=torch.Generator().manual_seed(3))
    cos_sin = adapter.rotary(h, torch.arange(SEQ).unsqueeze(0))
    with torch.no_grad():
        whole, _ = attn(h, position_embeddings=cos_sin, attention_mask=None)
        parts = []
        for rank in range(2):
            shard = copy.deepcopy(attn)
            for name in ("q_proj", "k_proj", "v_proj"):
                linear = getattr(shard, name)
                rows = linear.weight.shape[0] // 2
                linear.weight = nn.Parameter(linear.weight[rank * rows : (rank + 1) * rows])
            cols = shard.o_proj.weight.shape[1] // 2
            shard.o_proj.weight = nn.Parameter(shard.o_proj.weight[:, rank * cols : (rank + 1) * cols])
            out, _ = shard(h, position_embeddings=cos_sin, attention_mask=None)
            parts.append(out)
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-6, rtol=0)


def test_gpt2_refuses_tensor_parallel() -> None:
    adapter = from_hf(gpt2())
    assert adapter.tp_plan == {}
    adapter.check_tp(1)
    with pytest.raises(ConfigError, match="tp=2 for GPT-2.*Conv1D.*tp=1"):
        adapter.check_tp(2)


def test_tied_head_is_refused_unless_untied() -> None:
    model = gpt2(tie_word_embeddings=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    with pytest.raises(ConfigError, match="untie=True"):
        from_hf(model)
    adapter = from_hf(model, untie=True)
    assert adapter.output.weight is not adapter.tok_emb.weight
    x = ids()
    torch.testing.assert_close(adapter(x), model(x).logits, atol=1e-6, rtol=0)
    # the HF model keeps its tie; the adapter's head is its own
    assert model.lm_head.weight is model.transformer.wte.weight
    with pytest.raises(ConfigError, match="untie=True"):
        from_hf(llama(tie_word_embeddings=True))


def test_bad_models_and_inputs_are_refused() -> None:
    eager = llama()
    eager.set_attn_implementation("eager")
    with pytest.raises(ConfigError, match="attn_implementation='eager'.*'sdpa'"):
        from_hf(eager)
    with pytest.raises(ConfigError, match="add_cross_attention=False"):
        from_hf(gpt2(add_cross_attention=True))
    with pytest.raises(ConfigError, match="LlamaForCausalLM or GPT2LMHeadModel, got Linear"):
        from_hf(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="got GPT2LMHeadModel"):
        HFLlama(gpt2())
    with pytest.raises(InputError, match="token ids"):
        from_hf(llama())(torch.zeros(2, SEQ, D_MODEL))
    with pytest.raises(InputError, match="n_positions=32"):
        from_hf(gpt2())(ids(seq=33))


def test_trained_through_parallelize_equal_one_process() -> None:
    """tests/dist/hf_checks.py on 4 torchrun ranks: Llama pp2 x tp2, dp2 x tp2 with a sparse
    embedding, pp2 x dp2 interleaved and balanced by measured time; GPT-2 pp2 x dp2 with its
    MLPs as experts over ep2; GPT-2 under tp2 refused on every rank."""
    from hf_checks import CHECKS
    from launch import assert_all_ok, launch

    results = launch("torchrun", "hf_checks.py", nprocs=4, timeout=400)
    assert_all_ok(results, nprocs=4, expected_checks=len(CHECKS))
