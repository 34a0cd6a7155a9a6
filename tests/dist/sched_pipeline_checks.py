"""The pipelined exchange against the unpipelined computation, on 4 ranks (2 nodes x 2).

Oracle: one differentiable all-to-all out, the same row-wise compute on everything received,
one all-to-all back. Run by tests/scheduling/test_pipeline.py under several launchers.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable

import torch
from runner import finish, raises, run_checks, start

import sparta
from sparta.comm import Exchange, HierarchicalAllToAll, World
from sparta.errors import ConfigError, InputError
from sparta.parallel import DataParallel, ParallelDims, build_layout
from sparta.scheduling.chunks import PipelineDegrees
from sparta.scheduling.cost_model import CostModel, LayerShape
from sparta.scheduling.microbatch import Routed, overlapped_block
from sparta.scheduling.partition import GradientPartition
from sparta.scheduling.pipeline import Compute, pipelined_exchange
from sparta.scheduling.profiler import ProfileConfig, Profiler
from sparta.scheduling.trace import Tracer, gather, write_chrome_trace
from sparta.scheduling.tuner import UNPIPELINED, Choice, OnlineTuner

SLOTS, D_IN, D_OUT = 3, 5, 4
# (forward, backward, taper): equal degrees reuse the forward's graphs, unequal recompute;
# tapered cuts have chunks of unequal sizes (1, 2, 4, 4, 2, 1 at degree 6)
DEGREES = [(1, 1, 0), (2, 2, 0), (3, 2, 0), (1, 4, 0), (5, 5, 0), (6, 6, 2), (3, 7, 3)]
_HIER: list[HierarchicalAllToAll] = []


def exchanges(world: World) -> list[Exchange]:
    if not _HIER:
        _HIER.append(HierarchicalAllToAll.from_world(world))
    return [world.comm, _HIER[0]]


def slot_mlp(w: torch.Tensor, b: torch.Tensor, size: int) -> sparta.scheduling.pipeline.Compute:
    """Row-wise: each row through its slot's weights. w [SLOTS, D_IN, D_OUT], b [SLOTS, D_OUT]."""

    def compute(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        slot = torch.repeat_interleave(torch.arange(SLOTS).repeat(size), counts.flatten())
        return torch.tanh(torch.einsum("nd,nde->ne", x, w[slot])) * 1.5 + b[slot]

    return compute


def problem(world: World, salt: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Uneven counts with zeros; rank 3 sends nothing when salt is odd."""
    g = torch.Generator().manual_seed(1000 * salt + world.rank)
    counts = torch.randint(0, 7, (world.size * SLOTS,), generator=g)
    counts[::4] = 0
    if salt % 2 and world.rank == 3:
        counts.zero_()
    rows = torch.randn(int(counts.sum()), D_IN, generator=g, dtype=dtype)
    wg = torch.Generator().manual_seed(77 + world.rank)  # each rank owns different experts
    params = [
        torch.randn(SLOTS, D_IN, D_OUT, generator=wg, dtype=dtype),
        torch.randn(SLOTS, D_OUT, generator=wg, dtype=dtype),
    ]
    return rows, counts, params


def reference(world: World, rows: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return reference_rows(world, rows, counts, slot_mlp(w, b, world.size))


def compare(world: World, dtype: torch.dtype, tol: float) -> None:
    for salt in range(2):
        rows, counts, params = problem(world, salt, dtype)
        x0, w0, b0 = (t.clone().requires_grad_() for t in (rows, *params))
        y0 = reference(world, x0, counts, w0, b0)
        weight = torch.linspace(-1, 1, D_OUT, dtype=dtype)
        (y0 * weight).square().sum().backward()
        for ex in exchanges(world):
            for fwd, bwd, taper in DEGREES:
                x, w, b = (t.clone().requires_grad_() for t in (rows, *params))
                degrees = PipelineDegrees(fwd, bwd, taper)
                y = pipelined_exchange(x, counts, slot_mlp(w, b, world.size), ex, degrees, [w, b])
                (y * weight).square().sum().backward()
                what = (salt, type(ex).__name__, fwd, bwd, taper)
                torch.testing.assert_close(y, y0, rtol=tol, atol=tol, msg=lambda m, what=what: f"{what}: {m}")
                for got, want in ((x.grad, x0.grad), (w.grad, w0.grad), (b.grad, b0.grad)):
                    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m, what=what: f"{what}: {m}")


def check_float64_exact(world: World) -> None:
    compare(world, torch.float64, 1e-10)


def check_float32_within_1e6(world: World) -> None:
    compare(world, torch.float32, 1e-6)


def check_no_grad_and_frozen_params(world: World) -> None:
    rows, counts, (w, b) = problem(world, 0, torch.float64)
    want = reference(world, rows, counts, w, b)
    with torch.no_grad():
        y = pipelined_exchange(rows, counts, slot_mlp(w, b, world.size), world.comm, PipelineDegrees(3, 3), [w, b])
    torch.testing.assert_close(y, want, rtol=0, atol=1e-12)
    # rows need a gradient, the weights don't; backward with unequal degrees recomputes
    x = rows.clone().requires_grad_()
    y = pipelined_exchange(x, counts, slot_mlp(w, b, world.size), world.comm, PipelineDegrees(2, 3), [w, b])
    y.sum().backward()
    x0 = rows.clone().requires_grad_()
    reference(world, x0, counts, w, b).sum().backward()
    torch.testing.assert_close(x.grad, x0.grad, rtol=0, atol=1e-12)


def check_bad_input(world: World) -> None:
    with raises(ConfigError, r"PipelineDegrees.forward = 0"):
        PipelineDegrees(0, 1)
    with raises(InputError, r"counts sum to 3 but rows has 2 rows"):
        pipelined_exchange(torch.ones(2, 1), torch.tensor([3, 0, 0, 0]), torch.tanh, world.comm, PipelineDegrees())  # type: ignore[arg-type]
    with raises(InputError, r"give \[size \* slots\]"):
        pipelined_exchange(torch.ones(3, 1), torch.tensor([3, 0, 0]), torch.tanh, world.comm, PipelineDegrees())  # type: ignore[arg-type]


def check_profile_agreed_on_every_rank(world: World) -> None:
    """Profiles of real collectives and GEMMs: every rank gets the same fits and plan."""
    intra, inter = world.node_comms()
    config = ProfileConfig(bytes=(4096, 65536), rows=(16, 64), repeats=1, warmup=1)
    profiler = Profiler(world.comm, {"world": world.comm, "intra": intra, "inter": inter}, config)
    profile = profiler.collectives() | profiler.expert_mlp(d_model=16, d_ff=32)
    assert {"all_to_all/inter", "all_reduce/world", "all_gather/intra", "expert_bwd/16x32"} <= set(profile.fits)
    plan = CostModel(profile).plan(LayerShape(tokens=64, top_k=2, d_model=16, d_ff=32, ep_size=4))
    mine = torch.tensor([f.alpha for f in profile.fits.values()] + [plan.degrees.forward, plan.degrees.backward])
    every = world.comm.all_gather(mine)
    assert all(torch.equal(t, mine) for t in every), "ranks disagree on the profile or the plan"


def check_chrome_trace(world: World) -> None:
    rows, counts, (w, b) = problem(world, 0, torch.float32)
    tracer = Tracer()
    x = rows.clone().requires_grad_()
    y = pipelined_exchange(x, counts, slot_mlp(w, b, world.size), world.comm, PipelineDegrees(3, 2), tracer=tracer)
    y.sum().backward()
    names = sorted(s.name for s in tracer.spans)
    want = sorted(
        f"{p} {k} {i}" for p, r in (("fwd", 3), ("bwd", 2)) for k in ("out", "compute", "back") for i in range(r)
    )
    assert names == want, names
    computes = sorted((s.start_s, s.end_s) for s in tracer.spans if s.track == "compute")
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(computes)), "compute spans overlap"
    spans = gather(world.comm, tracer)
    if world.rank == 0:
        assert spans is not None and sorted(spans) == list(range(world.size))
        path = os.path.join(os.environ["SPARTA_TEST_RESULTS"], "trace.json")
        write_chrome_trace(path, spans)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        assert sum(e["ph"] == "X" for e in events) == len(want) * world.size
        assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} == {"send", "compute", "return"}
    else:
        assert spans is None


def check_tuner_agrees_on_the_slowest_rank(world: World) -> None:
    piped = Choice(PipelineDegrees(4, 2), hierarchical=True)
    tuner = OnlineTuner(world.comm, [piped, UNPIPELINED, piped], trials=3)
    assert tuner.candidates == (piped, UNPIPELINED)
    seen = []
    while tuner.chosen is None:
        seen.append(tuner.current)
        # pipelined: fast everywhere but on rank 2; unpipelined: middling everywhere
        fast = tuner.current == piped
        tuner.observe((5.0 if world.rank == 2 else 0.1) if fast else 1.0)
    assert seen == [piped, UNPIPELINED] * 3
    assert tuner.chosen == UNPIPELINED and tuner.current == UNPIPELINED


class DenseParams(torch.nn.Module):
    """Tensors as the parameters of a module (registered in forward order), for DataParallel."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(torch.nn.Parameter(t.clone()) for t in tensors)


def check_partitioned_gradients_equal_all_reduce(world: World) -> None:
    """Dense layers around the pipelined exchange; their gradients averaged by DataParallel in
    pieces that cross parameter boundaries, two of them sent during backward, equal a plain
    all-reduce; pieces that do not cover the parameters are refused at the first step."""
    rows, counts, (w, b) = problem(world, 0, torch.float32)
    g = torch.Generator().manual_seed(5)  # replicated, as data parallelism keeps them (wrap broadcasts rank 0's)
    dense = [torch.randn(D_IN, D_IN, generator=g), torch.randn(D_OUT, 7, generator=g), torch.randn(7, generator=g)]
    layout = build_layout(ParallelDims(dp=world.size), world)

    def run(ex: Exchange, dp: DataParallel | None, params: list[torch.Tensor]) -> None:
        pre, post_w, post_b = params
        y = pipelined_exchange(rows @ pre, counts, slot_mlp(w, b, world.size), ex, PipelineDegrees(2, 3), [w, b])
        loss = (torch.tanh(y @ post_w) + post_b).square().sum()
        if dp is not None:
            dp.start()
        loss.backward()

    want = [t.clone().requires_grad_() for t in dense]
    run(world.comm, None, want)
    oracle = [world.comm.all_reduce(p.grad, op="avg") for p in want]
    total = sum(t.numel() for t in dense) * 4
    part = GradientPartition(pieces=(12, 4 * 9, total - 48), gaps=(0, 1, -1), exposed_s=0.0)
    for ex in exchanges(world):
        model = DenseParams(dense)  # ready order: the layer after the exchange first (post_b, post_w, pre)
        dp = DataParallel(layout, "sparta", 1, False, partition=part, openings=(1, 3))
        dp.wrap(model)
        run(dp.watch(ex), dp, list(model.params))
        assert dp.release is not None and dp.release.released == 2, (
            f"{dp.release.released} pieces went during backward; want the 2 planned for its gaps"
        )
        dp.finish()
        dp.close()
        for p, ref in zip(model.params, oracle, strict=True):
            torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-6)
        assert dp.queue is not None and [k.name for k, _ in dp.queue.issue_log] == ["dense 0", "dense 1", "dense 2"]
    wrong = DataParallel(layout, "sparta", 1, False, partition=GradientPartition((8,), (-1,), 0.0))
    wrong.wrap(DenseParams(dense))
    with raises(ConfigError, r"must sum to the dense parameters' 240 bytes"):
        wrong.start()
    wrong.close()


def moe_block(world: World, params: list[torch.Tensor]) -> tuple[Callable[..., Routed], Callable[..., torch.Tensor]]:
    """A small MoE block as `overlapped_block` takes it: a dense layer and a top-2 router
    before the exchange, the routing-weighted combine and a dense layer after it; the
    routing weights are a differentiable side tensor."""
    pre, router, post, post_b = params[:4]
    slots = world.size * SLOTS

    def before(x: torch.Tensor) -> Routed:
        h = torch.tanh(x @ pre)
        top = (h @ router).topk(2, dim=1)
        order = torch.sort(top.indices.flatten(), stable=True).indices
        counts = torch.bincount(top.indices.flatten(), minlength=slots)
        return Routed(h.index_select(0, order // 2), counts, (torch.softmax(top.values, 1), order))

    def after(back: torch.Tensor, side: tuple[torch.Tensor, ...]) -> torch.Tensor:
        weight, order = side
        rows = back * weight.flatten()[order, None]
        combined = rows.new_zeros(order.numel() // 2, rows.shape[1]).index_add(0, order // 2, rows)
        return combined @ post + post_b

    return before, after


def check_overlapped_block_equals_whole_block(world: World) -> None:
    """Micro-batched and pipelined (dense layers beside the transfers) against the whole
    block with one plain exchange each way: outputs and every gradient, float64 within 1e-10
    and float32 within 1e-6 absolute plus 1e-5 relative (a weight's gradient is summed over
    micro-batches, in another order than one GEMM over all rows sums it); a rank with as
    many tokens as micro-batches, and with fewer (an empty micro-batch), included."""
    for dtype, tol, rtol in ((torch.float64, 1e-10, 1e-10), (torch.float32, 1e-6, 1e-5)):
        g = torch.Generator().manual_seed(3)  # dense weights equal on every rank
        dense = [
            torch.randn(*shape, generator=g, dtype=dtype)
            for shape in ((D_IN, D_IN), (D_IN, world.size * SLOTS), (D_OUT, 6), (6,))
        ]
        _, _, experts = problem(world, 0, dtype)
        tokens = 3 if world.rank == 3 else 11
        x = torch.randn(tokens, D_IN, generator=torch.Generator().manual_seed(world.rank), dtype=dtype)
        want = [t.clone().requires_grad_() for t in (x, *dense, *experts)]
        compute = slot_mlp(want[5], want[6], world.size)
        before, after = moe_block(world, want[1:])
        routed = before(want[0])
        counts = routed.counts
        y0 = after(reference_rows(world, routed.rows, counts, compute), routed.side)
        loss_weight = torch.linspace(-1, 1, 6, dtype=dtype)
        (y0 * loss_weight).square().sum().backward()
        for ex in exchanges(world):
            # and in float64 rank 3's 3 tokens in 4 (one micro-batch empty; float32's sums of
            # 4 pieces part from one GEMM's by more than the bound above)
            for microbatches in (1, 2, 3, *((4,) if dtype == torch.float64 else ())):
                got = [t.clone().requires_grad_() for t in (x, *dense, *experts)]
                before, after = moe_block(world, got[1:])
                compute = slot_mlp(got[5], got[6], world.size)
                y = overlapped_block(got[0], microbatches, before, compute, after, ex, got[1:])
                (y * loss_weight).square().sum().backward()
                what = (str(dtype), type(ex).__name__, microbatches)
                torch.testing.assert_close(y, y0, rtol=rtol, atol=tol, msg=lambda m, what=what: f"{what}: {m}")
                for k, (a, b) in enumerate(zip(got, want, strict=True)):
                    torch.testing.assert_close(
                        a.grad, b.grad, rtol=rtol, atol=tol, msg=lambda m, what=what, k=k: f"{what} grad {k}: {m}"
                    )


def reference_rows(world: World, rows: torch.Tensor, counts: torch.Tensor, compute: Compute) -> torch.Tensor:
    """One differentiable all-to-all out, `compute`, one back."""
    comm = world.comm
    recv_counts = comm.all_to_all(counts, [SLOTS] * comm.size)
    assert isinstance(recv_counts, torch.Tensor)
    send = counts.view(comm.size, SLOTS).sum(1).tolist()
    recv = recv_counts.view(comm.size, SLOTS).sum(1).tolist()
    got = sparta.comm.all_to_all(rows, send, recv, comm)
    return sparta.comm.all_to_all(compute(got, recv_counts.view(comm.size, SLOTS)), recv, send, comm)


def check_overlapped_block_traced_untracked_and_checked(world: World) -> None:
    """Spans for every stage of both passes; no autograd graph kept under no_grad; a carry
    summed over the ranks; bad micro-batch counts and bad routing raise on every rank before
    any exchange."""
    g = torch.Generator().manual_seed(3)
    dense = [torch.randn(*shape, generator=g) for shape in ((D_IN, D_IN), (D_IN, world.size * SLOTS), (D_OUT, 6), (6,))]
    _, _, experts = problem(world, 0, torch.float32)
    params = [t.clone().requires_grad_() for t in (*dense, *experts)]
    before, after = moe_block(world, params)
    compute = slot_mlp(params[4], params[5], world.size)
    x = torch.randn(8, D_IN, generator=torch.Generator().manual_seed(world.rank))
    tracer = Tracer()
    overlapped_block(x, 2, before, compute, after, world.comm, params, tracer).sum().backward()
    stages = ("before", "out", "compute", "back", "after")
    want = sorted(f"{p} {k} {i}" for p in ("fwd", "bwd") for k in stages for i in range(2))
    assert sorted(s.name for s in tracer.spans) == want, sorted(s.name for s in tracer.spans)
    with torch.no_grad():
        y = overlapped_block(x, 2, before, compute, after, world.comm, params)
    assert not y.requires_grad and y.shape == (8, 6)

    # a carry rides with each micro-batch's counts and comes back summed over the ranks
    def carrying(rows: torch.Tensor) -> Routed:
        routed = before(rows)
        return Routed(routed.rows, routed.counts, routed.side, torch.tensor([world.rank, rows.shape[0]]))

    carried: list[torch.Tensor] = []
    y = overlapped_block(x[:5], 2, carrying, compute, after, world.comm, params, carried=carried)
    ranks = sum(range(world.size))
    assert [c.tolist() for c in carried] == [[ranks, 3 * world.size], [ranks, 2 * world.size]], carried
    with raises(InputError, r"microbatches = 0; use an int >= 1"):
        overlapped_block(x, 0, before, compute, after, world.comm, params)
    with raises(InputError, r"x is a 0-dim tensor"):
        overlapped_block(x[0, 0], 2, before, compute, after, world.comm, params)

    def short(rows: torch.Tensor) -> Routed:
        routed = before(rows)
        return Routed(routed.rows[1:], routed.counts, routed.side)

    with raises(InputError, r"micro-batch 0: counts sum to 4 but rows has 3 rows"):
        overlapped_block(x[:4], 2, short, compute, after, world.comm, params)


CHECKS = [
    check_overlapped_block_equals_whole_block,
    check_overlapped_block_traced_untracked_and_checked,
    check_partitioned_gradients_equal_all_reduce,
    check_tuner_agrees_on_the_slowest_rank,
    check_chrome_trace,
    check_profile_agreed_on_every_rank,
    check_float64_exact,
    check_float32_within_1e6,
    check_no_grad_and_frozen_params,
    check_bad_input,
]

if __name__ == "__main__":
    world, _ = start(ranks_per_node=2)
    finish(world, run_checks(world, CHECKS))
