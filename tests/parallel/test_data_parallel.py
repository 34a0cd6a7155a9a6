"""DataParallel in a plain loop: a Hugging Face GPT-2 with expert-parallel MLPs and sparse
embeddings on 4 ranks trains like one process on the global batch (5 SGD steps, within
1e-5) under the engine's own strategy and "sparta" with and without its priority queue; the
path that averaged expert weights as dense ones is shown wrong and is refused
(tests/dist/data_parallel_checks.py). In one process: a table's rows through the queue."""

from __future__ import annotations

import pytest
import torch
from launch import assert_all_ok, launch, require_launcher

import sparta
from sparta.embedding import SparseEmbedding
from sparta.errors import ConfigError
from sparta.parallel import DataParallel, ParallelDims, build_layout
from tests.dist.data_parallel_checks import CHECKS


@pytest.mark.parametrize("launcher", ["torchrun", "horovodrun"])
def test_gpt2_with_experts_and_sparse_embeddings_equals_one_process(launcher: str) -> None:
    require_launcher(launcher)
    results = launch(launcher, "data_parallel_checks.py", nprocs=4, timeout=400)
    assert_all_ok(results, nprocs=4, expected_checks=len(CHECKS))


def test_queued_table_rows_and_a_step_that_never_looks_it_up() -> None:
    """One process: with microbatches=1 the table's rows are a task of the queue and land in
    its gradient at finish(); a step whose loss never reaches the table sends an empty task
    (every rank would, so the queue stays in step) and leaves its gradient alone."""
    world = sparta.init(backend="torch")
    layout = build_layout(ParallelDims(dp=1), world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(SparseEmbedding(10, 4, comm=layout.dp), torch.nn.Linear(4, 1))
    reference = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1))
    reference.load_state_dict({"0.weight": model[0].full_weight(), **model[1].state_dict(prefix="1.")})
    dp = DataParallel(layout, "sparta", microbatches=1, zero_bubble=False)
    dp.wrap(model)
    assert [key.name for _, key in dp.tables] == ["table 0 0"]
    ids = torch.tensor([[1, 2, 2], [7, 1, 0]])
    dp.start()
    model[1](torch.ones(2, 4)).sum().backward()  # the table's rows never needed
    dp.finish()
    assert model[0].weight.grad is None and [k.name for k, _ in dp.queue.issue_log] == ["dense 0", "table 0 0"]
    model.zero_grad()
    dp.start()
    model(ids).square().sum().backward()
    assert model[0].weight.grad is None, "the rows were to wait in the queue until finish()"
    dp.finish()
    reference(ids).square().sum().backward()
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad)
    torch.testing.assert_close(model[1].weight.grad, reference[1].weight.grad)
    dp.close()
    assert model[0]._queue is None


def test_fsdp_units_follow_the_decoder() -> None:
    """FSDP2's units under "fsdp": the token embedding, each layer, then the final norm and
    head together (kept gathered from forward to backward); a tied head stays with the root,
    and a sharded table (its weight ignored by FSDP) or a vocabulary stage's rows is no unit."""
    from sparta.parallel import Decoder, DecoderConfig
    from sparta.parallel.dp_rules import fsdp_units
    from sparta.parallel.pipeline import ModelParts
    from sparta.parallel.vocab_stages import embedding_stage, head_stage

    model = Decoder(DecoderConfig(vocab_size=32, seq_len=8, d_model=8, n_layers=2, n_heads=2, d_ff=16))
    units = fsdp_units(model, set())
    assert units == [
        ([model.tok_emb], True),
        ([model.layers["0"]], True),
        ([model.layers["1"]], True),
        ([model.norm, model.output], False),
    ]
    assert fsdp_units(model, {model.tok_emb.weight})[0] == ([model.layers["0"]], True)
    # a vocabulary stage's rows stay in the stage's own unit: an embedding stage reads their
    # weight in its own forward, so a unit of theirs would be found sharded
    parts = ModelParts(("tok_emb",), ("layers.0", "layers.1"), ("norm", "output"), ())
    for stage in (embedding_stage(model, parts, 0, 2), head_stage(model, parts, 0, 2), head_stage(model, parts, 1, 2)):
        assert fsdp_units(stage, set()) == [], stage
    model.output.weight = model.tok_emb.weight
    assert fsdp_units(model, set()) == [([model.layers["0"]], True), ([model.layers["1"]], True)]


def test_bucket_shares_cuts_a_model_that_fits_one_bucket() -> None:
    """Four 1 MiB layers fit one 25 MiB bucket, sent only once backward is done; bucket_shares=5
    closes a bucket every 1 MiB or so (each layer's, in backward's order), and the sums
    are the same. Other strategies refuse the option."""
    world = sparta.init(backend="torch")
    layout = build_layout(ParallelDims(dp=1), world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(4)])
    x = torch.randn(3, 512)
    grads = []
    for least, names in ((1, ["dense 0"]), (5, [f"dense {i}" for i in range(4)])):
        dp = DataParallel(layout, "sparta", 1, False, bucket_shares=least)
        dp.wrap(model)
        model.zero_grad()
        dp.start()
        model(x).square().sum().backward()
        dp.finish()
        assert dp.queue is not None and [k.name for k, _ in dp.queue.issue_log] == names, dp.queue.issue_log
        # backward's order: the last layer's bucket first, keyed by its place in the forward
        assert [k.priority for k, _ in dp.queue.issue_log] == sorted(
            (k.priority for k, _ in dp.queue.issue_log), reverse=True
        )
        grads.append([p.grad.clone() for p in model.parameters()])
        dp.close()
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ConfigError, match=r"bucket_shares=0.*positive integer"):
        DataParallel(layout, "sparta", 1, False, bucket_shares=0)
    with pytest.raises(ConfigError, match=r"bucket_shares choose how data_parallel='sparta' sends"):
        DataParallel(layout, "ddp", 1, False, bucket_shares=3)
    world.shutdown()
