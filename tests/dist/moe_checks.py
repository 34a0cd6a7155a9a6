"""Expert parallelism over real engines, checked against one process holding every expert.

Run by tests/moe/test_parallel_dist.py on 2 and 4 ranks under torchrun, mpirun and
horovodrun. The oracle is a one-process MoELayer built from the same seed: for each rank of
an expert-parallel group it runs that rank's tokens alone (routing and capacity are per rank),
and the group's expert gradients are the sum of those runs'.
"""

from __future__ import annotations

import torch
from moe_block_checks import (
    check_block_tuning_agrees_on_candidates_when_ranks_hold_other_shapes,
    check_overlapped_block_equals_the_plain_block,
)
from moe_cases import CASES, D_FF, D_MODEL, EXPERTS, SEQ, TOL
from runner import finish, raises, run_checks, start
from torch import nn

from sparta.comm import Communicator, HierarchicalAllToAll, World
from sparta.errors import ConfigError, InputError
from sparta.moe import MoELayer, full_state_dict, tune_schedule
from sparta.parallel import DataParallel, Layout, ParallelDims, build_layout

_LAYOUTS: dict[int, Layout] = {}


def layout(world: World, ep: int) -> Layout:
    """The world as one data-parallel group with experts over ``ep`` consecutive ranks (its
    ``ep`` and ``expert_dp`` communicators); built once per ``ep`` (a collective)."""
    if ep not in _LAYOUTS:
        _LAYOUTS[ep] = build_layout(ParallelDims(dp=world.size, ep=ep), world)
    return _LAYOUTS[ep]


def inputs(world_size: int, batches: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every world rank's tokens and upstream gradient (the same lists on every rank)."""
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(b, SEQ, D_MODEL, generator=gen) + 0.3 * r for r, b in enumerate(batches)]
    ups = [torch.randn(b, SEQ, D_MODEL, generator=gen) for b in batches]
    return xs, ups


def compare_with_one_process(
    world: World, ep: Communicator, case: dict, batches: list[int], accumulate: bool = False, **sharded: object
) -> None:
    """The layer sharded over ``ep`` (with the extra ``sharded`` options) against one process,
    for this rank's tokens. ``accumulate``: the sharded layer's parameters already hold a
    ``.grad`` (a later micro-batch), which backward adds to."""
    torch.manual_seed(0)
    whole = MoELayer(D_MODEL, D_FF, EXPERTS, **case).train()
    torch.manual_seed(0)
    shard = MoELayer(D_MODEL, D_FF, EXPERTS, ep_size=ep.size, comm=ep, **case, **sharded).train()
    xs, ups = inputs(world.size, batches)
    x = xs[world.rank].clone().requires_grad_()
    seeds = {p: torch.randn_like(p) if accumulate else None for p in shard.parameters()}
    for p, seed in seeds.items():
        p.grad = None if seed is None else seed.clone()
    y = shard(x)
    (y * ups[world.rank]).sum().backward()
    for p, seed in seeds.items():
        if seed is not None and p.grad is not None:
            p.grad -= seed

    bias0 = whole.router.expert_bias.clone() if case["router"] == "sigmoid" else None
    expert_grads = {name: torch.zeros_like(p) for name, p in whole.experts.named_parameters()}
    routed = torch.zeros(EXPERTS, dtype=torch.int64)
    for member in ep.ranks:  # the world ranks of my expert-parallel group
        if bias0 is not None:  # the sharded layer updated its bias once, from the group's load
            whole.router.expert_bias.copy_(bias0)
        whole.zero_grad()
        xr = xs[member].clone().requires_grad_()
        yr = whole(xr)
        (yr * ups[member]).sum().backward()
        routed += torch.tensor(whole.last_stats.routed_per_expert)
        for name, p in whole.experts.named_parameters():
            expert_grads[name] += p.grad
        if member == world.rank:
            torch.testing.assert_close(y, yr, **TOL, msg=lambda m: f"{case}: output: {m}")
            torch.testing.assert_close(x.grad, xr.grad, **TOL, msg=lambda m: f"{case}: input grad: {m}")
            for name, p in whole.router.named_parameters():
                got = dict(shard.router.named_parameters())[name].grad
                torch.testing.assert_close(got, p.grad, **TOL, msg=lambda m, n=name: f"{case}: router {n}: {m}")
    local = EXPERTS // ep.size
    mine = slice(ep.rank * local, (ep.rank + 1) * local)
    for name, p in shard.experts.named_parameters():
        torch.testing.assert_close(p.grad, expert_grads[name][mine], **TOL, msg=lambda m, n=name: f"{case}: {n}: {m}")
    assert shard.last_stats.routed_per_expert == routed.tolist(), (case, shard.last_stats, routed)
    if bias0 is not None:
        want = bias0 + shard.config.bias_update_rate * torch.sign(routed.float().mean() - routed.float())
        torch.testing.assert_close(shard.router.expert_bias, want)


def check_every_router_sharded_over_all_ranks(world: World) -> None:
    batches = [2] * world.size
    for i, case in enumerate(CASES):
        compare_with_one_process(world, world.comm, case, batches, accumulate=i % 2 == 1)


def check_every_router_with_expert_data_parallel_groups(world: World) -> None:
    """ep_size = 2 inside a larger world: two expert-parallel groups side by side (4 ranks
    or more: `checks_for`)."""
    groups = layout(world, 2)
    assert groups.ep is not None and groups.ep.size == 2
    assert groups.expert_dp is not None and groups.expert_dp.size == world.size // 2
    for case in CASES:
        compare_with_one_process(world, groups.ep, case, [2] * world.size)
    # Counted over the whole world, the sigmoid bias stays the same on every replica.
    torch.manual_seed(0)
    layer = MoELayer(D_MODEL, D_FF, EXPERTS, router="sigmoid", ep_size=2, comm=groups.ep, stats_comm=world.comm)
    for step in range(3):
        layer(torch.randn(2, SEQ, D_MODEL, generator=torch.Generator().manual_seed(10 * step + world.rank)))
    assert sum(layer.last_stats.routed_per_expert) == 2 * SEQ * 2 * world.size, layer.last_stats
    biases = world.comm.all_gather(layer.router.expert_bias)
    assert all(torch.equal(b, biases[0]) for b in biases) and biases[0].abs().sum() > 0, biases


def check_pipelined_and_hierarchical_exchanges(world: World) -> None:
    """Chunked exchanges (forward and backward degrees apart) and the two-level all-to-all
    give what one process gives."""
    cases = [CASES[0], CASES[1], CASES[-1]]
    for degrees in (2, (3, 1), (1, 4)):
        for case in cases:
            compare_with_one_process(world, world.comm, case, [2] * world.size, pipeline_degree=degrees)
    compare_with_one_process(world, world.comm, CASES[0], [2] * (world.size - 1) + [0], pipeline_degree=3)
    for degrees in (1, 3, (3, 2)):  # backward(retain_graph=True) twice adds the same gradients twice
        torch.manual_seed(0)
        layer = MoELayer(D_MODEL, D_FF, EXPERTS, ep_size=world.size, comm=world.comm, pipeline_degree=degrees)
        y = layer(torch.randn(2, SEQ, D_MODEL))
        y.square().sum().backward(retain_graph=True)
        once = [p.grad.clone() for p in layer.parameters()]
        y.square().sum().backward()
        for p, g in zip(layer.parameters(), once, strict=True):
            torch.testing.assert_close(p.grad, 2 * g, **TOL, msg=lambda m, d=degrees: f"degrees {d}: {m}")
    torch.manual_seed(0)
    tuned = MoELayer(D_MODEL, D_FF, EXPERTS, ep_size=world.size, comm=world.comm, **CASES[1])
    before = {n: p.detach().clone() for n, p in tuned.state_dict().items()}
    plan = tune_schedule(tuned, torch.randn(2 + world.rank, SEQ, D_MODEL))
    assert tuned.schedule_plan is None and all(torch.equal(p, before[n]) for n, p in tuned.state_dict().items())
    assert all(p.grad is None for p in tuned.parameters()), "tuning left gradients behind"
    # degrees 1..8, each with its distinct tapered cuts (1, 1, 2, 2, 3, 3, 4, 4), flat only
    assert len(plan.candidates) == 20 and not plan.hierarchical, plan
    d = plan.degrees
    mine = torch.tensor([d.forward, d.backward, d.taper, int(plan.hierarchical)])
    assert all(torch.equal(p, mine) for p in world.comm.all_gather(mine)), "ranks chose different plans"
    tuned_degrees = (d.forward, d.backward, d.taper)
    compare_with_one_process(world, world.comm, CASES[1], [2] * world.size, pipeline_degree=tuned_degrees)
    if world.size == 4:  # posed as 2 nodes x 2 ranks
        intra = world.comm.split_groups([[0, 1], [2, 3]])
        inter = world.comm.split_groups([[0, 2], [1, 3]])
        hier = HierarchicalAllToAll(world.comm, intra, inter)
        for degrees in (1, (2, 3)):
            for case in cases:
                compare_with_one_process(
                    world, world.comm, case, [2] * world.size, exchange=hier, pipeline_degree=degrees
                )
        plan = tune_schedule(tuned, torch.randn(2, SEQ, D_MODEL), hierarchical=hier)
        tuned.apply_schedule(plan, hierarchical=hier)
        assert tuned.degrees == plan.degrees and (tuned.exchange is hier) == plan.hierarchical


def check_empty_ranks_and_idle_experts(world: World) -> None:
    # The last rank has no tokens; a gate that sends every token to expert 0 leaves the
    # other experts idle: no hang, zero gradients for them.
    for i, case in enumerate(CASES[:1] + CASES[-2:]):
        compare_with_one_process(world, world.comm, case, [2] * (world.size - 1) + [0], accumulate=i == 1)
    torch.manual_seed(0)
    layer = MoELayer(D_MODEL, D_FF, EXPERTS, router="switch", top_k=1, ep_size=world.size, comm=world.comm)
    with torch.no_grad():
        layer.router.gate.weight.zero_()
        layer.router.gate.weight[0] = 1.0
    x = torch.rand(3, SEQ, D_MODEL) + 0.1  # positive: expert 0's logit is the largest
    layer(x).sum().backward()
    assert layer.last_stats.tokens_per_expert == [3 * SEQ * world.size] + [0] * (EXPERTS - 1)
    for p in layer.experts.parameters():
        idle = p.grad if world.rank > 0 else p.grad[1:]
        assert torch.count_nonzero(idle) == 0, "an expert without tokens got a gradient"


def check_checkpoint_loads_under_other_expert_parallel_sizes(world: World) -> None:
    case = {"router": "topk", "activation": "swiglu", "expert_bias": True}
    torch.manual_seed(3)
    written = MoELayer(D_MODEL, D_FF, EXPERTS, ep_size=world.size, comm=world.comm, **case).eval()
    local = written.state_dict()
    per_rank = EXPERTS // world.size
    mine = range(world.rank * per_rank, (world.rank + 1) * per_rank)
    assert {k for k in local if k.startswith("experts.w1.")} == {f"experts.w1.{e}" for e in mine}, sorted(local)
    full = full_state_dict(written)
    assert {k for k in full if k.startswith("experts.w2.")} == {f"experts.w2.{e}" for e in range(EXPERTS)}
    assert {k for k in full if k.startswith("experts.b3.")} == {f"experts.b3.{e}" for e in range(EXPERTS)}
    x = torch.randn(2, SEQ, D_MODEL, generator=torch.Generator().manual_seed(world.rank))
    with torch.no_grad():
        want = written(x)
    sizes = [s for s in (1, 2, world.size // 2) if s < world.size]
    for ep_size in dict.fromkeys(sizes):
        comm = layout(world, ep_size).ep
        torch.manual_seed(99)  # other initial weights: everything must come from the checkpoint
        loaded = MoELayer(D_MODEL, D_FF, EXPERTS, ep_size=ep_size, comm=comm, **case).eval()
        loaded.load_state_dict(full)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), want, **TOL, msg=lambda m, s=ep_size: f"ep_size={s}: {m}")
    one = MoELayer(D_MODEL, D_FF, EXPERTS, **case)
    with raises(RuntimeError, r"Missing key\(s\).*experts\.w1\."):
        one.load_state_dict(local)  # one rank's shard lacks the other experts


class TinyModel(nn.Module):
    def __init__(self, ep_size: int, comm: Communicator | None) -> None:
        super().__init__()
        self.inp = nn.Linear(D_MODEL, D_MODEL)
        self.moe = MoELayer(D_MODEL, D_FF, EXPERTS, ep_size=ep_size, comm=comm, aux_loss_coef=0.0)
        self.out = nn.Linear(D_MODEL, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h + self.moe(h))


def check_gradients_equal_one_process_on_the_global_batch(world: World) -> None:
    """Expert parallel inside data parallel: after DataParallel.finish every rank holds the
    gradient of the mean loss over all ranks' batches (experts summed over their replicas
    only), under "sparta" with and without its queue and the engine's own strategy; the
    global norm counts each value once. A layer split over another group than the layout's
    is refused before any gradient moves."""
    ep_size = 2 if world.size >= 4 else world.size
    groups = layout(world, ep_size)
    torch.manual_seed(5)
    full = TinyModel(1, None)
    xs, _ = inputs(world.size, [3] * world.size)
    targets = [x.sum(-1, keepdim=True).tanh() for x in xs]
    # The whole global batch in one forward: the z-loss (a mean over tokens) is then the mean
    # of the ranks' z-losses, as data parallelism makes it. (Dropless top-k routes each token
    # alone, so the batch split does not change routing.)
    full_loss = nn.functional.mse_loss(full(torch.cat(xs)), torch.cat(targets))
    full_loss.backward()
    full_norm = torch.cat([p.grad.flatten() for p in full.parameters()]).norm()
    local = EXPERTS // ep_size
    assert groups.ep is not None
    mine = slice(groups.ep.rank * local, (groups.ep.rank + 1) * local)
    native = {"torch": "ddp", "horovod": "horovod"}.get(world.backend)
    runs = [("sparta", {}), ("sparta", {"queue": False})] + ([(native, {})] if native else [])
    for strategy, options in runs:
        torch.manual_seed(5)
        model = TinyModel(ep_size, groups.ep)
        dp = DataParallel(groups, strategy, microbatches=1, zero_bubble=False, **options)  # type: ignore[arg-type]
        wrapped = dp.wrap(model)
        dp.start()
        local_loss = nn.functional.mse_loss(wrapped(xs[world.rank]), targets[world.rank])
        local_loss.backward()
        dp.finish()
        loss = world.comm.all_reduce(local_loss.detach().reshape(1), op="avg")
        assert abs(float(loss) - full_loss.item()) < 1e-5, (strategy, float(loss), full_loss.item())
        square = sum(p.grad.double().square().sum() / dp.replicas(p) for p in model.parameters())
        norm = world.comm.all_reduce(square.reshape(1), op="sum").sqrt()  # type: ignore[union-attr]
        torch.testing.assert_close(norm.float(), full_norm.reshape(1), **TOL)
        for (name, p), q in zip(model.named_parameters(), full.parameters(), strict=True):
            want = q.grad[mine] if name.startswith("moe.experts.") else q.grad
            torch.testing.assert_close(p.grad, want, **TOL, msg=lambda m, n=name, s=strategy: f"{s} {n}: {m}")
        dp.close()
    # experts split over the whole world while the layout's groups hold ep_size ranks
    torch.manual_seed(5)
    if world.size > ep_size:
        with raises(ConfigError, "splits its experts over world ranks .* expert-parallel group is"):
            DataParallel(groups, "sparta", 1, False).wrap(TinyModel(world.size, world.comm))


def check_expert_tensor_parallel_equals_whole_experts(world: World) -> None:
    """Experts' hidden units split over tp (MoELayer.split_experts), alone and inside expert
    parallelism (4 ranks: tp pairs {0, 1}, {2, 3}, experts over {0, 2}, {1, 3}): outputs,
    input and router gradients equal the whole layer's, expert gradients its slices; the
    split layer loads a whole checkpoint; a d_ff that tp does not divide is refused."""
    tp_size = 2
    tp = world.comm.split_groups([list(range(r, r + tp_size)) for r in range(0, world.size, tp_size)])
    dp_size = world.size // tp_size
    ep = world.comm.split_groups([list(range(t, world.size, tp_size)) for t in range(tp_size)]) if dp_size > 1 else None
    assert tp is not None
    xs, ups = inputs(dp_size, [2] * dp_size)
    mine = world.rank // tp_size  # tp peers hold the same tokens
    cases = [CASES[0], CASES[1], CASES[6], CASES[-1]]  # gelu; swiglu with biases; xmoe with biases; soft
    for case in cases:
        sharded = {"ep_size": ep.size, "comm": ep} if ep is not None else {}
        torch.manual_seed(0)
        whole = MoELayer(D_MODEL, D_FF, EXPERTS, **case).train()
        torch.manual_seed(0)
        split = MoELayer(D_MODEL, D_FF, EXPERTS, **case, **sharded).train()
        split.split_experts(tp)
        a, b = split.experts.ff_range
        assert (a, b) == (tp.rank * D_FF // tp_size, (tp.rank + 1) * D_FF // tp_size), split.experts.ff_range
        assert split.experts.w1.shape[-1] == D_FF // tp_size and split.experts.w2.shape[1] == D_FF // tp_size
        x = xs[mine].clone().requires_grad_()
        y = split(x)
        (y * ups[mine]).sum().backward()
        grads = {name: torch.zeros_like(p) for name, p in whole.experts.named_parameters()}
        for member in range(dp_size) if ep is not None else [mine]:
            whole.zero_grad()
            xr = xs[member].clone().requires_grad_()
            yr = whole(xr)
            (yr * ups[member]).sum().backward()
            for name, p in whole.experts.named_parameters():
                grads[name] += p.grad
            if member == mine:
                torch.testing.assert_close(y, yr, **TOL, msg=lambda m, c=case: f"{c}: output: {m}")
                torch.testing.assert_close(x.grad, xr.grad, **TOL, msg=lambda m, c=case: f"{c}: input grad: {m}")
                for name, p in whole.router.named_parameters():
                    got = dict(split.router.named_parameters())[name].grad
                    torch.testing.assert_close(got, p.grad, **TOL, msg=lambda m, n=name: f"router {n}: {m}")
        local = EXPERTS // (ep.size if ep is not None else 1)
        first = (ep.rank if ep is not None else 0) * local
        cut = {"w1": (2, a, b), "w3": (2, a, b), "w2": (1, a, b), "b1": (1, a, b), "b3": (1, a, b)}
        for name, p in split.experts.named_parameters():
            want = grads[name][first : first + local]
            if name in cut:
                dim, lo, hi = cut[name]
                want = want.narrow(dim, lo, hi - lo)
            torch.testing.assert_close(p.grad, want, **TOL, msg=lambda m, n=name, c=case: f"{c}: {n}: {m}")
        # gathered whole from the slices (and the ep ranks), it is the whole layer's state
        gathered = full_state_dict(split)
        for key, value in whole.state_dict().items():
            torch.testing.assert_close(gathered[key], value, msg=lambda m, k=key: f"full_state_dict {k}: {m}")
        # a whole layer's checkpoint loads into the split one (each rank takes its slice)
        torch.manual_seed(7)
        loaded = MoELayer(D_MODEL, D_FF, EXPERTS, **case, **sharded).eval()
        loaded.split_experts(tp)
        loaded.load_state_dict(whole.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(loaded(xs[mine]), whole.eval()(xs[mine]), **TOL)
    empty = split.train()(torch.zeros(0, SEQ, D_MODEL, requires_grad=True))  # no tokens on any rank: still in step
    empty.sum().backward()
    assert empty.shape == (0, SEQ, D_MODEL)
    # tp ranks that route differently (torch's pipelining infers shapes on uninitialised
    # tensors) keep fewer rows under capacity: the sums still match in size, nothing hangs
    torch.manual_seed(0)
    sharded = {"ep_size": ep.size, "comm": ep} if ep is not None else {}
    capped = MoELayer(D_MODEL, D_FF, EXPERTS, router="switch", top_k=1, capacity_factor=0.5, **sharded)
    capped.split_experts(tp)
    noise = torch.randn(2, SEQ, D_MODEL, generator=torch.Generator().manual_seed(world.rank), requires_grad=True)
    capped(noise).sum().backward()
    assert noise.grad is not None and noise.grad.shape == noise.shape
    odd = MoELayer(D_MODEL, 19, EXPERTS)
    with raises(ConfigError, "d_ff=19 over tp=2: pick a tp"):
        odd.split_experts(tp)


def check_bad_input_on_one_rank_raises_on_every_rank(world: World) -> None:
    """One rank's bad input raises the same error, naming that rank and its reason, on every
    rank (agreed on the counts exchange), and the group stays in step afterwards."""
    torch.manual_seed(0)
    layer = MoELayer(D_MODEL, D_FF, EXPERTS, ep_size=world.size, comm=world.comm, name="blocks.3.moe")
    last = world.size - 1
    wrong = torch.randn(2, D_MODEL + 1) if world.rank == last else torch.randn(2, D_MODEL)
    with raises(InputError, rf"'blocks.3.moe' on .*: rank {last}: .*d_model={D_MODEL}.*Every rank of the group"):
        layer(wrong)
    mixed = torch.randn(2, D_MODEL, dtype=torch.float64 if world.rank == last else torch.float32)
    with raises(InputError, rf"rank {last}: .*float32 weights.*float64 rows.*layer.to"):
        layer(mixed)
    assert layer(torch.randn(2, D_MODEL)).shape == (2, D_MODEL)  # still in step afterwards


CHECKS = [
    check_every_router_sharded_over_all_ranks,
    check_every_router_with_expert_data_parallel_groups,
    check_pipelined_and_hierarchical_exchanges,
    check_overlapped_block_equals_the_plain_block,
    check_empty_ranks_and_idle_experts,
    check_checkpoint_loads_under_other_expert_parallel_sizes,
    check_gradients_equal_one_process_on_the_global_batch,
    check_expert_tensor_parallel_equals_whole_experts,
    check_bad_input_on_one_rank_raises_on_every_rank,
    check_block_tuning_agrees_on_candidates_when_ranks_hold_other_shapes,
]


def checks_for(size: int) -> list:
    """The checks a world of ``size`` ranks runs: two expert-parallel groups need four."""
    return [c for c in CHECKS if size >= 4 or c is not check_every_router_with_expert_data_parallel_groups]


if __name__ == "__main__":
    world, _ = start()
    finish(world, run_checks(world, checks_for(world.size)))
