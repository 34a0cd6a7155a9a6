"""The 3D trainer against its floors and peers: tokens/s, step time and peak memory per rank.

    python benchmarks/trainer.py                        # every model, layout and peer (root: + the cluster)
    python benchmarks/trainer.py --size tiny --repeats 1 --layouts 1 --models dense --no-memory   # smoke

The models, layouts and candidates' steps live in sparta_tools/bench/trainer.py, which is also
`sparta bench trainer` (the same candidates on the ranks of one launch, as a suite of
`sparta bench`); torchtitan's patches and step live in sparta_tools/bench/torchtitan.py; what
one rank of a launch runs (the candidates timed alternating, their records) lives in
benchmarks/trainer_ranks.py; this script adds the launches per layout, torchtitan's launches,
memory, the cluster and the targets.

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
split over all 4 ranks (ep 4), three candidates in one launch, alternating:
  sparta_cosched_off  nothing overlapped: the MoE layers' flat all-to-all, not chunked, and
                      the dense gradients all-reduced after backward
                      (``bucket_per_layer=False``: they fit one 25 MiB bucket), as
                      DeepSpeed-MoE does without ZeRO's overlap_comm
  sparta_flat_moe     the trainer's defaults with the MoE layers flat: the dense gradients'
                      buckets (one per layer) overlap backward, the exchanges do not
  sparta_cosched_on   the defaults and MoESpec(pipeline_degree="auto"): the trainer's
                      warm-up step tunes it (sparta/parallel/auto_schedule.py:
                      sparta.moe.tune_schedule on the first MoE layer with the inputs it saw:
                      profile, cost model, timed trials of its best plans, pipeline degrees,
                      flat or two-level all-to-all), the plan applied to every MoE layer
All train from the same initialisation on the same batches; the record gives each step's
loss for each (``losses_equal``: within 1e-5), the speed-up of on over off per step
(``speedup``), and its two parts: off over flat_moe (``speedup_buckets``, the gradients'
overlap) and flat_moe over on (``speedup_moe``, the exchanges' pipelining).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # sparta_tools and benchmarks/ live beside the package

from benchmarks.trainer_ranks import cluster_worker, emit, sparta_worker, torchtitan_worker  # noqa: E402
from sparta_tools.bench.torchtitan import torchtitan_missing  # noqa: E402
from sparta_tools.bench.trainer import (  # noqa: E402
    CANDIDATES,
    DEFAULT_CANDIDATES,
    LAYOUTS,
    LR,
    MAX_NORM,
    SIZES,
    TOL,
    LayoutSpec,
    ModelShape,
    plan_candidates,
)

# ----------------------------------------------------------------------------- co-scheduler on the emulated cluster


def run_cluster(args: argparse.Namespace) -> None:
    from sparta_tools.cluster import ClusterConfig, EmulatedCluster, can_emulate

    why = can_emulate()
    if why is not None:
        emit({"bench": "trainer_cluster", "candidate": "sparta_cosched_on", "skipped": why})
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
        emit({"bench": "trainer_cluster", "error": f"ranks exited with {codes}"})


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
        emit(record)
    if code != 0 or not records:
        error = {**context, "error": f"torchrun exited with {code}", "output_tail": out[-3000:]}
        emit(error)
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
        emit(record)


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
    emit(
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
                emit({**context, "candidate": candidate, "skipped": why})
            if "torchtitan" in run and missing is not None:
                emit({**context, "candidate": "torchtitan", "skipped": missing})
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
