"""Variable-length micro-batching (one process): the dynamic programme finds the best
grouping that brute force over every partition finds, every way of cutting keeps each sample
once and the memory cap, grouped micro-batches give one padded batch's loss and gradients,
and bad input is refused by name."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from sparta.errors import InputError
from sparta.parallel import Decoder, DecoderConfig, MoESpec, ParallelConfig, ParallelDims
from sparta.planner import Plan, Workload, length_cost, simulate
from sparta.scheduling import (
    LengthCost,
    LinearFit,
    MicroBatch,
    bucketed_steps,
    collate,
    dynamic_batches,
    pack_batches,
    pad_batches,
    pipeline_seconds,
    summed_loss,
)

from .cost_tables import MODEL, WORK, costs

COST = LengthCost(alpha=0.5, per_token=0.01, per_token_len=1e-4)


def partitions(items: list[int]):
    """Every set partition of items."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in partitions(rest):
        for k in range(len(part)):
            yield part[:k] + [[first, *part[k]]] + part[k + 1 :]
        yield [[first], *part]


def brute_force(lengths: list[int], cost: LengthCost, max_tokens: int, stages: int) -> float:
    best = float("inf")
    for part in partitions(list(range(len(lengths)))):
        groups = [MicroBatch(tuple(g), len(g), max(lengths[i] for i in g)) for g in part]
        if all(mb.tokens <= max_tokens for mb in groups):
            best = min(best, pipeline_seconds(groups, cost, stages))
    return best


def covers_once(batches: list[MicroBatch], n: int) -> bool:
    return sorted(i for mb in batches for i in mb.samples) == list(range(n))


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_dynamic_grouping_is_optimal(stages: int) -> None:
    rng = random.Random(stages)
    for _ in range(6):
        lengths = [rng.choice([3, 5, 8, 13, 40, 64]) for _ in range(7)]
        got = dynamic_batches(lengths, COST, max_tokens=128, stages=stages)
        assert covers_once(got, len(lengths))
        assert all(mb.tokens <= 128 and mb.length == max(lengths[i] for i in mb.samples) for mb in got)
        assert pipeline_seconds(got, COST, stages) == pytest.approx(brute_force(lengths, COST, 128, stages))


def test_every_way_keeps_each_sample_once_and_the_cap() -> None:
    rng = random.Random(0)
    # a long tail: most samples short, a few near the maximum
    lengths = [min(256, int(rng.paretovariate(1.2) * 16)) for _ in range(64)]
    padded = pad_batches(lengths, microbatches=8, pad_to=256)
    packed = pack_batches(lengths, row_length=256, max_tokens=1024)
    dynamic = dynamic_batches(lengths, COST, max_tokens=1024, stages=4)
    for batches in (padded, packed, dynamic):
        assert covers_once(batches, len(lengths))
    assert [mb.samples for mb in padded] == [tuple(range(s, s + 8)) for s in range(0, 64, 8)]
    assert all(mb.tokens <= 1024 for mb in packed + dynamic)
    for mb in packed:  # every packed row holds at most row_length tokens
        assert sum(lengths[i] for i in mb.samples) <= mb.tokens
    # the programme never does worse than the padded layout it could have chosen
    for stages in (1, 4):
        assert pipeline_seconds(dynamic_batches(lengths, COST, 2048, stages), COST, stages) <= pipeline_seconds(
            padded, COST, stages
        )


@pytest.mark.parametrize("stages", [1, 2])
def test_bucketed_steps_are_optimal_with_few_shapes(stages: int) -> None:
    """Against brute force over every partition into steps (not only contiguous cuts of the
    sorted samples): a step of bucket b holds microbatches..microbatches * cap(b) samples in
    micro-batches of the smallest power-of-two rows that hold them (at most cap(b)), and costs
    their pipeline time."""
    buckets, max_tokens, m = (8, 16, 64), 96, 2
    cap = {b: max_tokens // b for b in buckets}  # 12, 6, 1: caps that are not powers of two too

    def rows(size: int, b: int) -> int:
        return min(next(r for r in (1, 2, 4, 8, 16) if r * m >= size), cap[b])

    rng = random.Random(stages)
    for _ in range(5):
        lengths = [rng.choice([3, 5, 8, 13, 40, 64]) for _ in range(7)]
        got = bucketed_steps(lengths, COST, buckets, max_tokens, m, stages)
        assert covers_once([mb for step in got for mb in step], len(lengths))
        for step in got:
            assert len(step) == m and len({(mb.rows, mb.length) for mb in step}) == 1
            longest = max(lengths[i] for mb in step for i in mb.samples)
            assert step[0].length == min(b for b in buckets if b >= longest)
            size = sum(len(mb.samples) for mb in step)
            assert all(1 <= len(mb.samples) <= mb.rows == rows(size, mb.length) for mb in step)
        best = float("inf")
        for part in partitions(list(range(len(lengths)))):
            bucket = [min(b for b in buckets if b >= max(lengths[i] for i in g)) for g in part]
            if all(m <= len(g) <= m * cap[b] for g, b in zip(part, bucket, strict=True)):
                steps = [[MicroBatch((), rows(len(g), b), b)] * m for g, b in zip(part, bucket, strict=True)]
                best = min(best, sum(pipeline_seconds(step, COST, stages) for step in steps))
        total = sum(pipeline_seconds(step, COST, stages) for step in got)
        assert total == pytest.approx(best), lengths


def test_bucketed_steps_of_equal_cost_prefer_fewer_fuller_steps() -> None:
    """A cost without a constant (of_flops) prices two half steps as one full one: the full
    one is taken, so optimizer steps keep their size."""
    flops = LengthCost(0.0, 4.8102e-07, 6.144e-09)  # of_flops's shape: no constant
    lengths = [2, 1, 3, 13, 1, 16, 11, 8, 11, 3, 7, 8, 8, 5, 15, 3, 3, 11, 16, 4, 10, 10, 4, 11, 7, 10, 15, 3, 13, 11]
    lengths += [8, 10]
    got = bucketed_steps(lengths, flops, (4, 8, 16), max_tokens=64, microbatches=2)
    # float rounding alone once split these into 9 steps of the same predicted time
    assert len(got) == 6, [(len(step[0].samples), step[0].length) for step in got]


def test_length_cost_fit_flops_and_measured_parts() -> None:
    truth = LengthCost(0.002, 3e-6, 2e-8)
    shapes = [(r, n) for r in (1, 2, 4) for n in (16, 64, 256)]
    fitted = LengthCost.fit(shapes, [truth(r, n) for r, n in shapes])
    for name in ("alpha", "per_token", "per_token_len"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    # a cost that does not grow with the square of the length drops that term instead of going negative
    flat = LengthCost.fit(shapes, [0.001 + 1e-5 * r * n - 1e-9 * r * n * n for r, n in shapes])
    # one length alone cannot split the linear term from the quadratic one: no quadratic term
    one_length = [(r, 128) for r in (1, 2, 4, 8)]
    linear_only = LengthCost.fit(one_length, [0.01 + 1e-5 * r * n for r, n in one_length])
    assert linear_only.per_token_len == 0 and linear_only(1, 1024) == pytest.approx(0.01 + 1e-5 * 1024)
    assert flat.per_token_len == 0 and flat.per_token > 0
    # from the planner's parts: each block's attention + mlp 0.5 s fwd + 1 s bwd per 16 tokens
    linear = length_cost(costs(), Workload(MODEL, None, 8))
    assert linear(2, 8) == pytest.approx(MODEL.n_layers * 1.5)
    # MoE every second layer: layers 0 and 2 price the MoE part, 1 and 3 the MLP
    moe = MoESpec(num_experts=4, top_k=2, every=2)
    c = costs(moe=moe)
    c.parts["moe"] = dataclasses.replace(c.parts["moe"], fwd=LinearFit(0.0, 0.1, 0.0, ()))  # 1.6 s at 16 tokens
    per = {n: c.parts[n].fwd(16) + c.parts[n].bwd(16) for n in ("attention", "mlp", "moe")}
    assert per["moe"] > per["mlp"]
    want = 4 * per["attention"] + 2 * per["moe"] + 2 * per["mlp"]
    assert length_cost(c, Workload(MODEL, moe, 8))(2, 8) == pytest.approx(want)


def test_the_pipeline_formula_is_the_simulators_on_equal_micro_batches() -> None:
    """pipeline_seconds' (sum + (stages - 1) max) / stages is what the simulator's replay of
    torch's 1F1B gives for micro-batches of one shape over balanced stages."""
    c = costs()
    cost = length_cost(c, WORK)
    for pp, m in ((1, 4), (2, 4), (4, 8)):
        split = tuple(f"layers.{i}" for i in range(MODEL.n_layers // pp, MODEL.n_layers, MODEL.n_layers // pp))
        plan = Plan(ParallelDims(pp=pp), ParallelConfig(schedule="1F1B", microbatches=m, split_points=split))
        rows = WORK.global_batch // m
        batches = [MicroBatch(tuple(range(rows)), rows, MODEL.seq_len)] * m
        assert pipeline_seconds(batches, cost, pp) == pytest.approx(simulate(c, WORK, plan).step_s), (pp, m)


def test_grouped_micro_batches_equal_one_padded_batch() -> None:
    """Right padding with ignored targets under causal attention: the loss summed over any
    grouping, over the real tokens, is one padded batch's, and so are the gradients."""
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=50, seq_len=32, d_model=16, n_layers=2, n_heads=2, d_ff=32)
    model = Decoder(cfg)
    lengths = [3, 31, 7, 12, 5, 31, 2, 18]
    samples = [torch.randint(0, cfg.vocab_size, (n + 1,)) for n in lengths]
    real = sum(lengths)

    def run(batches: list[MicroBatch]) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        total = 0.0
        for mb in batches:
            ids, targets = collate(samples, mb)
            loss = summed_loss(model(ids), targets) / real
            loss.backward()
            total += loss.item()
        return total, [p.grad.clone() for p in model.parameters()]

    one_loss, one_grads = run(pad_batches(lengths, 1, pad_to=cfg.seq_len))
    for batches in (
        pad_batches(lengths, 4, pad_to=cfg.seq_len),
        dynamic_batches(lengths, COST, max_tokens=64, stages=2),
        # rows past a micro-batch's samples are padding
        [mb for step in bucketed_steps(lengths, COST, (8, 32), max_tokens=64, microbatches=2) for mb in step],
    ):
        loss, grads = run(batches)
        assert loss == pytest.approx(one_loss, abs=1e-6)
        for g, want in zip(grads, one_grads, strict=True):
            torch.testing.assert_close(g, want, atol=1e-6, rtol=1e-5)


def test_bad_input_is_refused_by_name() -> None:
    cases = [
        (lambda: dynamic_batches([], COST, 64), "empty"),
        (lambda: dynamic_batches([4, 0], COST, 64), "(1, 0)"),
        (lambda: dynamic_batches([4, 100], COST, 64), "max_tokens=64"),
        (lambda: dynamic_batches([4], COST, 64, stages=0), "stages=0"),
        (lambda: pad_batches([4, 5], 3), "microbatches=3"),
        (lambda: pad_batches([4, 50], 1, pad_to=32), "pad_to=32"),
        (lambda: pack_batches([4, 50], 32, 64), "packed row of 32"),
        (lambda: pack_batches([4], 32, 16), "max_tokens=16"),
        (lambda: LengthCost(-1.0, 0.0), "alpha=-1.0"),
        (lambda: LengthCost.fit([(1, 2), (1, 2)], [0.1, 0.2]), "three or more"),
        (lambda: collate([torch.arange(5)], MicroBatch((0,), 1, 3)), "sample 0 has 4 tokens"),
        (lambda: collate([torch.arange(5)], pack_batches([4, 4], 8, 8)[0]), "padded micro-batches"),
        (lambda: bucketed_steps([4, 5], COST, (), 64, 1), "buckets=[]"),
        (lambda: bucketed_steps([4, 50], COST, (8, 32), 64, 1), "longest bucket (32)"),
        (lambda: bucketed_steps([4, 5], COST, (8, 32), 16, 1), "max_tokens=16"),
        (lambda: bucketed_steps([4, 5, 6], COST, (8,), 8, 2), "do not cut into steps of 2"),
        (lambda: bucketed_steps([4], COST, (8,), 8, 2), "microbatches=2"),
    ]
    for call, words in cases:
        with pytest.raises(InputError) as err:
            call()
        assert words in str(err.value), (words, str(err.value))
