"""What each part of a layer costs the simulator under each layout (one process, hand-made cost
tables): fixed costs and halves measured under tensor parallelism, experts with and without
expert parallelism, sparse tables and their row exchanges, and the activations a stage saves."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparta.parallel import MoESpec, ParallelConfig, ParallelDims
from sparta.planner import (
    GIB,
    ModelCosts,
    PartCost,
    Plan,
    Prediction,
    Space,
    Workload,
    search,
    simulate,
)
from sparta.planner.parts import saved_activation_bytes
from sparta.planner.search import SPARSE_STAGES
from sparta.planner.stage_cost import StageCost, stage_cost

from .cost_tables import MODEL, WORK, const, costs, plan


def test_a_parts_fixed_cost_is_not_split_over_tp() -> None:
    # every part 1 s per forward call whatever its tokens, nothing else: tp2 halves no second
    # (launch and Python overheads are every tp rank's, whole)
    c = costs()
    zero = const(0.0)
    fixed = dataclasses.replace(
        c, parts={k: dataclasses.replace(v, fwd=const(1.0), bwd=zero, bwd_input=zero) for k, v in c.parts.items()}
    )
    one_rank = simulate(fixed, WORK, plan(1, "1F1B", 1, ())).step_s
    assert one_rank == pytest.approx(1 + 4 * 2 + 1)  # embedding, 4 blocks x 2 parts, head
    assert simulate(fixed, WORK, plan(1, "1F1B", 1, (), tp=2)).step_s == pytest.approx(one_rank)


def test_halves_measured_under_tp_replace_the_split_and_its_all_reduces() -> None:
    c = costs(comm_s=0.25)
    zero = const(0.0)
    measured = PartCost(const(1.0), zero, zero, 1.0, 1000)  # 1 s forward, its all-reduces inside
    c.parts.update({"attention/tp2": measured, "mlp/tp2": measured})
    # 4 blocks x 2 halves x 1 s, nothing else per block; the head's input-gradient all-reduce;
    # then the step's two scalar all-reduces
    assert simulate(c, WORK, plan(1, "1F1B", 1, (), tp=2)).step_s == pytest.approx(8 + 0.25 + 2 * 0.25)
    # tp4 has no measurement here: the plain halves over 4 plus their all-reduces, as before
    tp4 = simulate(dataclasses.replace(c, world=4), WORK, plan(1, "1F1B", 1, (), tp=4)).step_s
    assert tp4 == pytest.approx(4 * (0.5 + 2 * 0.25) + 4 * (1.0 + 2 * 0.25) + 0.25 + 2 * 0.25)


def test_a_tp_halfs_waiting_is_not_slowed_by_the_hosts_other_ranks() -> None:
    # 8 ranks on a host of 2 slots, all busy (pp1 dp4 tp2): compute runs at 2 / 8 of its
    # speed, but what a half spent waiting in its all-reduces when measured stays as it was
    c = dataclasses.replace(costs(groups=(2, 4, 8)), slots=2, ranks_per_host=8, world=8)
    zero = const(0.0)
    for busy, per_half in ((1.0, 1.0 / 0.25), (0.5, 0.5 / 0.25 + 0.5)):
        half = PartCost(const(1.0), zero, zero, 1.0, 1000, busy)
        c.parts.update({"attention/tp2": half, "mlp/tp2": half})
        assert simulate(c, WORK, plan(1, "1F1B", 1, (), dp=4, tp=2)).step_s == pytest.approx(8 * per_half), busy


def test_experts_are_dense_parameters_without_expert_parallelism() -> None:
    # at ep1 the trainer finds no expert group (`dp_rules.expert_parameters`): the experts are
    # their layer's own parameters, in its FSDP2 unit and the dense gradients' reduction; over
    # ep they are reduced over their replicas alone, in no unit
    moe = MoESpec(num_experts=4, top_k=2, every=1)
    work = Workload(MODEL, moe, 8)
    c = costs(moe=moe)
    experts = c.parts["moe"].params - MODEL.d_model * moe.num_experts  # all but the router

    def stage(ep: int) -> StageCost:
        plan = Plan(ParallelDims(dp=2, ep=ep), ParallelConfig(moe=moe, split_points=(), data_parallel="fsdp"))
        return stage_cost(c, work, plan, 0, list(range(MODEL.n_layers)), 32.0)

    alone, spread = stage(1), stage(2)
    assert alone.expert_params == 0 and spread.expert_params == MODEL.n_layers * experts / 2
    assert alone.dense_params == spread.dense_params + MODEL.n_layers * experts
    layer_units = [n for n, _ in alone.units if n > 1000]  # attention's 1000 and the MoE layer's
    assert layer_units == [1000 + c.parts["moe"].params] * MODEL.n_layers
    assert [n for n, _ in spread.units if n > 1000] == [1000 + c.parts["moe"].params - experts] * MODEL.n_layers


def test_sparse_tables_are_held_in_shards_and_exchange_their_rows() -> None:
    # embedding="sparse" row-shards the token and position tables over dp (swap_embeddings):
    # a rank holds 1/dp of them, outside the dense reduction and FSDP2's units, and each
    # table's forward exchanges counts, ids and rows, its backward the rows' gradients
    c = costs(comm_s=0.25)
    tables = (MODEL.vocab_size + MODEL.seq_len) * MODEL.d_model
    c.parts["embed"] = dataclasses.replace(c.parts["embed"], params=tables)

    def first(embedding: str, strategy: str = "sparta") -> StageCost:
        config = ParallelConfig(split_points=("layers.2",), embedding=embedding, data_parallel=strategy)
        return stage_cost(c, WORK, Plan(ParallelDims(pp=2, dp=2), config), 0, [0, 1], 32.0)

    dense, sparse = first("dense"), first("sparse")
    assert dense.dense_params - sparse.dense_params == tables
    assert sparse.params == sparse.dense_params + tables / 2 and sparse.expert_params == 0
    assert sparse.fwd_comm - dense.fwd_comm == pytest.approx(2 * 3 * 0.25)
    assert sparse.bwd_comm - dense.bwd_comm == pytest.approx(2 * 0.25)
    # under zero-bubble schedules the rows' gradients go in the weight pass W, the embedding's
    # own backward (replay.py prices W with it)
    assert sparse.weight_comm == pytest.approx(2 * 0.25) and dense.weight_comm == 0
    assert sum(n for n, _ in dense.units) - sum(n for n, _ in first("sparse", "fsdp").units) == tables
    # recomputation runs the blocks' forward again, not the embedding's row exchange
    again = ParallelConfig(split_points=("layers.2",), embedding="sparse", recompute=(0,))
    recomputed = stage_cost(c, WORK, Plan(ParallelDims(pp=2, dp=2), again), 0, [0, 1], 32.0)
    assert recomputed.bwd_comm == pytest.approx(sparse.bwd_comm) and recomputed.fwd_comm == sparse.fwd_comm
    # a rank's memory: the shards' 16 bytes a row parameter once (fsdp divides them no second
    # time); the dense tables' half more replicated, and 4 bytes in sparta's bucket buffers
    # (the shards stay out of them), or under fsdp gathered whole with gradients
    for strategy, more in (("sparta", 12), ("fsdp", 8)):
        peak = {}
        for embedding in ("dense", "sparse"):
            config = ParallelConfig(
                microbatches=2, split_points=("layers.2",), embedding=embedding, data_parallel=strategy
            )
            peak[embedding] = simulate(c, WORK, Plan(ParallelDims(pp=2, dp=2), config)).peak_bytes[0]
        assert peak["dense"] - peak["sparse"] == pytest.approx(more * tables), strategy


def test_under_embedding_stages_only_the_tables_beside_the_layers_are_sharded() -> None:
    # embedding_stages: the token table's rows lie on the pp embedding stages, dense, whatever
    # ``embedding`` says; the position table stays on the layers' first stage, which
    # embedding="sparse" row-shards over dp and whose rows alone travel (3 + 1 exchanges)
    c = costs(comm_s=0.25)
    token, position = MODEL.vocab_size * MODEL.d_model, MODEL.seq_len * MODEL.d_model
    c.parts["embed"] = dataclasses.replace(c.parts["embed"], params=token + position)

    def stage(index: int, layers: list[int], embedding: str) -> StageCost:
        config = ParallelConfig(schedule="Interleaved1F1B", microbatches=2, stages_per_rank=2,
                                split_points=("layers.2",), embedding=embedding, embedding_stages=True)  # fmt: skip
        return stage_cost(c, WORK, Plan(ParallelDims(pp=2, dp=2), config), index, layers, 32.0)

    for embedding in ("dense", "sparse"):
        rows = [stage(i, [], embedding) for i in (0, 1)]
        assert [s.dense_params for s in rows] == [token / 2] * 2, embedding
        assert [s.params for s in rows] == [token / 2] * 2 and rows[0].fwd_comm == rows[0].bwd_comm == 0.0
    dense, sparse = stage(2, [0, 1], "dense"), stage(2, [0, 1], "sparse")
    assert dense.dense_params - sparse.dense_params == position
    assert sparse.params == sparse.dense_params + position / 2
    assert sparse.fwd_comm - dense.fwd_comm == pytest.approx(3 * 0.25)
    assert sparse.bwd_comm - dense.bwd_comm == pytest.approx(0.25)
    # the model's parameters once over the stages (the position table was the embedding
    # stages' before)
    layers = stage(2, [0, 1], "dense").dense_params + stage(3, [2, 3], "dense").dense_params
    plain = Plan(ParallelDims(pp=2, dp=2), ParallelConfig(split_points=("layers.2",)))
    whole = sum(stage_cost(c, WORK, plain, i, [2 * i, 2 * i + 1], 32.0).dense_params for i in (0, 1))
    assert 2 * (token / 2) + layers == pytest.approx(whole)
    # the search tries sparse tables with embedding stages, and refuses them (by name) for a
    # model whose only table is the token table
    space = Space(schedules=("Interleaved1F1B",), strategies=("sparta",))
    found = search(c, WORK, 4, GIB, ParallelConfig(), space)
    assert any("sparse-embedding" in r.plan.describe() and r.plan.config.embedding_stages for r in found.fits)
    assert SPARSE_STAGES not in found.rejected
    c.parts["embed"] = dataclasses.replace(c.parts["embed"], params=token)
    alone = search(c, WORK, 4, GIB, ParallelConfig(), space)
    assert alone.rejected[SPARSE_STAGES] > 0
    assert not any(r.plan.config.embedding == "sparse" and r.plan.config.embedding_stages for r in alone.fits)


def test_an_moe_layer_measured_under_ep_replaces_its_modelled_all_to_alls() -> None:
    moe = MoESpec(num_experts=4, top_k=2, every=1)
    work = Workload(MODEL, moe, 8)
    c = costs(comm_s=0.25, moe=moe)

    def step(c: ModelCosts, **dims: int) -> float:
        config = ParallelConfig(moe=moe, split_points=())
        return simulate(c, work, Plan(ParallelDims(dp=2, ep=2, **dims), config)).step_s

    # 32 tokens a rank; 4 blocks: attention 0.5 s + MoE 0.5 s forward with 2 all-to-alls,
    # 1 + 1 s backward with 2; the step's two scalar all-reduces; the dp all-reduce of its
    # one bucket after the backward
    assert step(c) == pytest.approx(4 * (1.0 + 2 * 0.25) + 4 * (2.0 + 2 * 0.25) + 2 * 0.25 + 0.25)
    # measured with its experts over 2 ranks, its exchanges inside: 3 s forward, nothing else
    zero = const(0.0)
    measured = dataclasses.replace(c, parts={**c.parts, "moe/ep2": PartCost(const(3.0), zero, zero, 1.0, 1000)})
    assert step(measured) == pytest.approx(4 * (0.5 + 3.0) + 4 * 1.0 + 2 * 0.25 + 0.25)
    # under tp the layer's ep group spans ranks tp apart, not the adjacent ones it was timed on
    wide = dataclasses.replace(measured, world=4)
    assert step(wide, tp=2) == pytest.approx(step(dataclasses.replace(c, world=4), tp=2))
    # timed with its experts over ep and their hidden units over tp both (moe/ep2tp2, ep
    # groups tp apart as the mesh lays them): that time, here 2 s more forward per block
    both = [
        dataclasses.replace(wide, parts={**wide.parts, "moe/ep2tp2": PartCost(const(f), zero, zero, 1.0, 1000)})
        for f in (3.0, 5.0)
    ]
    assert step(both[1], tp=2) - step(both[0], tp=2) == pytest.approx(4 * 2.0)
    assert step(both[0], tp=2) != pytest.approx(step(wide, tp=2))


def test_moe_experts_split_over_tp_halve_their_time_and_add_a_tp_all_reduce_each_way() -> None:
    def predict(expert_tp: bool, measured: PartCost | None = None) -> Prediction:
        moe = MoESpec(num_experts=4, top_k=2, every=1, expert_tp=expert_tp)
        config = ParallelConfig(moe=moe, split_points=())
        c = costs(comm_s=0.25, moe=moe)
        if measured is not None:
            c = dataclasses.replace(c, parts={**c.parts, "moe/tp2": measured})
        return simulate(c, Workload(MODEL, moe, 8), Plan(ParallelDims(tp=2), config))

    split, whole = predict(True), predict(False)
    # 64 tokens: per block the MoE layer's 1 s forward and 2 s backward halve, plus a 0.25 s
    # all-reduce each way: 1 s less per block, 4 blocks
    assert whole.step_s - split.step_s == pytest.approx(4 * 1.0)
    # the experts' parameters (and their gradients and AdamW moments) halve on each rank
    assert whole.peak_bytes[0] > split.peak_bytes[0]
    # timed under tp (moe/tp2, its all-reduces inside): 3 s forward, nothing else, instead of
    # the modelled 0.75 s forward and 1.25 s backward per block
    zero = const(0.0)
    timed = predict(True, PartCost(const(3.0), zero, zero, 1.0, 1000))
    assert timed.step_s - split.step_s == pytest.approx(4 * (3.0 - 2.0))
    assert predict(False, PartCost(const(3.0), zero, zero, 1.0, 1000)).step_s == pytest.approx(whole.step_s)


def test_saved_activations_leave_out_the_weights_a_matmul_saves() -> None:
    """A part's activation bytes are what grows with its tokens: the input a Linear saves,
    not its weight (saved too, for the input's gradient), nor a view of it."""
    lin = torch.nn.Linear(16, 256, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    assert saved_activation_bytes(lambda: lin(x), lin) == 4 * 16 * 4
    # a weight used through a transposed view is still the weight
    assert saved_activation_bytes(lambda: x @ lin.weight.t(), lin) == 4 * 16 * 4
    # with respect to another module, the weight is an activation like any tensor
    assert saved_activation_bytes(lambda: lin(x), torch.nn.Identity()) == 4 * 16 * 4 + 256 * 16 * 4
