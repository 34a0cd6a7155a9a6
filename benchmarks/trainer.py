"""The 3D trainer against its floors and peers: tokens/s, step time and peak memory per rank.

    python benchmarks/trainer.py                        # every model, layout and peer (root: + the cluster)
    python benchmarks/trainer.py --size tiny --repeats 1 --layouts 1 --models dense --no-memory   # smoke

The models, layouts and candidates' steps live in sparta_tools/bench/trainer.py, which is also
`sparta bench trainer` (the same candidates on the ranks of one launch, as a suite of
`sparta bench`); torchtitan's patches and step live in sparta_tools/bench/torchtitan.py; this
script adds the launches per layout, torchtitan's launches, memory and the cluster.

Prints JSON lines: one ``trainer_header`` record (models, layouts, candidates, how it is
timed), then per (model, layout) one ``trainer`` record per candidate, ``trainer_memory``
records, ``skipped`` records for every peer that cannot run there (with the reason),
``trainer_target`` records (the issue's targets, met or not), and the co-scheduler's
``trainer_cluster`` records.

Models (``--size debug``, the default; ``tiny`` is for smoke tests):
  dense    a Llama of torchtitan's debug shape (dim 256, 6 layers, 16 heads, SwiGLU width 768,
           vocab 2048, untied head: 6.2M parameters), seq 512, batch 2 sequences per dp rank.
           Sparta, eager and DDP run the Hugging Face LlamaForCausalLM through
           sparta.parallel.hf.HFLlama (sdpa attention); torchtitan runs its own debug Llama,
           the same shape.
  moe      the MoE GPT: sparta.parallel.Decoder (d_model 256, 4 layers, 8 heads, vocab 2048,
           seq 256) whose MLPs are MoE layers (8 experts of width 512, top-2, dropless),
           batch 4 sequences per dp rank.
Layouts: 1 (one rank), dp2, dp4, tp2, pp2_1f1b and pp2_zbv (pipeline of 2 ranks, 2
micro-batches; ZBVZeroBubble with 2 stages per rank), fsdp4 (FSDP2 over 4 ranks).
Candidates (each layout runs those that apply):
  eager       plain one-process PyTorch on the same model: the floor for one rank
  ddp         torch DistributedDataParallel on the same model and batch: the floor for dp
              (MoE: every rank holds all experts)
  sparta      sparta.parallel.parallelize + ParallelModel.step + clip_grad_norm_ + AdamW
              (data_parallel "sparta", or "fsdp" at fsdp4; MoE: experts not split over ep
              (ep=1), their hidden units split over tp at tp2)
  sparta_ep   the MoE model with its experts split over the dp ranks (ep = dp)
  sparta_experts_whole  the MoE model under tp with every expert whole on each tp rank
              (MoESpec.expert_tp=False), against "sparta"'s experts split over tp
  sparta_head_whole  either model under tp with the output head whole on each tp rank
              (ParallelConfig.vocab_parallel_head=False), against "sparta"'s head split by
              vocabulary with the loss on the shards
  sparta_ddp  (opt-in) Sparta's trainer with data_parallel="ddp"
  torchtitan  torchtitan 0.3.0's debug Llama, its ParallelDims, parallelize_llama (TP and
              FSDP2), loss and clip_grad_norm_, in processes of its own with the CPU patches
              of sparta_tools/bench/torchtitan.py (listed there, one line of why each); its step is
              Trainer.train_step's (zero_grad, forward, loss, backward, clip 1.0, AdamW)
              without the data loader, logging, checkpoints and LR schedule
Every candidate steps AdamW (lr 3e-4, fused: torchtitan's default implementation) after
clipping the gradient norm to 1.0, on the same synthetic batches (uniform random ids; step
s's global batch is seeded by s, each dp rank takes its slice), float32, one thread per
rank (gloo, torchrun).

Timing: all candidates of a (model, layout) live in one launch; each is built, then runs
``--warmup`` untimed steps; then each repeat runs every candidate once, in an order rotated
by one each repeat, each step starting at a barrier; a step's time is the slowest rank's.
Reported: median, min and max over ``--repeats``, tokens/s of the global batch
(dp x batch x seq / median step) and per rank, and the ratio to the layout's floor (eager or
ddp). torchtitan's patches stay out of the shared launch: torchtitan is timed in a launch of
its own right after the others, with the same warm-up and repeats; then a third launch runs
torchtitan and Sparta's "sparta" alternating step by step in those patched processes (which
change only torchtitan's modules), and, without tp, ``sparta_torchtitan_model``: Sparta's
trainer on torchtitan's own Llama with torchtitan's weights (`TorchtitanLlama`; its first
loss must equal torchtitan's within 1e-5, else the record is ``wrong`` and the run fails),
printed as one ``trainer_pair`` record. Launches drift apart by more than the gap judged
here (the same step measured 10% apart in two launches), and the HF Llama is not
torchtitan's Llama (three q/k/v GEMMs against its fused one, another rotary embedding), so
the torchtitan target takes the same model's pair ratio where it ran (fsdp4), else the HF
pair's (tp2: torchtitan's fused QKV needs its own TP plan), and records the HF ratio beside.

Oracle: every record's ``first_loss`` (the first step's mean loss over the global batch) is
checked against one process running the same model's forward on the same global batch
(``oracle_loss``); ``wrong`` is true where they differ by more than 1e-5 (torchtitan's
model has its own initialisation: no oracle). At one rank this is Sparta's first-step loss
against plain eager's.

Memory (``--memory``, the default): each candidate again in a launch of its own (warm-up
plus two steps); ``peak_rss_mib`` is the largest rank's peak resident set (VmHWM),
``peak_rss_mib_per_rank`` every rank's, ``base_rss_mib`` the largest rank's resident set
after imports and before the model was built (interpreter, torch, transformers).

Co-scheduler (``--cluster``, needs root, ip and tc): the MoE model on an emulated cluster of
2 nodes x 2 ranks joined by a 300 Mbit/s link (sparta_tools.cluster), dp4 with the experts
split over all 4 ranks (ep 4), two candidates in one launch, alternating:
  sparta_cosched_off  the MoE layers' flat all-to-all, not chunked, nothing overlapped (what
                      DeepSpeed-MoE and torchtitan do)
  sparta_cosched_on   MoESpec(pipeline_degree="auto"): the trainer's
                      warm-up step tunes it (sparta/parallel/auto_schedule.py:
                      sparta.moe.tune_schedule on the first MoE layer with the inputs it saw:
                      profile, cost model, timed trials of its best plans, pipeline degrees,
                      flat or two-level all-to-all), the plan applied to every MoE layer
Both train from the same initialisation on the same batches; the record gives each step's
loss for both (``losses_equal``: within 1e-5) and the speed-up of on over off per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # sparta_tools lives beside the package

from sparta_tools.bench.torchtitan import (  # noqa: E402
    TorchtitanRun,
    patch_torchtitan_for_cpu,
    torchtitan_missing,
)
from sparta_tools.bench.trainer import (  # noqa: E402
    CANDIDATES,
    DEFAULT_CANDIDATES,
    LAYOUTS,
    LR,
    MAX_NORM,
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
    plan_candidates,
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


def _emit(record: dict[str, object]) -> None:
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
            _emit(
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
            _emit(timing_record(shape, spec, name, seconds[name], losses[name], **extra))
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
            _emit(
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
        _emit(record)


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
    off = SpartaRun(shape, spec, layout, "sparta")
    # the trainer's own co-scheduler: tuned on its first step's inputs, flat or two-level
    on = SpartaRun(shape, spec, layout, "sparta", moe=moe_spec(shape, pipeline_degree="auto"))

    def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return local_batch(shape, spec.dp, layout.dp_rank, step)

    # warm-up outside timed_steps: on's first step tunes its plan
    losses = {"sparta_cosched_off": [off(*batch_of(0))], "sparta_cosched_on": [on(*batch_of(0))]}
    assert on.pm.auto is not None and not on.pm.auto.pending
    plan = next(iter(on.pm.auto.plans.values()))
    steps: dict[str, Step] = {"sparta_cosched_off": off, "sparta_cosched_on": on}
    seconds, timed_losses = timed_steps(steps, lambda s: batch_of(s + 1), 0, args.repeats)
    for name in steps:
        losses[name] += timed_losses[name]
    if world.rank == 0:
        gap = max(abs(a - b) for a, b in zip(losses["sparta_cosched_off"], losses["sparta_cosched_on"], strict=True))
        speedup = statistics.median(seconds["sparta_cosched_off"]) / statistics.median(seconds["sparta_cosched_on"])
        common = {"nodes": world.num_nodes, "rate": args.rate, "ep": 4}
        for name in steps:
            record = timing_record(shape, spec, name, seconds[name], losses[name], **common)
            record["bench"] = "trainer_cluster"
            record["losses"] = [_round(x, 6) for x in losses[name]]
            _emit(record)
        choice = plan.choice
        _emit(
            {
                "bench": "trainer_target",
                "model": shape.name,
                "layout": "dp4_ep4 on 2 emulated nodes",
                "target": f"co-scheduler on >= 1.2x faster per step than off at {args.rate}, loss curves equal",
                "speedup": round(speedup, 4),
                "max_loss_gap": float(f"{gap:.3g}"),
                "losses_equal": gap <= TOL,
                "met": speedup >= 1.2 and gap <= TOL,
                "plan": {
                    "r_fwd": choice.degrees.forward,
                    "r_bwd": choice.degrees.backward,
                    "hierarchical": choice.hierarchical,
                },
                **common,
            }
        )
    off.pm.close()
    on.pm.close()
    world.shutdown()


def run_cluster(args: argparse.Namespace) -> None:
    from sparta_tools.cluster import ClusterConfig, EmulatedCluster, can_emulate

    why = can_emulate()
    if why is not None:
        _emit({"bench": "trainer_cluster", "candidate": "sparta_cosched_on", "skipped": why})
        return
    config = ClusterConfig(nodes=2, ranks_per_node=2, rate=args.rate)
    cmd = [
        sys.executable,
        __file__,
        "--_cluster_worker",
        f"--size={args.size}",
        f"--repeats={args.repeats}",
        f"--rate={args.rate}",
        f"--ranks-per-node={config.ranks_per_node}",
    ]
    with EmulatedCluster(config) as cluster:
        codes = cluster.run(cmd, timeout_s=args.timeout)
    if any(codes):
        _emit({"bench": "trainer_cluster", "error": f"ranks exited with {codes}"})


# ----------------------------------------------------------------------------- the launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks: int, worker_args: list[str], timeout: float, context: dict[str, object]) -> list[dict[str, Any]]:
    """Run this script's worker on ``ranks`` processes under torchrun; rank 0's JSON records
    are printed and returned. A failed or timed-out launch prints an ``error`` record."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        __file__,
        *worker_args,
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks: the session we started
        out, _ = proc.communicate()
        code = f"timed out after {timeout:g} s"
    records = [json.loads(line) for line in out.splitlines() if line.startswith('{"bench"')]
    for record in records:
        _emit(record)
    if code != 0 or not records:
        error = {**context, "error": f"torchrun exited with {code}", "output_tail": out[-3000:]}
        _emit(error)
        records.append(error)
    return records


def targets(size: str, shape: ModelShape, spec: LayoutSpec, records: list[dict[str, Any]]) -> None:
    """The issue's targets for this (model, layout), as records: ``ratio`` is Sparta's step
    time over the floor's (met at <= 1.03), or torchtitan's step time over Sparta's (met at
    >= 1: Sparta's tokens/s at least torchtitan's)."""
    by = {r["candidate"]: r for r in records if r.get("bench") == "trainer" and "median_s" in r}
    sparta = by.get("sparta")
    if sparta is None:
        return
    checks: list[tuple[str, float, bool | None, dict[str, object]]] = []
    if spec.world_size == 1 and "eager" in by:
        ratio = sparta["median_s"] / by["eager"]["median_s"]
        checks.append(("1 rank: Sparta within 3% of plain eager", ratio, ratio <= 1.03, {}))
    if spec.pure_dp and "ddp" in by:
        ratio = sparta["median_s"] / by["ddp"]["median_s"]
        checks.append(("dp: Sparta within 3% of plain DDP", ratio, ratio <= 1.03, {}))
    pair = [r for r in records if r.get("bench") == "trainer_pair" and "torchtitan_over_sparta" in r]
    if spec.name in ("tp2", "fsdp4") and (pair or "torchtitan" in by):
        # the same model alternating in one launch where that ran (the trainers alone); else
        # the HF Llama alternating with it; else the two launches' medians
        same = pair[0].get("torchtitan_over_sparta_same_model") if pair else None
        if same is not None:
            ratio, how = same, "torchtitan's own model under both, alternating in one launch"
        elif pair:
            ratio, how = pair[0]["torchtitan_over_sparta"], "alternating in one launch"
        else:
            ratio, how = by["torchtitan"]["median_s"] / sparta["median_s"], "medians of two launches"
        # where the same model ran, the HF Llama's pair ratio too: what a user of HF models sees
        extra = {"hf_llama_ratio": pair[0]["torchtitan_over_sparta"]} if same is not None else {}
        # torchtitan always runs its debug model: only --size debug compares equal shapes
        met = ratio >= 1.0 if size == "debug" else None
        checks.append((f"{spec.name}: Sparta's tokens/s at least torchtitan's ({how})", ratio, met, extra))
    for target, ratio, met, extra in checks:
        record: dict[str, object] = {
            "bench": "trainer_target",
            "model": shape.name,
            "layout": spec.name,
            "target": target,
            "ratio": round(ratio, 4),
            "met": met,
            **extra,
        }
        if met is None:
            record["why"] = f"--size {size}: torchtitan runs its debug model, Sparta a smaller one; not comparable"
        _emit(record)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="debug", help="model sizes (tiny: smoke tests)")
    parser.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated: {', '.join(LAYOUTS)}")
    parser.add_argument("--candidates", default=",".join(DEFAULT_CANDIDATES), help=f"of {', '.join(CANDIDATES)}")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per candidate")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per candidate first")
    parser.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="peak RSS per candidate, each in a launch of its own",
    )
    parser.add_argument(
        "--cluster",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="co-scheduler off vs on on the emulated 2-node cluster (root)",
    )
    parser.add_argument("--rate", default="300mbit", help="the emulated cluster's link rate, as tc writes it")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    parser.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_cluster_worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="dense", help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="1", help=argparse.SUPPRESS)
    parser.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ranks-per-node", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._cluster_worker:
        cluster_worker(args)
        return 0
    if args._worker:
        if args.candidates.startswith("torchtitan"):
            torchtitan_worker(args)
        else:
            sparta_worker(args)
        return 0
    models = args.models.split(",")
    layouts = args.layouts.split(",")
    wanted = args.candidates.split(",")
    for kind, known, given in (
        ("model", SIZES[args.size], models),
        ("layout", LAYOUTS, layouts),
        ("candidate", CANDIDATES, wanted),
    ):
        unknown = [g for g in given if g not in known]
        if unknown:
            parser.error(f"unknown {kind}s {unknown}; known: {', '.join(known)}")
    if args.repeats < 1 or args.warmup < 1:
        parser.error("--repeats and --warmup must be >= 1 (the first-step loss is checked on the warm-up)")

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds through the cluster's `with`, which tears it down

    signal.signal(signal.SIGTERM, on_term)
    missing = torchtitan_missing() if "torchtitan" in wanted else None
    _emit(
        {
            "bench": "trainer_header",
            "size": args.size,
            "models": {name: asdict(SIZES[args.size][name]) for name in models},
            "layouts": {name: asdict(LAYOUTS[name]) for name in layouts},
            "candidates": wanted,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "threads_per_rank": 1,
            "engine": "torch (gloo)",
            "optimizer": f"AdamW (fused) lr {LR}, grad norm clipped to {MAX_NORM}",
            "dtype": "float32",
            "oracle": f"one-process forward on step 0's global batch; wrong if first_loss differs by more than {TOL}",
            "torch": torch.__version__,
            "torchtitan": missing or "0.3.0 (patched: patch_torchtitan_for_cpu)",
            "cpus": len(os.sched_getaffinity(0)),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
        }
    )
    failed = False
    for model in models:
        shape = SIZES[args.size][model]
        for name in layouts:
            spec = LAYOUTS[name]
            run, skipped = plan_candidates(shape, spec, wanted)
            context = {"bench": "trainer", "model": model, "layout": name}
            for candidate, why in skipped.items():
                _emit({**context, "candidate": candidate, "skipped": why})
            if "torchtitan" in run and missing is not None:
                _emit({**context, "candidate": "torchtitan", "skipped": missing})
                run.remove("torchtitan")
            common = [f"--size={args.size}", f"--model={model}", f"--layout={name}", f"--warmup={args.warmup}"]
            shared = [c for c in run if c != "torchtitan"]
            records: list[dict[str, Any]] = []
            timed: list[tuple[str, dict[str, object]]] = [(",".join(shared), context)] if shared else []
            if "torchtitan" in run:
                timed.append(("torchtitan", {**context, "candidate": "torchtitan"}))
                if "sparta" in run:  # the two alternating in torchtitan's processes
                    timed.append(("torchtitan,sparta", {**context, "bench": "trainer_pair"}))
            for candidates, where in timed:
                worker = ["--_worker", *common, f"--repeats={args.repeats}", f"--candidates={candidates}"]
                records += launch(spec.world_size, worker, args.timeout, where)
            if args.memory:
                for candidate in shared:
                    records += launch(
                        spec.world_size,
                        ["--_worker", *common, "--memory-only", f"--candidates={candidate}"],
                        args.timeout,
                        {**context, "bench": "trainer_memory", "candidate": candidate},
                    )
            failed |= any("error" in r or r.get("wrong") for r in records) or not records
            targets(args.size, shape, spec, records)
    if args.cluster:
        run_cluster(args)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
