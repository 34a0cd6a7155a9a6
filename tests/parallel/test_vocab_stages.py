"""Vocabulary parallelism over the pipeline ranks (ParallelConfig.vocab_stages) in one
process: the chain of head stages equals cross-entropy on the whole logits, in value and in
every gradient; a one-rank pipeline with a head stage trains as the plain model; the head
stage's rows save as a chunk of the whole head; bad values are refused by name. The
multi-rank parity (pp 2, zero-bubble and looped schedules, tp, MoE) is in
tests/dist/parallel_checks.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import sparta
from sparta.errors import ConfigError, InputError
from sparta.parallel import Decoder, DecoderConfig, ParallelConfig, ParallelDims, build_layout, parallelize
from sparta.parallel.checkpoint_state import model_slots
from sparta.parallel.config_file import load_config
from sparta.parallel.pipeline import ModelParts
from sparta.parallel.vocab_stages import HeadStage, TakenRows, embedding_stage, head_stage, shard_rows, token_loss
from sparta.scheduling.varlen import IGNORE_INDEX

CFG = DecoderConfig(vocab_size=67, seq_len=8, d_model=16, n_layers=4, n_heads=4, d_ff=32)


def _targets(shape: tuple[int, int], seed: int) -> torch.Tensor:
    targets = torch.randint(0, CFG.vocab_size, shape, generator=torch.Generator().manual_seed(seed))
    targets[0, -2:] = IGNORE_INDEX  # padding: no loss, no gradient
    return targets


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_the_head_stages_chained_equal_cross_entropy_and_its_gradients(shards: int) -> None:
    torch.manual_seed(0)
    model = Decoder(CFG)
    nn.init.normal_(model.norm.weight, 1.0, 0.3)  # type: ignore[union-attr]
    parts = ModelParts.of(model)
    stages = [head_stage(model, parts, k, shards) for k in range(shards)]
    h = torch.randn(2, CFG.seq_len, CFG.d_model, requires_grad=True)
    targets = _targets((2, CFG.seq_len), 1)
    x = h
    for stage in stages:
        stage.feed([targets])
        x = stage(x)
    assert x.shape == (2, CFG.seq_len) and all(s.pending == 0 for s in stages)
    loss = token_loss(x, targets)
    loss.backward()
    ref_h = h.detach().clone().requires_grad_(True)
    logits = model.output(model.norm(ref_h))  # type: ignore[misc]
    want = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=0, atol=2e-6)
    torch.testing.assert_close(h.grad, ref_h.grad, rtol=0, atol=1e-7)
    rows = torch.cat([s.head.weight.grad for s in stages])  # type: ignore[misc]
    torch.testing.assert_close(rows, model.output.weight.grad, rtol=0, atol=1e-7)  # type: ignore[union-attr]
    for name in ("weight", "bias"):  # the final norm, on shard 0 only
        got = getattr(stages[0].get_submodule("norm"), name).grad
        torch.testing.assert_close(got, getattr(model.norm, name).grad, rtol=0, atol=1e-6)
    assert all(not hasattr(s, "norm") for s in stages[1:])
    # names are the full model's: a head stage's state_dict keys are the model's own
    assert set(stages[0].state_dict()) == {"norm.weight", "norm.bias", "output.weight"}


def test_shard_rows_split_the_vocabulary_evenly() -> None:
    assert shard_rows(67, 3) == [(0, 23), (23, 45), (45, 67)]
    assert shard_rows(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ConfigError, match=r"3 vocabulary rows cannot be split into 4 parts \(one per pipeline rank"):
        shard_rows(3, 4)


def test_targets_are_taken_in_order_and_a_mismatch_raises() -> None:
    torch.manual_seed(0)
    model = Decoder(CFG)
    stage = head_stage(model, ModelParts.of(model), 0, 1)
    h = torch.randn(1, CFG.seq_len, CFG.d_model)
    with pytest.raises(InputError, match="ran a forward without targets"):
        stage(h)
    first, second = _targets((1, CFG.seq_len), 1), _targets((1, CFG.seq_len), 2)
    stage.feed([first, second], inference=True)  # shape inference takes micro-batch 0 once more
    assert stage.pending == 3
    outs = [stage(h) for _ in range(3)]
    torch.testing.assert_close(outs[0], outs[1])
    assert not torch.equal(outs[1], outs[2])
    stage.feed([first])
    with pytest.raises(InputError, match="1 micro-batches of targets were fed but never run"):
        stage.feed([first])


def test_the_head_must_be_an_untied_bias_free_linear() -> None:
    parts_of = ModelParts.of
    model = Decoder(CFG)
    model.output = nn.Linear(CFG.d_model, CFG.vocab_size)  # with a bias
    with pytest.raises(ConfigError, match="nn.Linear without bias, not Linear with a bias"):
        head_stage(model, parts_of(model), 0, 2)

    class Capped(nn.Linear):  # a forward of its own, which the head stages would skip
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).clamp(-5, 5)

    model = Decoder(CFG)
    model.output = Capped(CFG.d_model, CFG.vocab_size, bias=False)
    with pytest.raises(ConfigError, match="a plain nn.Linear without bias, not Capped"):
        head_stage(model, parts_of(model), 0, 2)
    model = Decoder(CFG)
    model.output.weight = model.tok_emb.weight  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="shares its weight with tok_emb.weight.*untie"):
        head_stage(model, parts_of(model), 0, 2)


def test_bad_configurations_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"vocab_stages put\(s\) 1 stage\(s\) .* needs stages_per_rank >= 2"):
        ParallelConfig(vocab_stages=True).check(ParallelDims())
    config = ParallelConfig(schedule="Interleaved1F1B", microbatches=2, stages_per_rank=2, vocab_stages=True)
    with pytest.raises(ConfigError, match=r"names stage 2, an embedding or head stage .*: use indices 0\.\.1"):
        dataclasses.replace(config, recompute=(2,)).check(ParallelDims(pp=2))
    with pytest.raises(ConfigError, match=r"2 of them vocab_stages\) but the model has 1 layers for the other 2"):
        config.check(ParallelDims(pp=2), n_layers=1)
    config.check(ParallelDims(pp=2), n_layers=2)
    assert config.body_stages(2) == 2 and ParallelConfig().body_stages(2) == 2
    both = dataclasses.replace(config, embedding_stages=True)
    with pytest.raises(ConfigError, match=r"embedding_stages and vocab_stages .* needs stages_per_rank >= 3"):
        both.check(ParallelDims(pp=2))
    both = dataclasses.replace(both, stages_per_rank=3, recompute=(1,))
    with pytest.raises(ConfigError, match=r"names stage 1, an embedding or head stage .*: use indices 2\.\.3"):
        both.check(ParallelDims(pp=2))
    both = dataclasses.replace(both, recompute=(2, 3))
    both.check(ParallelDims(pp=2), n_layers=2)
    assert (both.body_stages(2), both.first_body(2)) == (2, 2)
    with pytest.raises(ConfigError, match="places two stages on each rank"):
        dataclasses.replace(both, schedule="ZBVZeroBubble").check(ParallelDims(pp=2))


@pytest.mark.parametrize("shards", [1, 3])
def test_the_embedding_stages_chained_equal_the_lookup_and_its_gradients(shards: int) -> None:
    torch.manual_seed(0)
    model = Decoder(CFG)
    model.tok_emb = nn.Embedding(CFG.vocab_size, CFG.d_model, padding_idx=30)  # in shard 1 of 3
    parts = ModelParts.of(model)
    stages = [embedding_stage(model, parts, k, shards) for k in range(shards)]
    ids = _targets((2, CFG.seq_len), 3).clamp(min=0)
    ids[1, :3] = 30
    x = ids
    for stage in stages:
        x = stage(x)
    assert x.shape == (2, CFG.seq_len, CFG.d_model + 1) and torch.equal(x[..., -1].long(), ids)
    rows = TakenRows(torch.float32)(x)
    want = model.tok_emb(ids)
    torch.testing.assert_close(rows, want, rtol=0, atol=0)
    grad = torch.randn_like(want)
    rows.backward(grad)
    want.backward(grad)
    got = torch.cat([s.tok_emb.weight.grad for s in stages])  # type: ignore[union-attr]
    torch.testing.assert_close(got, model.tok_emb.weight.grad, rtol=0, atol=1e-6)
    assert not got[30].any()  # the padding row learns nothing, as in the table
    assert set(stages[-1].state_dict()) == {"tok_emb.weight"}


def test_the_token_embedding_must_be_a_plain_table() -> None:
    model = Decoder(CFG)
    model.tok_emb = nn.Embedding(CFG.vocab_size, CFG.d_model, scale_grad_by_freq=True)
    with pytest.raises(ConfigError, match=r"\['scale_grad_by_freq'\] cannot follow"):
        embedding_stage(model, ModelParts.of(model), 0, 2)
    model.tok_emb = nn.Linear(2, 2)  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="must be a plain nn.Embedding, not Linear"):
        embedding_stage(model, ModelParts.of(model), 0, 2)

    class Scaled(nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * 4

    model.tok_emb = Scaled(CFG.vocab_size, CFG.d_model)
    with pytest.raises(ConfigError, match="must be a plain nn.Embedding, not Scaled"):
        embedding_stage(model, ModelParts.of(model), 0, 2)
    model.tok_emb = nn.Embedding(2**24 + 1, CFG.d_model, device="meta")  # ids past float32's exact integers
    with pytest.raises(ConfigError, match="exact up to 16,777,216, but 'tok_emb' has 16,777,217 rows"):
        embedding_stage(model, ModelParts.of(model), 0, 2)


@pytest.mark.parametrize("embedding_stages", [False, True])
def test_a_one_rank_pipeline_with_a_head_stage_trains_as_the_plain_model(embedding_stages: bool) -> None:
    world = sparta.init(backend="torch")
    layout = build_layout(ParallelDims(), world)
    torch.manual_seed(0)
    plain = Decoder(CFG)
    model = copy.deepcopy(plain)
    ids = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=torch.Generator().manual_seed(2))
    ids, targets = ids[:, :-1], ids[:, 1:].clone()
    targets[1, -3:] = IGNORE_INDEX
    config = ParallelConfig(schedule="Interleaved1F1B", microbatches=2, stages_per_rank=2 + embedding_stages,
                            vocab_stages=True, embedding_stages=embedding_stages)  # fmt: skip
    pm = parallelize(model, layout, config)
    runs = []
    try:
        for _ in range(2):  # the second step runs without the schedule's shape inference
            loss = pm.step(ids, targets)
            runs.append((loss, {n: p.grad.clone() for part in pm.parts for n, p in part.named_parameters()}))
            for part in pm.parts:
                part.zero_grad(set_to_none=True)
        probe = pm.evaluate(ids, targets)
    finally:
        pm.close()
    head = 1 + embedding_stages
    assert f"stage {head}: norm, output[0:67]" in str(pm.plan), str(pm.plan)
    assert ("stage 0: tok_emb[0:67]" in str(pm.plan)) == embedding_stages, str(pm.plan)
    assert isinstance(pm.parts[head], HeadStage) and pm.parts[head].pending == 0
    # the plain model on the same two micro-batches: the mean of their mean losses and gradients
    want = [
        nn.functional.cross_entropy(plain(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
        for x, y in zip(ids.tensor_split(2), targets.tensor_split(2), strict=True)
    ]
    mean = sum(want) / 2
    mean.backward()  # type: ignore[union-attr]
    assert probe == pytest.approx(mean.item(), abs=1e-6)
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for loss, got in runs:
        assert loss == pytest.approx(mean.item(), abs=1e-6) and set(got) == set(grads)
        for name, grad in got.items():
            torch.testing.assert_close(grad, grads[name], rtol=0, atol=1e-6, msg=name)
    slots = {s.key: s for s in model_slots(pm.parts)}
    assert set(slots) == set(plain.state_dict())  # the full model's keys, each once
    for key in ("output.weight", "tok_emb.weight") if embedding_stages else ("output.weight",):
        assert (slots[key].offsets, slots[key].size) == ((0, 0), (CFG.vocab_size, CFG.d_model)), key


def test_the_run_file_takes_vocab_stages() -> None:
    base = ["data.source='random'", "parallel.pp=2", "parallel.microbatches=2", "parallel.stages_per_rank=2",
            "parallel.schedule='Interleaved1F1B'", "parallel.vocab_stages=true"]  # fmt: skip
    # split points name the layers' stages only: two here, the head's two come after them
    config = load_config(None, [*base, "parallel.split_points=['layers.2']"])
    assert config.parallel.vocab_stages and config.parallel.body_stages(2) == 2
    with pytest.raises(ConfigError, match=r"must name 1 distinct layers"):
        load_config(None, [*base, "parallel.split_points=['layers.1', 'layers.2', 'layers.3']"])
    with pytest.raises(ConfigError, match="vocab_stages with data_parallel = 'fsdp' and a checkpoint.dir"):
        load_config(None, [*base, "parallel.data_parallel='fsdp'", "checkpoint.dir='/tmp/x'"])


def test_sequences_past_the_models_positions_are_refused_before_any_step() -> None:
    """A padded length past the position table failed on the first stage alone, at the
    first step, while the other stages waited: now parallelize refuses it on every rank."""
    world = sparta.init(backend="torch")
    layout = build_layout(ParallelDims(), world)
    too_long = f"sequences of {CFG.seq_len + 4} tokens .* exceed the {CFG.seq_len} positions"
    with pytest.raises(ConfigError, match=too_long):
        parallelize(Decoder(CFG), layout, ParallelConfig(lengths=(4, CFG.seq_len + 4)))
    assert parallelize(Decoder(CFG), layout, ParallelConfig(seq_len=CFG.seq_len)).plan is not None
