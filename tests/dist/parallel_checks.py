"""The 3D trainer against one process: run under a launcher by tests/parallel/test_trainer_dist.py.

Every check builds the same small decoder (MoE MLPs, a sharded embedding) on every rank,
trains it for a few SGD steps through `sparta.parallel.parallelize`, and compares each
step's loss with one process that runs the global batch in the same chunks (dp ranks x
micro-batches: aux losses and routing are per chunk), summing their gradients and dividing
by the number of chunks. Layout from the command line: --pp --dp --tp --ep.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from runner import finish, raises, run_checks, start
from torch import nn
from torch.distributed.tensor import DTensor

import sparta
from sparta.errors import ConfigError, InputError
from sparta.moe import MoELayer
from sparta.parallel import (
    Decoder,
    DecoderConfig,
    Layout,
    MoESpec,
    ParallelConfig,
    ParallelDims,
    ParallelModel,
    build_layout,
    moe_layers,
    parallelize,
    schedule_actions,
)
from sparta.parallel.data import stdlib_tokens
from sparta.parallel.decoder import Block
from sparta.parallel.forward_only import forward_only
from sparta.parallel.parallel_config import overlap_refusal
from sparta.parallel.vocab_stages import VocabShard

MODEL = DecoderConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=4, n_heads=4, d_ff=32)
MOE = MoESpec(num_experts=4, top_k=2, aux_loss_coef=1e-2)
# the co-scheduler on: rows pipelined in 2 chunks over the two-level all-to-all (nodes of 2 ranks)
COSCHEDULED = MoESpec(num_experts=4, top_k=2, aux_loss_coef=1e-2, pipeline_degree=2, hierarchical=True)
# the co-scheduler tuned on the first step's inputs: the degrees it finds, and the two-level
# exchange weighed against flat where the ep groups span nodes (the "coscheduled" launch's 2)
AUTO = MoESpec(num_experts=4, top_k=2, aux_loss_coef=1e-2, pipeline_degree="auto")
# each block's batch cut into 2 micro-batches, one's attention beside the other's exchange
OVERLAPPED = MoESpec(num_experts=4, top_k=2, aux_loss_coef=1e-2, overlap=2)
# and each token sent to each node once, whose relay sums its experts' outputs (2 nodes of 2)
DEDUPLICATED = MoESpec(num_experts=4, top_k=2, aux_loss_coef=1e-2, overlap=2, dedup=True)
# under tp, whole experts on every tp rank (MOE splits their hidden units over tp)
REPLICATED = MoESpec(num_experts=4, top_k=2, aux_loss_coef=1e-2, expert_tp=False)
STEPS, BATCH, LR, TOL = 10, 4, 0.05, 1e-5  # BATCH: sequences per dp rank per step
# the lengths of ragged batches (seq_len - step * 3 % 4 over the steps)
LENGTHS_SEEN = (MODEL.seq_len, MODEL.seq_len - 3, MODEL.seq_len - 2, MODEL.seq_len - 1)
NORM_CAP = 0.5  # gradients are clipped to this global norm: clipping must agree too


def batches(dp: int, step: int, ragged: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ids and targets [dp * BATCH, T], T = seq_len, or with
    ``ragged`` a length that changes from step to step."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, MODEL.vocab_size, (dp * BATCH, MODEL.seq_len + 1), generator=g)
    length = MODEL.seq_len - (step * 3 % 4) if ragged else MODEL.seq_len
    return ids[:, :length], ids[:, 1 : length + 1]


def rank_batches(dp: int, step: int, ragged: bool, uneven: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each dp rank's (ids, targets) of ``step``: its BATCH rows of `batches`; with ``uneven``
    rank d's cut d tokens shorter, so that the dp ranks of one step take different lengths."""
    ids, targets = batches(dp, step, ragged)
    out = []
    for d in range(dp):
        rows, cut = slice(d * BATCH, (d + 1) * BATCH), ids.shape[1] - (d if uneven else 0)
        out.append((ids[rows, :cut], targets[rows, :cut]))
    return out


def padded(
    ids: torch.Tensor, targets: torch.Tensor, lengths: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the trainer documents it does to a short batch: pad ids with 0, targets with -100,
    to seq_len, or to the smallest of ``lengths`` that holds it."""
    pad = min((n for n in lengths if n >= ids.shape[1]), default=MODEL.seq_len) - ids.shape[1]
    return nn.functional.pad(ids, (0, pad), value=0), nn.functional.pad(targets, (0, pad), value=-100)


def reference_losses(
    dp: int,
    microbatches: int,
    moe: MoESpec | None,
    ragged: bool = False,
    lengths: tuple[int, ...] = (),
    uneven: bool = False,
) -> tuple[list[tuple[float, float]], float]:
    """One process, the global batch in dp x microbatches chunks, SGD on the chunks' mean,
    gradients clipped to NORM_CAP. Returns (loss, gradient norm before clipping) per step, and
    the trained model's loss on the next batch, forward only."""
    torch.manual_seed(0)
    model = Decoder(MODEL)
    if moe is not None:
        moe_layers(model, moe, None)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        chunks = _chunks(dp, step, microbatches, ragged, lengths, uneven)
        total = 0.0
        for x, y in chunks:
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            total += float(loss.detach())
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= len(chunks)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), NORM_CAP))
        opt.step()
        opt.zero_grad()
        losses.append((total / len(chunks), norm))
    return losses, _probe(model, dp, microbatches, ragged, lengths, uneven)


def _chunks(
    dp: int, step: int, microbatches: int, ragged: bool, lengths: tuple[int, ...], uneven: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches the dp ranks run at ``step``, each rank's padded as the trainer pads."""
    chunks = []
    for ids, targets in rank_batches(dp, step, ragged, uneven):
        ids, targets = padded(ids, targets, lengths)
        chunks += list(zip(ids.chunk(microbatches), targets.chunk(microbatches), strict=True))
    return chunks


@torch.no_grad()
def _probe(model: nn.Module, dp: int, microbatches: int, ragged: bool, lengths: tuple[int, ...], uneven: bool) -> float:
    """The trained model's forward loss on the batch after the last step, in the same chunks."""
    chunks = _chunks(dp, STEPS, microbatches, ragged, lengths, uneven)
    losses = [float(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())) for x, y in chunks]
    return sum(losses) / len(losses)


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
        split = None if stages == 1 or balance else _even_split(stages)
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
    check.__name__ += "_deduplicated" * (moe is DEDUPLICATED)
    check.__name__ += "".join(f"_recompute{i}" for i in recompute) + "".join(f"_len{n}" for n in lengths)
    check.__name__ += "_uneven" * uneven + "_vocab_stages" * vocab_stages + "_embedding_stages" * embedding_stages
    return check


def router_loads(layout: Layout) -> None:
    """A router that balances by load (sigmoid's bias) takes one load per micro-batch, at each
    shape's first step too, where torch's stages learn their shapes by running each stage's
    forward once more (on uninitialised rows after stage 0)."""
    torch.manual_seed(0)
    split = _even_split(layout.dims.pp)
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
        split_points=None if stages == 1 else _even_split(stages),
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


def _even_split(stages: int) -> tuple[str, ...]:
    per = MODEL.n_layers // stages
    return tuple(f"layers.{per * s}" for s in range(1, stages))


def bad_inputs(layout: Layout) -> None:
    dims = layout.dims
    with raises(ConfigError, "multiply to"):
        build_layout(ParallelDims(pp=dims.pp, dp=dims.dp, tp=dims.tp * 3), layout.world)
    with raises(ConfigError, "must divide dp"):
        ParallelDims(dp=2, ep=4)
    with raises(ConfigError, "at least as many micro-batches"):
        parallelize(Decoder(MODEL), layout, ParallelConfig(schedule="Interleaved1F1B", stages_per_rank=2,
                                                           microbatches=1, moe=MOE))  # fmt: skip
    if dims.pp > 1:
        with raises(ConfigError, "every stage needs one"):
            parallelize(Decoder(MODEL), layout, ParallelConfig(schedule="Interleaved1F1B", stages_per_rank=8,
                                                               microbatches=dims.pp, moe=MOE))  # fmt: skip
        with raises(ConfigError, "name no layer"):
            parallelize(Decoder(MODEL), layout, ParallelConfig(split_points=("layers.9",), microbatches=2, moe=MOE))
        tied = Decoder(MODEL)
        tied.output.weight = tied.tok_emb.weight  # type: ignore[union-attr]
        with raises(ConfigError, "output.weight is tok_emb.weight .a tied weight."):
            parallelize(tied, layout, ParallelConfig(split_points=_even_split(dims.pp), microbatches=2, moe=MOE))
    with raises(ConfigError, "unknown"):
        ParallelConfig(schedule="Zigzag")
    with raises(ConfigError, "ddp"):
        zbv = ParallelConfig(schedule="ZBVZeroBubble", stages_per_rank=2, microbatches=2, data_parallel="ddp", moe=MOE)
        parallelize(Decoder(MODEL), layout, zbv)
    if dims.ep > 1 and dims.tp == 1:  # (under tp the overlap is refused first, for its split experts)
        # a block over micro-batches needs the Decoder's Block in every MoE layer: refused on
        # every rank, not only on the stage that holds the odd one
        odd = Decoder(MODEL)
        odd.layers["0"] = nn.Sequential(odd.layers["0"])  # type: ignore[index]  # the Block inside another module
        split = _even_split(dims.pp) if dims.pp > 1 else None
        with raises(ConfigError, "layer 0 is a Sequential: leave it off"):
            parallelize(odd, layout, ParallelConfig(split_points=split, microbatches=2, moe=OVERLAPPED))
    if dims.ep > 1:
        with raises(ConfigError, "does not divide over ep"):
            parallelize(Decoder(MODEL), layout, ParallelConfig(moe=MoESpec(num_experts=3, top_k=1), microbatches=2))
    # a batch the micro-batches do not divide: refused before the schedule's first send
    torch.manual_seed(0)
    split = _even_split(dims.pp) if dims.pp > 1 else None
    pm = parallelize(Decoder(MODEL), layout, ParallelConfig(microbatches=2, split_points=split, moe=MOE))
    ids = torch.zeros(3, MODEL.seq_len, dtype=torch.long)
    with raises(InputError, "does not divide into microbatches"):
        pm.step(ids, ids)
    pm.close()
    # several padded lengths: longer than the longest is refused; a second batch size for one
    # length gets stages of its own (a stage keeps the shapes of its first step)
    pm = parallelize(
        Decoder(MODEL), layout, ParallelConfig(microbatches=2, split_points=split, moe=MOE, lengths=(4, 8))
    )
    with raises(InputError, "exceeds the longest of lengths"):
        pm.step(torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 9, dtype=torch.long))
    for batch, length in ((2, 3), (4, 4), (2, 4)):
        ids = torch.ones(batch, length, dtype=torch.long)
        assert pm.step(ids, ids) > 0
    assert sorted(pm.schedules) == [(2, 4), (4, 4)], pm.schedules
    pm.close()
    with raises(ConfigError, "both set"):
        ParallelConfig(seq_len=8, lengths=(4, 8))
    rank0_failures(layout)
    one_replica_failures(layout)


def rank0_failures(layout: Layout) -> None:
    """What fails on one rank, inside a collective step, raises on every rank instead of
    leaving the others waiting."""
    world = layout.world
    # the token stream: rank 0 alone tokenises and caches; its cache folder is a file here
    with tempfile.NamedTemporaryFile() as not_a_folder:
        with raises(ConfigError, "data.cache_dir"):
            stdlib_tokens(world.comm, 0.02, 300, Path(not_a_folder.name) / "cache", lambda line: None)

    def broken_tokenizer(line: str) -> None:  # any failure of rank 0's, not only the file system's
        raise RuntimeError("the tokenizer broke")

    with tempfile.TemporaryDirectory() as cache, raises(ConfigError, "RuntimeError: the tokenizer broke"):
        stdlib_tokens(world.comm, 0.02, 300, Path(cache), broken_tokenizer)
    # the stage balancing: rank 0 alone times the layers; ids past the positions fail there
    if layout.dims.pp > 1:
        too_long = torch.zeros(2, MODEL.seq_len + 4, dtype=torch.long)
        with raises(InputError, "did not run through the model"):
            parallelize(Decoder(MODEL), layout, ParallelConfig(microbatches=2, moe=MOE), sample=too_long)
        with raises(InputError, "integer ids"):
            parallelize(Decoder(MODEL), layout, ParallelConfig(microbatches=2, moe=MOE), sample=too_long.float())
        # the forward-only pass (validation): stage 0 hands on integers, stage 1 is told
        first = layout.pp_rank == 0
        stage = nn.Module()
        stage.forward = (lambda x: x.long()) if first else (lambda x: x)  # type: ignore[method-assign]
        ids = [torch.zeros(2, MODEL.seq_len, dtype=torch.long)]
        with raises(InputError, "handed on" if first else r"failed on pp rank\(s\) \[0\]"):
            forward_only({layout.pp_rank: stage}, layout.dims.pp, lambda s: s, layout.pp_group, ids, ids,
                         lambda y, t: y.float().mean())  # fmt: skip


def one_replica_failures(layout: Layout) -> None:
    """A bad batch, or a stage that fails, on the last data-parallel rank alone raises on every
    rank, none left waiting for it: step and evaluate agree on the batches over dp first, and
    evaluate's loss all-reduce carries who failed, so the other pipelines, whose forward-only
    passes ran to the end, raise too. After each the model steps and evaluates as before: a
    refused first batch fixes no sequence length, a failed pass leaves no targets queued in
    the head stages of vocab_stages."""
    dims = layout.dims
    odd, last = layout.dp_rank == dims.dp - 1, f"rank {dims.dp - 1}"
    split = _even_split(dims.pp) if dims.pp > 1 else None
    configs = [ParallelConfig(microbatches=2, split_points=split, moe=MOE)]
    if dims.pp > 1:
        configs.append(ParallelConfig(schedule="Interleaved1F1B", stages_per_rank=2, microbatches=2,
                                      split_points=split, moe=MOE, vocab_stages=True))  # fmt: skip
    for config in configs:
        torch.manual_seed(0)
        pm = parallelize(Decoder(MODEL), layout, config)
        ids = torch.arange(2 * MODEL.seq_len).reshape(2, MODEL.seq_len) % MODEL.vocab_size
        bad = ids[:, :5].clone()  # shorter than the batches after it
        if odd:
            bad[1, 3] = MODEL.vocab_size + 5
        with raises(InputError, rf"ParallelModel.step.*{last}: ParallelModel's ids got id {MODEL.vocab_size + 5}, out"):
            pm.step(bad, bad)
        before = pm.evaluate(ids, ids)
        bad = ids.clone()
        if odd:
            bad[0, 0] = -3
        with raises(InputError, rf"ParallelModel.evaluate.*{last}: targets hold -3, outside the output head's classes"):
            pm.evaluate(ids, bad)
        with raises(InputError, r"ids \(2, 8\) and targets \(2, 7\) must both be tensors"):
            pm.evaluate(ids, ids[:, :7] if odd else ids)
        _failing_norm(pm, odd, ids)
        after = pm.evaluate(ids, ids)
        assert abs(after - before) < 1e-6, ("evaluate after the failed passes", after, before, config)
        assert pm.step(ids, ids) > 0
        pm.close()


def _failing_norm(pm: ParallelModel, odd: bool, ids: torch.Tensor) -> None:
    """The final norm breaks at the last micro-batch, after every expert exchange with the
    other pipelines, on the last dp rank's ranks that hold it: they raise their own error,
    every other rank one naming it."""
    calls = 0

    def broken(module: nn.Module, args: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("the final norm broke")

    norms = [m for p in pm.parts for n, m in p.named_modules() if odd and n.split(".")[-1] == "norm"]
    hooks = [m.register_forward_pre_hook(broken) for m in norms]
    with raises(RuntimeError if hooks else sparta.SpartaError, "the final norm broke"):
        pm.evaluate(ids, ids)
    for h in hooks:
        h.remove()


def forward_only_failures(layout: Layout) -> None:
    """The forward-only pass over every rank as one pipeline: a failure anywhere raises on
    every rank, naming the rank where it began, and none waits. Looped, straight and V-shaped
    stage orders; 3 micro-batches, so ranks before the failure have sends still in flight.
    All on one group, then a pass that fails nowhere on it: a failed pass leaves no message
    behind to pair with the next one's."""
    import torch.distributed as dist

    n, me, m = layout.world.size, layout.world.rank, 3
    inputs = [torch.full((2, 4), float(k)) for k in range(m)]
    group = dist.new_group(list(range(n)))

    def stage(fn: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
        module = nn.Module()
        module.forward = fn  # type: ignore[method-assign]
        return module

    def broken(x: torch.Tensor) -> torch.Tensor:
        if float(x.flatten()[0]) >= 2:  # the last micro-batch: the earlier two went on
            raise RuntimeError("stage broke")
        return x + 1

    v_owner = lambda s: s if s < n else 2 * n - 1 - s  # noqa: E731
    cases = [
        ("looped", lambda s: s % n, 2 * n, 1, lambda x: x.long()),  # stage 1 hands on integers
        ("straight", lambda s: s, n, 2, broken),
        ("V", v_owner, 2 * n, n, broken),  # the V's turn: stage n, on the last rank, after stage n - 1 there
    ]
    for name, owner, stages, bad, fault in cases:
        if owner(bad) == me:
            want = (InputError, "handed on") if name == "looped" else (RuntimeError, "stage broke")
        else:
            want = (InputError, rf"failed on pp rank\(s\) \[{owner(bad)}\]")
        mine = {s: stage(fault if s == bad else lambda x: x + 1) for s in range(stages) if owner(s) == me}
        with raises(*want):
            forward_only(mine, stages, owner, group, inputs, inputs, lambda y, t: y.mean())
    # the same group, a pass that fails nowhere: the last stage's losses, nothing stale
    mine = {s: stage(lambda x: x + 1) for s in range(n) if s == me}
    losses = forward_only(mine, n, lambda s: s, group, inputs, inputs, lambda y, t: y.mean())
    assert [float(x) for x in losses] == ([k + n for k in range(m)] if me == n - 1 else []), losses


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
        forward_only_failures,
    ],
    "ddp_pp": [parity("1F1B", 1, "ddp", microbatches=4), router_loads, bad_inputs],  # bad_inputs at tp1 with ep too
    "horovod": [parity("1F1B", 1, "horovod")],
    "sparta": [parity("1F1B", 1, "sparta"), parity("1F1B", 1, "sparta", ragged=True, lengths=(6, MODEL.seq_len))],
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
