"""The 3D trainer's bad input and failures on real ranks (run from tests/dist/parallel_checks.py):
each refused by a clear error on every rank, none left waiting in a collective."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from runner import raises
from torch import nn
from trainer_oracle import MODEL, MOE, OVERLAPPED, even_split

import sparta
from sparta.errors import ConfigError, InputError
from sparta.parallel import (
    Decoder,
    Layout,
    MoESpec,
    ParallelConfig,
    ParallelDims,
    ParallelModel,
    build_layout,
    parallelize,
)
from sparta.parallel.data import stdlib_tokens
from sparta.parallel.forward_only import forward_only


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
            parallelize(tied, layout, ParallelConfig(split_points=even_split(dims.pp), microbatches=2, moe=MOE))
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
        split = even_split(dims.pp) if dims.pp > 1 else None
        with raises(ConfigError, "layer 0 is a Sequential: leave it off"):
            parallelize(odd, layout, ParallelConfig(split_points=split, microbatches=2, moe=OVERLAPPED))
    if dims.ep > 1:
        with raises(ConfigError, "does not divide over ep"):
            parallelize(Decoder(MODEL), layout, ParallelConfig(moe=MoESpec(num_experts=3, top_k=1), microbatches=2))
    # a batch the micro-batches do not divide: refused before the schedule's first send
    torch.manual_seed(0)
    split = even_split(dims.pp) if dims.pp > 1 else None
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
    split = even_split(dims.pp) if dims.pp > 1 else None
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
