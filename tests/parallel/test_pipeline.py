"""Pipeline plans as data, checked without running anything: action lists, stage cuts, the
balanced split, and the configuration errors raised before any collective."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from sparta.errors import CollectiveTimeoutError, ConfigError
from sparta.parallel import (
    Decoder,
    DecoderConfig,
    MoESpec,
    ParallelConfig,
    ParallelDims,
    moe_layers,
    schedule_actions,
)
from sparta.parallel.dp_rules import ddp_needs_find_unused
from sparta.parallel.experts import check_expert_tp
from sparta.parallel.parallelize import tp_plan_of
from sparta.parallel.pipeline import (
    ModelParts,
    action_table,
    check_schedule,
    split_by_cost,
    split_by_points,
    stage_ids,
    stage_module,
    tied_across_parts,
)
from sparta.parallel.stage_failure import lost_peer_stage

CFG = DecoderConfig(vocab_size=300, seq_len=8, d_model=16, n_layers=6, n_heads=2, d_ff=32)


def test_action_lists_are_data() -> None:
    gpipe = schedule_actions("GPipe", pp=2, microbatches=2)
    assert gpipe[0][:4] == ["0F0", "0F1", "0B0", "0B1"]
    # every micro-batch's forward once, in order, on the last rank too (torch's table says 1F1 .. 1F4)
    one_f_one_b = schedule_actions("1F1B", pp=2, microbatches=4)
    assert [a for a in one_f_one_b[1] if "F" in a] == ["1F0", "1F1", "1F2", "1F3"]
    zbv = schedule_actions("ZBVZeroBubble", pp=2, microbatches=4, stages_per_rank=2)
    assert set(zbv) == {0, 1}
    # the V: rank 0 holds stages 0 and 3, and zero-bubble splits backward into I and W
    assert {a[0] for a in zbv[0]} == {"0", "3"} and any("W" in a for a in zbv[0])
    interleaved = schedule_actions("Interleaved1F1B", pp=2, microbatches=4, stages_per_rank=2)
    assert {a[0] for a in interleaved[1]} == {"1", "3"}
    assert stage_ids("ZBVZeroBubble", 2, 1, 2) == [1, 2] and stage_ids("Interleaved1F1B", 2, 1, 2) == [1, 3]
    # torch's table is built once per shape and kept read-only; each caller gets lists of its own
    assert action_table("ZBVZeroBubble", 2, 4, 2) is action_table("ZBVZeroBubble", 2, 4, 2)
    with pytest.raises(TypeError):
        action_table("ZBVZeroBubble", 2, 4, 2)[0] = ()  # type: ignore[index]
    zbv[0].clear()
    assert (
        schedule_actions("ZBVZeroBubble", pp=2, microbatches=4, stages_per_rank=2)[0]
        == list(action_table("ZBVZeroBubble", 2, 4, 2)[0])
        != []
    )


def test_stage_cuts_keep_full_names_and_chain_to_the_whole() -> None:
    torch.manual_seed(0)
    model = Decoder(CFG)
    parts = ModelParts.of(model)
    assert parts.first == ("tok_emb", "pos_emb") and parts.last == ("norm", "output")
    stages = split_by_points(parts, 3, ["layers.2", "layers.4"])
    assert stages == [["layers.0", "layers.1"], ["layers.2", "layers.3"], ["layers.4", "layers.5"]]
    cuts = [stage_module(model, parts, s, i == 0, i == 2) for i, s in enumerate(stages)]
    assert "layers.3.attn.wq.weight" in dict(cuts[1].named_parameters())
    assert "tok_emb.weight" not in dict(cuts[1].named_parameters())
    ids = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    h = ids
    for cut in cuts:
        h = cut(h)
    torch.testing.assert_close(h, model(ids), rtol=0, atol=0)
    # a final norm without weights is the last stage's alone, as one with them: were it
    # shared, every stage would apply it to its output
    model.norm = nn.LayerNorm(CFG.d_model, elementwise_affine=False)
    parts = ModelParts.of(model)
    assert parts.last == ("norm", "output") and "norm" not in parts.shared
    h = ids
    for i, s in enumerate(stages):
        h = stage_module(model, parts, s, i == 0, i == 2)(h)
    torch.testing.assert_close(h, model(ids), rtol=0, atol=0)
    # a weight shared by two parts would come apart in the stages' copies: found by name
    assert tied_across_parts(model, parts) is None
    model.output.weight = model.tok_emb.weight  # type: ignore[union-attr]
    assert tied_across_parts(model, parts) == ("tok_emb.weight", "output.weight")
    # the parts by their own names, wherever the layers live (GPT-2's "transformer.h.N")
    body = nn.Module()
    body.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    body.blocks[1].weight = body.blocks[0].weight
    assert tied_across_parts(body, ModelParts((), ("blocks.0", "blocks.1"), (), ())) == (
        "blocks.0.weight",
        "blocks.1.weight",
    )


def test_balanced_split_counts_embedding_and_head() -> None:
    parts = ModelParts(("emb",), tuple(f"layers.{i}" for i in range(4)), ("head",), ())
    costs = {"emb": 3.0, "layers.0": 1.0, "layers.1": 1.0, "layers.2": 1.0, "layers.3": 1.0, "head": 0.0}
    # the embedding's 3 s makes stage 0 the slow one unless it holds a single layer
    assert split_by_cost(parts, 2, costs) == [["layers.0"], ["layers.1", "layers.2", "layers.3"]]
    costs["head"] = 3.0
    assert split_by_cost(parts, 2, costs) == [["layers.0", "layers.1"], ["layers.2", "layers.3"]]


def test_bad_plans_raise_config_errors() -> None:
    parts = ModelParts.of(Decoder(CFG))
    with pytest.raises(ConfigError, match="name no layer"):
        split_by_points(parts, 2, ["layers.9"])
    with pytest.raises(ConfigError, match="increasing order"):
        split_by_points(parts, 3, ["layers.4", "layers.2"])
    with pytest.raises(ConfigError, match="every stage needs one"):
        ParallelConfig(schedule="Interleaved1F1B", stages_per_rank=4, microbatches=2).check(ParallelDims(pp=2), 6)
    with pytest.raises(ConfigError, match="at least as many micro-batches"):
        check_schedule("Interleaved1F1B", pp=4, microbatches=2, stages_per_rank=2)
    with pytest.raises(ConfigError, match="two stages on each rank"):
        check_schedule("DualPipeV", pp=2, microbatches=4, stages_per_rank=1)
    with pytest.raises(ConfigError, match="unknown"):
        ParallelConfig(schedule="1f1b-ish")
    with pytest.raises(ConfigError, match="zero-bubble"):
        ParallelConfig(schedule="ZBVZeroBubble", stages_per_rank=2, microbatches=2, data_parallel="ddp").check(
            ParallelDims(pp=2, dp=2)
        )
    # where torch DDP's first-step bucket rebuild would fail, the trainer runs it with
    # find_unused_parameters=True (parity: test_trainer_dist's "ddp_pp" launch)
    # (pp 1 with one stage runs no schedule: a forward before each backward)
    for schedule, spr, pp, m, needs in (("GPipe", 1, 2, 2, True), ("Interleaved1F1B", 2, 2, 2, True),
                                        ("1F1B", 1, 2, 2, True), ("1F1B", 1, 2, 3, False), ("1F1B", 1, 1, 4, False),
                                        ("GPipe", 1, 2, 1, False), ("GPipe", 1, 1, 4, False)):  # fmt: skip
        ParallelConfig(schedule=schedule, stages_per_rank=spr, microbatches=m, data_parallel="ddp").check(
            ParallelDims(pp=pp, dp=2)
        )
        assert ddp_needs_find_unused(schedule, pp, m, spr) is needs, (schedule, pp, m)
    assert ddp_needs_find_unused("GPipe", 1, 4, 2)  # pp 1 with a vocabulary stage: a schedule runs
    with pytest.raises(ConfigError, match="DTensor"):
        ParallelConfig(data_parallel="ddp").check(ParallelDims(dp=2, tp=2))
    with pytest.raises(ConfigError, match="horovodrun"):
        ParallelConfig(data_parallel="horovod").check(ParallelDims(dp=2), backend="torch")
    with pytest.raises(ConfigError, match="does not divide over ep"):
        ParallelConfig(moe=MoESpec(num_experts=6)).check(ParallelDims(dp=4, ep=4))
    with pytest.raises(ConfigError, match="no experts to split"):
        ParallelConfig().check(ParallelDims(dp=2, ep=2))
    with pytest.raises(ConfigError, match="multiply to"):
        ParallelDims(pp=2, dp=2, tp=2).check(4)
    with pytest.raises(ConfigError, match="must divide dp"):
        ParallelDims(dp=6, ep=4)
    with pytest.raises(ConfigError, match="positive integer"):
        ParallelDims(pp=0)


def test_experts_split_over_tp_need_aligned_slices() -> None:
    """check_expert_tp (what parallelize runs before any collective): tp must cut every MoE
    layer's d_ff into slices grouped_mm takes, 16-byte rows in the experts' dtype."""
    model = Decoder(DecoderConfig(vocab_size=300, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=24))
    moe_layers(model, MoESpec(num_experts=2, top_k=1), None)
    check_expert_tp(model, 2)  # 12 float32 units: 48-byte rows
    with pytest.raises(ConfigError, match=r"d_ff=24 over tp=4 into 6 units, rows of 24 bytes"):
        check_expert_tp(model, 4)
    with pytest.raises(ConfigError, match=r"d_ff=24 over tp=5: pick a tp"):
        check_expert_tp(model, 5)


def test_the_head_splits_its_vocabulary_over_tp_where_it_can() -> None:
    """tp_plan_of gives the last stage's head the "vocab" style (colwise, the loss on the
    shards) where tp divides an untied head's vocabulary, and leaves it whole otherwise."""
    cfg = DecoderConfig(vocab_size=300, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=24)
    model = Decoder(cfg)
    parts = ModelParts.of(model)
    last = stage_module(model, parts, ["layers.1"], False, True)
    assert tp_plan_of(last, 2)["output"] == "vocab"
    assert "output" not in tp_plan_of(last, 2, vocab_head=False)  # ParallelConfig.vocab_parallel_head=False
    odd = Decoder(DecoderConfig(vocab_size=301, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=24))
    assert "output" not in tp_plan_of(odd, 2)  # 301 rows over 2 ranks: whole on each
    assert "output" not in tp_plan_of(stage_module(model, parts, ["layers.0"], True, False), 2)  # no head here
    tied = Decoder(cfg)
    tied.output.weight = tied.tok_emb.weight  # type: ignore[union-attr]
    assert "output" not in tp_plan_of(tied, 2)


def _raised(fn: Callable[[], None]) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001  (the exception, with its traceback, is the value)
        return exc
    raise AssertionError(f"{fn} did not raise")


def test_only_a_lost_peer_stage_is_reported_as_one() -> None:
    """`ParallelModel.step` names a failure a peer stage's only where it came from torch's
    send/receive wait with gloo's words for a lost peer; the same words from a stage's FSDP2
    or TP collectives (another group), a SpartaError (which names its own group) or other
    words stay as they are. The frame is the schedule's own function name."""
    lost = (
        "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete",
        "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:40351",
        "Connection reset by peer",
        "Write error: Broken pipe",
    )
    for words in lost:

        def _wait_batch_p2p(words: str = words) -> None:
            raise RuntimeError(words)

        def all_reduce(words: str = words) -> None:
            raise RuntimeError(words)

        assert lost_peer_stage(_raised(_wait_batch_p2p)), words
        assert not lost_peer_stage(_raised(all_reduce)), words

    def _wait_batch_p2p() -> None:
        raise RuntimeError("shape mismatch: [2, 8, 16] vs [2, 6, 16]")

    assert not lost_peer_stage(_raised(_wait_batch_p2p))

    def _wait_batch_p2p() -> None:  # noqa: F811  (a third frame of that name)
        raise CollectiveTimeoutError("all_to_all on rank 0 of group 'world' did not complete within 5 s")

    assert not lost_peer_stage(_raised(_wait_batch_p2p))
