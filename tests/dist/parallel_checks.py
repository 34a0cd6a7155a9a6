"""The 3D trainer against one process: run under a launcher by tests/parallel/test_trainer_dist.py.

Every check builds the same small decoder (MoE MLPs, a sharded embedding) on every rank,
trains it for a few SGD steps through `sparta.parallel.parallelize`, and compares each
step's loss with one process that runs the global batch in the same chunks (dp ranks x
micro-batches: aux losses and routing are per chunk), summing their gradients and dividing
by the number of chunks. Layout from the command line: --pp --dp --tp --ep.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from runner import finish, run_checks, start
from torch.distributed.tensor import DTensor
from trainer_failures import bad_inputs, forward_only_failures
from trainer_oracle import (
    AUTO,
    BATCH,
    COSCHEDULED,
    DEDUPLICATED,
    LENGTHS_SEEN,
    LR,
    MODEL,
    MOE,
    NORM_CAP,
    OVERLAPPED,
    REPLICATED,
    SIGMOID,
    STEPS,
    TOL,
    batches,
    even_split,
    rank_batches,
    reference_losses,
)

import sparta
from sparta.moe import MoELayer
from sparta.parallel import (
    Decoder,
    Layout,
    MoESpec,
    ParallelConfig,
    ParallelDims,
    build_layout,
    parallelize,
    schedule_actions,
)
from sparta.parallel.decoder import Block
from sparta.parallel.parallel_config import overlap_refusal
from sparta.parallel.vocab_stages import VocabShard


def trained_losses(
    layout: Layout, config: ParallelConfig, ragged: bool = False, balance: bool = False, uneven: bool = False
) -> tuple[list[tuple[float, float]], float]:
    """The trainer's (loss, gradient norm) per step, and its `evaluate` on the next batch."""
    torch.manual_seed(0)
    model = Decoder(MODEL)
    sample = batches(1, 0)[0][:2] if balance else None
    pm = parallelize(model, layout, config, sample=sample)
    opt = torch.optim.SGD(pm.param_groups(), lr=LR)  # on CUDA SGD runs foreach: one kind of tensor a group
    losses = []
    try:
        for step in range(STEPS):
            ids, targets = rank_batches(layout.dims.dp, step, ragged, uneven)[layout.dp_rank]
            loss = pm.step(ids, targets)
            losses.append((loss, pm.clip_grad_norm_(NORM_CAP)))
            opt.step()
            opt.zero_grad()
        probe = pm.evaluate(*rank_batches(layout.dims.dp, STEPS, ragged, uneven)[layout.dp_rank])
    finally:
        pm.close()
    assert pm.plan.actions == schedule_actions(config.schedule, layout.dims.pp, config.microbatches,
                                               config.stages_per_rank)  # fmt: skip
    split = layout.dims.tp > 1 and config.moe is not None and config.moe.expert_tp
    moe = [m for part in pm.parts for m in part.modules() if isinstance(m, MoELayer)]
    if config.moe is not None and config.moe.auto:  # tuned once, at the first step; one plan for the equal layers
        assert pm.auto is not None and not pm.auto.pending and len(pm.auto.plans) == len(moe) > 0, pm.auto.plans
        assert len({(p.degrees, p.hierarchical) for p in pm.auto.plans.values()}) == 1, pm.auto.plans
        plan = next(iter(pm.auto.plans.values()))
        assert all(m.degrees == plan.degrees for m in moe), [m.degrees for m in moe]
        assert f"all-to-all ({len(moe)} MoE layers)" in pm.auto.describe(), pm.auto.describe()
        # the blocks' micro-batches tuned too where the layout lets them overlap (not under
        # zero-bubble schedules, recomputation, expert tp or FSDP2), one count for the equal blocks
        overlap = overlap_refusal(config, layout.dims) is None and config.data_parallel != "fsdp"
        assert len(pm.auto.overlaps) == (len(moe) if overlap else 0), (pm.auto.overlaps, config)
        assert len(set(pm.auto.overlaps.values())) <= 1, pm.auto.overlaps
        assert ("; blocks: " in pm.auto.describe()) == overlap, pm.auto.describe()
        # two-level offered where every ep group spans nodes (2 nodes of 2 at dp4 x ep4), else flat alone
        assert (pm.auto.exchange is not None) == (layout.world.num_nodes > 1), (pm.auto.exchange, layout.world)
    if config.moe is not None and config.moe.overlap_asked:  # every block of this rank overlaps
        blocks = [b for part in pm.parts for b in part.modules() if isinstance(b, Block)]
        assert blocks and all(b.overlap == config.moe.overlap for b in blocks), [b.overlap for b in blocks]
        assert all((b.dedup is not None) == config.moe.dedup for b in blocks), [b.dedup for b in blocks]
    if config.moe is not None and config.moe.balances_by_load:  # the same bias on every dp replica, moved
        biases = torch.stack([m.router.expert_bias for m in moe])
        every = layout.dp.all_gather(biases)
        assert biases.abs().sum() > 0 and all(torch.equal(b, biases) for b in every), f"router biases: {every}"
    assert all(m.experts.w1.shape[-1] == MODEL.d_ff // (layout.dims.tp if split else 1) for m in moe), "experts' d_ff"
    assert (len(pm.plan.expert_tp) == len(moe)) if split else not pm.plan.expert_tp, pm.plan.expert_tp
    # the last stage's head: its vocabulary over tp, its loss on the shards (losses compared below)
    heads = [part.get_submodule("output") for part in pm.parts if hasattr(part, "output") and part.output is not None]
    tp_head = layout.dims.tp > 1 and config.tensor_parallel and not config.vocab_stages
    assert (pm.plan.tp_plan.get("output") == "vocab") == (tp_head and pm.has_last), pm.plan.tp_plan
    for head in heads if tp_head else ():  # split by rows over the tp mesh dimension (FSDP2 may add dp)
        tp_dim = head.weight.device_mesh.mesh_dim_names.index("tp")
        assert head.weight.placements[tp_dim].is_shard(0), head.weight.placements
    # vocabulary stages: their rows cut over pp, and over tp as the tp head is
    rows = [m for part in pm.parts for m in part.modules() if isinstance(m, VocabShard)]
    tp_rows = layout.dims.tp > 1 and config.tensor_parallel and config.vocab_parallel_head
    per = MODEL.vocab_size // (layout.dims.pp * (layout.dims.tp if tp_rows else 1))
    count = config.vocab_stages + config.embedding_stages
    assert len(rows) == count and all(m.weight.shape[0] == per and m.split_over_tp == tp_rows for m in rows), rows
    # one stage: micro-batches straight through it, no pipelining schedule (FSDP2 reduces as backward goes)
    assert pm.one_stage == (layout.dims.pp == 1 and not config.vocab_stages and not config.embedding_stages)
    assert not (pm.one_stage and pm.schedules), pm.schedules
    if config.lengths and not pm.one_stage:  # one schedule per batch shape the padded batches took
        shift = layout.dp_rank if uneven else 0
        want = sorted({(BATCH, pm.batches.padded_length(n - shift)) for n in LENGTHS_SEEN})
        assert sorted(pm.schedules) == want, pm.schedules
    marks = {s: " (recomputed)" if s in config.recompute else "" for s in range(len(pm.plan.stages))}
    assert all(f"stage {s}{mark}:" in str(pm.plan) for s, mark in marks.items()), str(pm.plan)
    return losses, probe


def compare(
    layout: Layout, config: ParallelConfig, ragged: bool = False, balance: bool = False, uneven: bool = False
) -> None:
    got, probe = trained_losses(layout, config, ragged, balance, uneven)
    want, want_probe = reference_losses(layout.dims.dp, config.microbatches, config.moe, ragged, config.lengths, uneven)
    # evaluate: forward only, on every schedule (torch's own eval() fails under V-shaped ones)
    assert abs(probe - want_probe) < TOL, f"{config.schedule}: evaluate {probe} vs one process {want_probe}"
    gaps = [abs(a[0] - b[0]) for a, b in zip(got, want, strict=True)]
    assert max(gaps) < TOL, f"{config.schedule}/{config.data_parallel}: losses {got} vs one process {want}"
    # the global gradient norm counts every value once, however it is sharded or replicated
    norms = [abs(a[1] - b[1]) / b[1] for a, b in zip(got, want, strict=True)]
    assert max(norms) < 1e-4, f"{config.schedule}/{config.data_parallel}: grad norms {got} vs one process {want}"
    assert want[-1][0] < want[0][0], f"the reference did not learn: {want}"


def parity(
    schedule: str,
    stages_per_rank: int,
    strategy: str,
    embedding: str = "sparse",
    ragged: bool = False,
    balance: bool = False,
    microbatches: int = 2,
    moe: MoESpec = MOE,
    recompute: tuple[int, ...] = (),
    lengths: tuple[int, ...] = (),
    uneven: bool = False,
    vocab_stages: bool = False,
    embedding_stages: bool = False,
) -> Callable:
    """A check: the trainer's losses equal one process's. ragged: batch lengths change from step
    to step (the trainer pads them); balance: stages cut by measured time, not given points;
    recompute: the stages whose layers recompute their activations in backward (the one
    process recomputes nothing); lengths: the trainer pads each batch to the smallest of these
    (a schedule each), not to seq_len; uneven: the dp ranks of one step take different lengths
    (so different shapes meet in the expert exchanges and the gradient sync); vocab_stages:
    the head split by vocabulary over pp stages of its own, one per pipeline rank;
    embedding_stages: the token embedding the same way, at the front."""

    def check(layout: Layout) -> None:
        stages = layout.dims.pp * (stages_per_rank - vocab_stages - embedding_stages)
        split = None if stages == 1 or balance else even_split(stages)
        config = ParallelConfig(
            schedule=schedule,
            microbatches=max(microbatches, layout.dims.pp),
            stages_per_rank=stages_per_rank,
            split_points=split,
            data_parallel=strategy,
            embedding=embedding,
            moe=moe,
            seq_len=None if lengths else MODEL.seq_len,
            lengths=lengths,
            recompute=recompute,
            vocab_stages=vocab_stages,
            embedding_stages=embedding_stages,
        )
        compare(layout, config, ragged, balance, uneven)

    check.__name__ = f"parity_{schedule}_{strategy}_{embedding}" + ("_ragged" * ragged) + ("_balanced" * balance)
    check.__name__ += "_coscheduled" * (moe is COSCHEDULED) + "_experts_replicated" * (moe is REPLICATED)
    check.__name__ += "_auto_degrees" * (moe is AUTO) + "_overlapped" * (moe is OVERLAPPED)
    check.__name__ += "_deduplicated" * (moe is DEDUPLICATED) + "_sigmoid" * (moe is SIGMOID)
    check.__name__ += "".join(f"_recompute{i}" for i in recompute) + "".join(f"_len{n}" for n in lengths)
    check.__name__ += "_uneven" * uneven + "_vocab_stages" * vocab_stages + "_embedding_stages" * embedding_stages
    check.__name__ += f"_mb{microbatches}" * (microbatches != 2)
    return check


def router_loads(layout: Layout) -> None:
    """A router that balances by load (sigmoid's bias) takes one load per micro-batch, at each
    shape's first step too, where torch's stages learn their shapes by running each stage's
    forward once more (on uninitialised rows after stage 0)."""
    torch.manual_seed(0)
    split = even_split(layout.dims.pp)
    spec = MoESpec(num_experts=4, top_k=2, router="sigmoid")
    config = ParallelConfig(schedule="1F1B", microbatches=4, split_points=split, data_parallel="ddp", moe=spec,
                            lengths=(6, MODEL.seq_len))  # fmt: skip
    pm = parallelize(Decoder(MODEL), layout, config)
    moe = [m for part in pm.parts for m in part.modules() if isinstance(m, MoELayer)]
    taken: list[int] = []
    for layer in moe:
        real = layer.router.update_load
        layer.router.update_load = lambda load, real=real: (taken.append(1), real(load))[-1]  # type: ignore[method-assign]
    try:
        assert moe, "no MoE layer on this rank"
        for step, length in enumerate((MODEL.seq_len, MODEL.seq_len, 6, 6)):
            ids, targets = rank_batches(layout.dims.dp, step, False, False)[layout.dp_rank]
            taken.clear()
            pm.step(ids[:, :length], targets[:, :length])
            assert len(taken) == 4 * len(moe), f"step {step}: {len(taken)} loads for {len(moe)} layers, 4 micro-batches"
            assert all(layer.load_updates for layer in moe)
    finally:
        pm.close()


def fused_optimizer(layout: Layout) -> None:
    """`ParallelModel.param_groups`: every parameter once, one kind of tensor per group (plain
    or a DTensor of one mesh: here experts and table shards beside FSDP2 and TP DTensors), so
    that torch's fused AdamW steps them, to the for-loop AdamW's values."""
    torch.manual_seed(0)
    per_rank = 2 if layout.dims.pp > 1 else 1
    stages = layout.dims.pp * per_rank
    config = ParallelConfig(
        schedule="Interleaved1F1B" if per_rank > 1 else "1F1B",
        microbatches=max(2, layout.dims.pp),
        stages_per_rank=per_rank,
        split_points=None if stages == 1 else even_split(stages),
        data_parallel="fsdp",
        moe=MOE,
        seq_len=MODEL.seq_len,
    )
    pm = parallelize(Decoder(MODEL), layout, config)
    try:
        pm.step(*rank_batches(layout.dims.dp, 0, False, False)[layout.dp_rank])
    finally:
        pm.close()
    groups = pm.param_groups()
    params = [p for g in groups for p in g["params"]]
    assert len(params) == len(set(params)) == len(list(pm.parameters())), "every parameter once"
    kinds = [{p.device_mesh if isinstance(p, DTensor) else None for p in g["params"]} for g in groups]
    assert all(len(k) == 1 for k in kinds), kinds
    if layout.dims.tp > 1:
        assert len(groups) > 1 and None in {k.pop() for k in kinds}, "experts (plain) beside DTensors"

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    start = [local(p.detach()).clone() for p in params]
    after = []
    for fused in (True, False):
        for p, value in zip(params, start, strict=True):
            local(p.detach()).copy_(value)
        kwargs = {"fused": True} if fused else {"foreach": False}
        torch.optim.AdamW(groups if fused else list(pm.parameters()), lr=LR, **kwargs).step()  # type: ignore[arg-type]
        after.append([local(p.detach()).clone() for p in params])
    for a, b in zip(*after, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("pp", "dp", "tp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--checks", default="all")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="pose as nodes of this many ranks")
    args, _ = parser.parse_known_args()
    world, _ = start(timeout_s=120.0, ranks_per_node=args.ranks_per_node)
    layout = build_layout(ParallelDims(pp=args.pp, dp=args.dp, tp=args.tp, ep=args.ep), world, args.device)
    checks = CHECKS[args.checks]
    failures = run_checks(world, [_bind(check, layout) for check in checks])
    finish(world, failures)


def _bind(check: Callable[[Layout], None], layout: Layout) -> Callable[[sparta.World], None]:
    def bound(world: sparta.World) -> None:
        check(layout)

    bound.__name__ = check.__name__
    return bound


# the head split over the pipeline ranks: under zero-bubble (its W gradients by autograd.grad)
# with the shards replicated over tp; looped, one schedule (and shape inference) per length;
# and with the token embedding's stages in front (3 stages per rank), its layers recomputed,
# or sharded by FSDP2
VOCAB_STAGES = [
    parity("ZBVZeroBubble", 2, "sparta", vocab_stages=True),
    parity("Interleaved1F1B", 2, "sparta", ragged=True, lengths=(5, MODEL.seq_len), uneven=True, vocab_stages=True),
    parity("Interleaved1F1B", 3, "sparta", vocab_stages=True, embedding_stages=True, recompute=(2,)),
    # under FSDP2: the embedding stages read their rows' weight in their own forward
    parity("LoopedBFS", 3, "fsdp", vocab_stages=True, embedding_stages=True),
]

CHECKS: dict[str, list[Callable[[Layout], None]]] = {
    "all": [
        parity("1F1B", 1, "sparta"),
        parity("Interleaved1F1B", 2, "fsdp"),
        parity("ZBVZeroBubble", 2, "sparta"),
        parity("DualPipeV", 2, "fsdp", microbatches=4),  # DualPipeV: micro-batches >= stages
        parity("1F1B", 1, "sparta", ragged=True, balance=True),
        # batches of 4..8 tokens padded to 4, 6 or 8, dp rank 1's a token shorter than rank 0's:
        # schedules over the same stages' modules, different shapes on the dp ranks of a step; at
        # step 2 dp rank 1 meets length 6 first while rank 0 repeats it, and both ranks' extra
        # shape-learning runs, with their FSDP2 gathers, must pair up
        parity("ZBVZeroBubble", 2, "fsdp", ragged=True, lengths=(4, 6, MODEL.seq_len), uneven=True),
        # stage-aware recomputation under TP, MoE and the sparse embedding; under zero-bubble
        # (input and weight gradients by autograd.grad, each pass recomputing) with FSDP2,
        # rank 0 recomputing its stage 0 and rank 1 its stage 2
        parity("1F1B", 1, "sparta", recompute=(0,)),
        parity("ZBVZeroBubble", 2, "fsdp", recompute=(0, 2)),
        parity("1F1B", 1, "sparta", moe=REPLICATED),
        parity("ZBVZeroBubble", 2, "sparta", moe=AUTO),
        *VOCAB_STAGES,
        fused_optimizer,
        bad_inputs,
    ],
    "ddp": [
        parity("1F1B", 1, "ddp"),
        parity("1F1B", 1, "ddp", moe=OVERLAPPED),
        parity("1F1B", 1, "ddp", moe=AUTO),  # the blocks timed beside DDP's hooks, which must not fire
        parity("GPipe", 1, "sparta", embedding="dense"),
        parity("1F1B", 1, "ddp", recompute=(0,)),
        parity("1F1B", 1, "ddp", moe=SIGMOID),  # ep2 of dp4: the load summed over both ep groups
        parity("GPipe", 1, "ddp"),  # one stage: no schedule runs, nor DDP with find_unused_parameters
        forward_only_failures,
    ],
    "ddp_pp": [
        parity("1F1B", 1, "ddp", microbatches=4),
        # two backwards with no forward between them in a stage's first step: torch DDP's bucket
        # rebuild would fail, so the trainer turns its find_unused_parameters on (dp_rules.py)
        parity("1F1B", 1, "ddp"),  # 2 micro-batches over 2 stages
        parity("GPipe", 1, "ddp", ragged=True, lengths=(6, MODEL.seq_len)),  # a schedule for each length
        parity("Interleaved1F1B", 2, "ddp"),
        router_loads,
        bad_inputs,  # at tp1 with ep too
    ],
    "horovod": [parity("1F1B", 1, "horovod")],
    "sparta": [
        parity("1F1B", 1, "sparta"),
        parity("1F1B", 1, "sparta", ragged=True, lengths=(6, MODEL.seq_len)),
        parity("1F1B", 1, "sparta", moe=SIGMOID),  # ep = dp: the counts exchange sums the load
    ],
    "coscheduled": [
        parity("1F1B", 1, "sparta", moe=COSCHEDULED),
        parity("1F1B", 1, "sparta", moe=AUTO),
        parity("1F1B", 1, "sparta", moe=OVERLAPPED),
        parity("GPipe", 1, "fsdp", moe=OVERLAPPED),
        parity("1F1B", 1, "sparta", moe=DEDUPLICATED),
    ],
    "vocab": VOCAB_STAGES,
    "quick": [parity("1F1B", 1, "sparta"), bad_inputs],
    "one": [
        parity("1F1B", 1, "sparta", embedding="dense"),
        parity("1F1B", 1, "ddp"),
        parity("GPipe", 1, "fsdp"),
        fused_optimizer,
    ],
}

if __name__ == "__main__":
    main()
