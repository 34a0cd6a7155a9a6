"""One rank of benchmarks/trainer.py's launches: the candidates timed alternating, and
their records. The driver (benchmarks/trainer.py) starts these through torchrun (``--_worker``)
or on the emulated cluster (``--_cluster_worker``) and reads rank 0's JSON lines. Imported by
trainer.py only, which puts the repository on sys.path first.

- ``sparta_worker``: the candidates named in --candidates (not torchtitan), or one
  candidate's peak memory;
- ``torchtitan_worker``: torchtitan alone, or alternating with Sparta's trainer in the
  same processes;
- ``cluster_worker``: the MoE model at dp4 x ep4 on 2 emulated nodes, co-scheduler off
  against on.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sparta_tools.bench.torchtitan import TorchtitanRun, patch_torchtitan_for_cpu
from sparta_tools.bench.trainer import (
    LAYOUTS,
    SIZES,
    TOL,
    TORCHTITAN_LAYOUTS,
    LayoutSpec,
    ModelShape,
    SpartaRun,
    Step,
    build_step,
    local_batch,
    moe_spec,
    oracle,
)

# ----------------------------------------------------------------------------- timing


def timed_steps(
    steps: dict[str, Step], batch_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]], warmup: int, repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Warm each candidate up, then time them alternating (rotated order, a barrier before
    each step). Returns ({name: seconds per timed step, slowest rank}, {name: every loss,
    warm-up included}). Each candidate sees batches 0, 1, 2, ... in its own order."""
    names = list(steps)
    losses: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        for _ in range(warmup):
            losses[name].append(steps[name](*batch_of(len(losses[name]))))
    seconds = torch.zeros(len(names), repeats, dtype=torch.float64)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            ids, targets = batch_of(len(losses[name]))
            dist.barrier()  # ranks start together: a step is not charged for a late peer
            start = time.perf_counter()
            losses[name].append(steps[name](ids, targets))
            seconds[names.index(name), r] = time.perf_counter() - start
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return {name: seconds[i].tolist() for i, name in enumerate(names)}, losses


def _status_mib(field: str) -> float:
    """``VmRSS`` / ``VmHWM`` of this process from /proc/self/status, in MiB. VmHWM, not
    ru_maxrss: Linux carries ru_maxrss over fork and exec (torchrun's agent forks us)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (same length everywhere), in rank order."""
    mine = torch.tensor(values, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]


def emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


def _round(x: float, digits: int = 5) -> float:
    return round(x, digits) if math.isfinite(x) else x


def timing_record(
    shape: ModelShape, spec: LayoutSpec, name: str, seconds: list[float], losses: list[float], **extra: object
) -> dict[str, object]:
    tokens = spec.dp * shape.batch * shape.seq_len
    median = statistics.median(seconds)
    return {
        "bench": "trainer",
        "model": shape.name,
        "layout": spec.name,
        "candidate": name,
        "ranks": spec.world_size,
        "pp": spec.pp,
        "dp": spec.dp,
        "tp": spec.tp,
        "schedule": spec.schedule if spec.pp > 1 else None,
        "median_s": _round(median),
        "min_s": _round(min(seconds)),
        "max_s": _round(max(seconds)),
        "repeats": len(seconds),
        "tokens_per_step": tokens,
        "tokens_per_s": round(tokens / median, 1),
        "tokens_per_s_per_rank": round(tokens / median / spec.world_size, 1),
        "first_loss": _round(losses[0], 6),
        "last_loss": _round(losses[-1], 6),
        **extra,
    }


# ----------------------------------------------------------------------------- Sparta's workers


def sparta_worker(args: argparse.Namespace) -> None:
    """One rank of a launch: build the candidates named in --candidates (not torchtitan),
    time them alternating, and (rank 0) print their records; or, with --memory-only, one
    candidate's peak memory."""
    import sparta
    from sparta.parallel import ParallelDims, build_layout

    torch.set_num_threads(1)
    shape = SIZES[args.size][args.model]
    spec = LAYOUTS[args.layout]
    world = sparta.init(backend="torch")
    base_rss = _status_mib("VmRSS")
    layouts: dict[int, Any] = {}

    def layout_for(ep: int) -> Any:
        if ep not in layouts:
            layouts[ep] = build_layout(ParallelDims(pp=spec.pp, dp=spec.dp, tp=spec.tp, ep=ep), world)
        return layouts[ep]

    layout = layout_for(1)
    steps: dict[str, Step] = {}
    for name in args.candidates.split(","):
        steps[name] = build_step(name, shape, spec, layout_for)

    def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return local_batch(shape, spec.dp, layout.dp_rank, step)

    if args.memory_only:
        timed_steps(steps, batch_of, args.warmup, 2)
        peaks = _gather_floats([_status_mib("VmHWM"), base_rss])
        if world.rank == 0:
            (name,) = steps
            emit(
                {
                    "bench": "trainer_memory",
                    "model": shape.name,
                    "layout": spec.name,
                    "candidate": name,
                    "ranks": spec.world_size,
                    "peak_rss_mib": round(max(p[0] for p in peaks), 1),
                    "peak_rss_mib_per_rank": [round(p[0], 1) for p in peaks],
                    "base_rss_mib": round(max(p[1] for p in peaks), 1),
                }
            )
        world.shutdown()
        return

    seconds, losses = timed_steps(steps, batch_of, args.warmup, args.repeats)
    if world.rank == 0:
        want, params = oracle(shape, spec.dp)
        floor = "eager" if "eager" in steps else "ddp" if "ddp" in steps else None
        for name in steps:
            gap = abs(losses[name][0] - want)
            extra: dict[str, object] = {
                "oracle_loss": _round(want, 6),
                "loss_gap": float(f"{gap:.3g}"),
                "wrong": gap > TOL,
                "params": params,
                "launch": "shared",
            }
            if floor is not None:
                extra["floor"] = floor
                extra["ratio_to_floor"] = round(statistics.median(seconds[name]) / statistics.median(seconds[floor]), 4)
            emit(timing_record(shape, spec, name, seconds[name], losses[name], **extra))
    world.comm.barrier()  # no rank leaves while rank 0 still computes its oracle and writes the records
    world.shutdown()


# ----------------------------------------------------------------------------- torchtitan


def torchtitan_worker(args: argparse.Namespace) -> None:
    """torchtitan alone (its step time and peak memory), or with --candidates
    torchtitan,sparta, torchtitan and Sparta's trainer alternating step by step in the same
    processes (a ``trainer_pair`` record: the ratio free of launch-to-launch drift; the
    patches touch only torchtitan's modules and stand-ins for modules Sparta never imports)."""
    torch.set_num_threads(1)
    shape = SIZES[args.size][args.model]
    spec = LAYOUTS[args.layout]
    patch_torchtitan_for_cpu()
    dist.init_process_group("gloo")
    base_rss = _status_mib("VmRSS")
    tp, fsdp = TORCHTITAN_LAYOUTS[spec.name]
    # torchtitan's debug model is dim 256 etc. whatever --size; batch and length follow it
    run = TorchtitanRun(shape, tp, fsdp)
    steps: dict[str, Step] = {"torchtitan": run}
    if args.candidates == "torchtitan,sparta":
        import sparta
        from sparta.parallel import ParallelDims, build_layout

        world = sparta.init(backend="torch")  # on the group above
        layout = build_layout(ParallelDims(pp=spec.pp, dp=spec.dp, tp=spec.tp), world)
        if layout.dp_rank != run.dp_rank:
            raise RuntimeError(f"rank {world.rank}: Sparta's dp rank {layout.dp_rank}, torchtitan's {run.dp_rank}")
        steps["sparta"] = build_step("sparta", shape, spec, lambda ep: layout)
        if spec.tp == 1:  # the trainers alone: Sparta's on torchtitan's own model and weights
            steps["sparta_torchtitan_model"] = SpartaRun(shape, spec, layout, spec.data_parallel, model=run.copy())

    def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return local_batch(shape, spec.dp, run.dp_rank, step)

    seconds, losses = timed_steps(steps, batch_of, args.warmup, args.repeats)
    if "sparta" in steps:
        if dist.get_rank() == 0:
            medians = {name: statistics.median(seconds[name]) for name in steps}
            same = "sparta_torchtitan_model" in steps
            gap = abs(losses["torchtitan"][0] - losses["sparta_torchtitan_model"][0]) if same else None
            emit(
                {
                    "bench": "trainer_pair",
                    "model": shape.name,
                    "layout": spec.name,
                    "launch": "torchtitan's (patched), the two alternating step by step",
                    "median_s": {name: round(m, 5) for name, m in medians.items()},
                    "seconds": {name: [round(x, 5) for x in seconds[name]] for name in steps},
                    "first_loss": {name: _round(losses[name][0], 6) for name in steps},
                    "torchtitan_over_sparta": round(medians["torchtitan"] / medians["sparta"], 4),
                    "torchtitan_over_sparta_same_model": (
                        round(medians["torchtitan"] / medians["sparta_torchtitan_model"], 4) if same else None
                    ),
                    # the same model and weights: the first-step losses must agree (both a global-batch mean)
                    "same_model_loss_gap": float(f"{gap:.3g}") if gap is not None else None,
                    "wrong": gap is not None and gap > TOL,
                }
            )
    else:
        _emit_torchtitan(shape, spec, run, seconds, losses, base_rss)
    dist.barrier()  # no rank tears its group down while rank 0 still prints (a gloo abort at exit, seen once)
    dist.destroy_process_group()


def _emit_torchtitan(
    shape: ModelShape,
    spec: LayoutSpec,
    run: TorchtitanRun,
    seconds: dict[str, list[float]],
    losses: dict[str, list[float]],
    base_rss: float,
) -> None:
    """torchtitan's own record (rank 0), with every rank's peak memory. Collective."""
    peaks = _gather_floats([_status_mib("VmHWM"), base_rss])
    if dist.get_rank() == 0:
        record = timing_record(
            shape,
            spec,
            "torchtitan",
            seconds["torchtitan"],
            losses["torchtitan"],
            params=run.params,
            launch="own (patched: patch_torchtitan_for_cpu)",
            model_shape="torchtitan llama3 debugmodel: dim 256, 6 layers, 16 heads, ffn 768, vocab 2048",
            oracle_loss=None,
            wrong=None,
            peak_rss_mib=round(max(p[0] for p in peaks), 1),
            peak_rss_mib_per_rank=[round(p[0], 1) for p in peaks],
            base_rss_mib=round(max(p[1] for p in peaks), 1),
        )
        emit(record)


# ----------------------------------------------------------------------------- co-scheduler on the emulated cluster


def cluster_worker(args: argparse.Namespace) -> None:
    """One rank of the emulated cluster: the MoE model at dp4 x ep4, co-scheduler off and on."""
    import sparta
    from sparta.parallel import ParallelDims, build_layout

    torch.set_num_threads(1)
    shape = SIZES[args.size]["moe"]
    spec = LayoutSpec("dp4_ep4", dp=4)
    world = sparta.init(backend="torch", ranks_per_node=args.ranks_per_node)
    layout = build_layout(ParallelDims(dp=4, ep=4), world)
    # nothing overlapped: flat exchanges, the dense gradients all-reduced after backward
    off = SpartaRun(shape, spec, layout, "sparta", bucket_per_layer=False)
    # the dense gradients' buckets overlap backward, the exchanges flat: the co-scheduler's MoE part off
    flat = SpartaRun(shape, spec, layout, "sparta")
    # the trainer's own co-scheduler: tuned on its first step's inputs, flat or two-level
    on = SpartaRun(shape, spec, layout, "sparta", moe=moe_spec(shape, pipeline_degree="auto"))

    def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return local_batch(shape, spec.dp, layout.dp_rank, step)

    # warm-up outside timed_steps: on's first step tunes its plan
    steps: dict[str, Step] = {"sparta_cosched_off": off, "sparta_flat_moe": flat, "sparta_cosched_on": on}
    losses = {name: [step(*batch_of(0))] for name, step in steps.items()}
    assert on.pm.auto is not None and not on.pm.auto.pending
    plan = next(iter(on.pm.auto.plans.values()))
    seconds, timed_losses = timed_steps(steps, lambda s: batch_of(s + 1), 0, args.repeats)
    for name in steps:
        losses[name] += timed_losses[name]
    if world.rank == 0:
        reference = losses["sparta_cosched_off"]
        gap = max(abs(a - b) for curve in losses.values() for a, b in zip(reference, curve, strict=True))
        median = {name: statistics.median(s) for name, s in seconds.items()}
        speedup = median["sparta_cosched_off"] / median["sparta_cosched_on"]
        common = {"nodes": world.num_nodes, "rate": args.rate, "ep": 4}
        for name in steps:
            record = timing_record(shape, spec, name, seconds[name], losses[name], **common)
            record["bench"] = "trainer_cluster"
            record["losses"] = [_round(x, 6) for x in losses[name]]
            emit(record)
        choice = plan.choice
        emit(
            {
                "bench": "trainer_target",
                "model": shape.name,
                "layout": "dp4_ep4 on 2 emulated nodes",
                "target": f"co-scheduler on >= 1.2x faster per step than off at {args.rate}, loss curves equal",
                "speedup": round(speedup, 4),
                # the parts: the dense buckets overlapping backward, then the MoE pipelining
                "speedup_buckets": round(median["sparta_cosched_off"] / median["sparta_flat_moe"], 4),
                "speedup_moe": round(median["sparta_flat_moe"] / median["sparta_cosched_on"], 4),
                "max_loss_gap": float(f"{gap:.3g}"),
                "losses_equal": gap <= TOL,
                "met": speedup >= 1.2 and gap <= TOL,
                "plan": {
                    "r_fwd": choice.degrees.forward,
                    "r_bwd": choice.degrees.backward,
                    "hierarchical": choice.hierarchical,
                    "blocks": [{"microbatches": m, "dedup": d} for m, d in sorted(set(on.pm.auto.overlaps.values()))],
                    # one block's forward and backward under each candidate the tuner timed
                    "block_candidates_s": {
                        f"{m} micro-batches{' dedup' if d else ''}": round(s, 4)
                        for (m, d), s in next(iter(on.pm.auto.overlap_seconds.values()), {}).items()
                    },
                },
                **common,
            }
        )
    for step in (off, flat, on):
        step.pm.close()
    world.shutdown()
