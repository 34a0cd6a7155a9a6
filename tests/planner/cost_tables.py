"""Hand-made cost tables the planner's tests replay and search: a 4-layer decoder whose parts
take round numbers of seconds, so a hand computation gives the expected step time."""

from __future__ import annotations

from sparta.parallel import DecoderConfig, MoESpec, ParallelConfig, ParallelDims
from sparta.planner import ModelCosts, PartCost, Plan, Workload, model_fingerprint
from sparta.scheduling.profiler import LinearFit

MODEL = DecoderConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=4, n_heads=4, d_ff=32)
WORK = Workload(MODEL, None, global_batch=8)


def const(seconds: float) -> LinearFit:
    return LinearFit(seconds, 0.0, 0.0, ())


def per_16_tokens(seconds: float) -> LinearFit:
    return LinearFit(0.0, seconds / 16, 0.0, ())


def part(fwd: float, bwd: float, saved: float = 1.0, params: int = 1000) -> PartCost:
    """Seconds per 16 tokens (two sequences); bytes saved per token."""
    return PartCost(per_16_tokens(fwd), per_16_tokens(bwd), per_16_tokens(bwd / 2), saved, params)


def costs(
    layer_fwd: float = 0.5,
    comm_s: float = 0.0,
    groups: tuple[int, ...] = (2, 4),
    moe: MoESpec | None = None,
    saved: float = 1.0,
) -> ModelCosts:
    """Each block: attention and MLP take layer_fwd / 2 forward each per 16 tokens, twice that
    backward; embedding and head cost nothing; every collective ``comm_s`` seconds; no
    optimizer time. The batch is 64 tokens (8 sequences of 8)."""
    half = layer_fwd / 2
    comm = {f"{op}/g{g}": const(comm_s) for g in groups for op in ("all_reduce", "all_gather", "all_to_all")}
    comm["p2p"] = const(0.0)
    return ModelCosts(
        parts={
            "embed": part(0.0, 0.0, saved=0.0, params=0),
            "attention": part(half, 2 * half, saved),
            "mlp": part(half, 2 * half, saved),
            "moe": part(half, 2 * half, saved),
            "head": part(0.0, 0.0, saved=0.0, params=0),
        },
        comm=comm,
        optimizer=const(0.0),
        model=model_fingerprint(MODEL, moe),
        hardware={"device": "test", "device_type": "cpu", "torch": "x"},
        world=max(groups),
    )


def plan(pp: int, schedule: str, mb: int, split: tuple[str, ...], spr: int = 1, **dims: int) -> Plan:
    return Plan(
        ParallelDims(pp=pp, **dims),
        ParallelConfig(schedule=schedule, microbatches=mb, stages_per_rank=spr, split_points=split),
    )
