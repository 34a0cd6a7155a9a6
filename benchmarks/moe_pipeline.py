"""Pipelined vs unpipelined expert-parallel exchange on an emulated 2-node cluster (needs root).

    python benchmarks/moe_pipeline.py --rates 300mbit,1gbit

For each rate: starts 2 emulated nodes x 2 ranks (sparta_tools.cluster), profiles the
links, the expert GEMMs and the dense layers, lets the cost model choose (r_fwd, r_bwd, flat
or hierarchical, or a number of micro-batches), then times forward+backward of a block:
dense projections (their gradients averaged over all ranks) around the MoE exchange
(routing by a fixed random gate, dispatch, experts, combine; 8 experts, top-2, d_model 512,
d_ff 1024, 4096 tokens per rank, expert parallel over all 4).

"auto" is what the co-scheduler settles on: the model's best chunked plans (dense gradients
cut by the cost model and sent in the backward's network gaps, or DDP's buckets), its two
best micro-batch counts (sparta.scheduling.overlapped_block: the dense layers of one micro-batch
compute while another's rows travel; DDP buckets, as the gradients are ready only at the
end) and flat r=1 run two untimed and two timed steps each; the fastest by agreed timings
wins, r=1 unless another beats it by 3%, and those timings calibrate the model
(cost_model.Calibration). Then, alternating: flat r=1 and hierarchical r=1 with DDP's
default 25 MiB buckets (what DeepSpeed-MoE does), the chunked plan (auto's, or the best
chunked one the tuner timed) with DDP buckets ("pipelined_ddp") and with partitioned
gradients ("pipelined_partition"), and the faster micro-batched plan ("microbatched"); plus the
lower bound max(communication, computation) from the measured parts (and "block_bound_s",
see below), and the model's step
times before ("predicted_raw_s") and after calibration ("predicted_s") against the timed
steps (slowest rank's median). Rank 0 prints one JSON line per rate. The router is left
out: it is the same in all.

Each emulated node's ranks run on their own share of this machine's CPUs (ClusterConfig
.pin_nodes). Here the transfers cost CPU too (gloo's threads, the kernel's TCP), taken from
the cores the experts compute on: "cpu_bound_s" counts that CPU ("exchange_cpu_s", times
the ranks sharing a core) on the compute side, a bound for this machine only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from types import FrameType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moe_pipeline_rank import FLAT1, Bench, Bounds, Plan  # noqa: E402

from sparta.scheduling.chunks import PipelineDegrees  # noqa: E402
from sparta.scheduling.cost_model import Calibration, CostModel  # noqa: E402
from sparta.scheduling.tuner import Choice, OnlineTuner  # noqa: E402
from sparta_tools.cluster import ClusterConfig, EmulatedCluster  # noqa: E402


def choice_json(c: Choice) -> dict[str, object]:
    d = c.degrees
    return {
        "r_fwd": d.forward,
        "r_bwd": d.backward,
        "taper": d.taper,
        "hier": c.hierarchical,
        "microbatches": c.microbatches,
    }


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    bench = Bench(args)
    tuner, micro_plans = bench.tune()
    auto = tuner.chosen
    assert auto is not None
    calibration = Calibration.fit([(*bench.parts(*c), t) for c, t in tuner.measured.items()])
    # the chunked pipeline to compare with: auto's if it is one, else the fastest the tuner timed
    chunked = [c for c, _ in sorted(tuner.measured.items(), key=lambda kv: kv[1]) if c[0].microbatches == 1]
    piped = auto[0] if auto[0].microbatches == 1 else chunked[0][0]
    micro = auto if auto[0].microbatches > 1 else min(micro_plans, key=lambda c: tuner.measured[c])
    configs = {
        "flat_r1": FLAT1,
        "hier_r1": (Choice(PipelineDegrees(1, 1), True), False),
        "pipelined_ddp": (piped, False),
        "pipelined_partition": (piped, True),
        "microbatched": micro,
    }
    times: dict[Plan, list[float]] = {c: [] for c in dict.fromkeys(configs.values())}
    for _ in range(args.repeats):
        for cfg, seen in times.items():
            seen.append(bench.step(*cfg))
    configs["auto"] = auto
    bounds = bench.bounds(auto)
    if args.trace:
        bench.trace(auto)
    comm = bench.world.comm
    # each configuration's median over this rank's steps, then the slowest rank's
    mine = torch.tensor([sorted(t)[len(t) // 2] for t in times.values()], dtype=torch.float64)
    slowest = dict(zip(times, torch.stack(comm.all_gather(mine)).max(0).values.tolist(), strict=True))  # type: ignore[arg-type]
    # every timed step's slowest rank, to show the step-to-step noise the medians sit in
    per_step = torch.tensor(list(times.values()), dtype=torch.float64)
    steps = dict(zip(times, torch.stack(comm.all_gather(per_step)).max(0).values.tolist(), strict=True))  # type: ignore[arg-type]
    if bench.world.rank == 0:
        med = {name: slowest[cfg] for name, cfg in configs.items()}
        each = {name: steps[cfg] for name, cfg in configs.items()}
        print(json.dumps(record(bench, tuner, calibration, configs, med, each, bounds)), flush=True)
    bench.world.shutdown()


def record(
    bench: Bench,
    tuner: OnlineTuner,
    calibration: Calibration,
    configs: dict[str, Plan],
    med: dict[str, float],
    each: dict[str, list[float]],
    b: Bounds,
) -> dict[str, object]:
    """Rank 0's JSON line: each configuration's step (the slowest rank's median, and every
    step), the choices, the model's predictions before and after calibration, the bounds."""
    comm_s, compute_s = b.exchange_s + b.all_reduce_s, b.experts_s + b.dense_compute_s
    lower = max(comm_s, compute_s)
    # Where the block's dense layers run whole before and after the exchange (all but
    # micro-batched plans: only their all-reduce can overlap it), no schedule beats dense
    # compute + max(exchange, experts' compute) either: the larger of the two bounds.
    block_bound = max(lower, b.dense_compute_s + max(b.exchange_s, b.experts_s))
    # ranks time-slicing one core (a node's ranks on its pinned CPUs): each's exchange CPU
    # stretches the others' compute by as much; counted on the compute side (this machine only)
    sharing = max(1, -(-bench.args.ranks_per_node // len(os.sched_getaffinity(0))))
    cpu_bound = max(block_bound, b.dense_compute_s + b.experts_s + sharing * b.exchange_cpu_s)
    raw = {name: bench.parts(*cfg)[0] for name, cfg in configs.items()}
    cal = {name: calibration(*bench.parts(*cfg)) for name, cfg in configs.items()}
    part = bench.partition_of(configs["pipelined_ddp"][0])[0]
    calibrated_plan = CostModel(bench.profile, calibration).plan(bench.shape, max_degree=8)
    return {
        "rate": bench.args.rate,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "step_s": {k: round(v, 3) for k, v in med.items()},
        "steps_s": {k: [round(t, 3) for t in v] for k, v in each.items()},
        "model_choice": choice_json(bench.plan.choice),
        "calibrated_model_choice": choice_json(calibrated_plan.choice),
        "auto_choice": {**choice_json(configs["auto"][0]), "partition": configs["auto"][1]},
        "tuner_s": {f"{choice_json(c[0])}/{'part' if c[1] else 'ddp'}": round(t, 3) for c, t in tuner.measured.items()},
        "calibration": {
            "scale": round(calibration.scale, 3),
            "efficiency": round(calibration.efficiency, 3),
            "rel_error": round(calibration.rel_error, 3),
        },
        "predicted_raw_s": {k: round(v, 3) for k, v in raw.items()},
        "predicted_s": {k: round(v, 3) for k, v in cal.items()},
        "prediction_error_raw": {k: round(raw[k] / med[k] - 1, 3) for k in configs},
        "prediction_error": {k: round(cal[k] / med[k] - 1, 3) for k in configs},
        "microbatch_predicted_s": {
            f"{m}{'h' if h else ''}": round(bench.parts(Choice(PipelineDegrees(1, 1), h, m), False)[0], 3)
            for h in (False, True)
            for m in range(2, 9)
        },
        "partition": {"dense_bytes": bench.dense_bytes, "pieces": list(part.pieces), "gaps": list(part.gaps)},
        "lower_bound_s": round(lower, 3),
        "comm_s": {"exchange": round(b.exchange_s, 3), "all_reduce": round(b.all_reduce_s, 3)},
        "compute_s": {"experts": round(b.experts_s, 3), "dense": round(b.dense_compute_s, 3)},
        "block_bound_s": round(block_bound, 3),
        "auto_over_block_bound": round(med["auto"] / block_bound, 3),
        "exchange_cpu_s": round(b.exchange_cpu_s, 3),
        "cpu_bound_s": round(cpu_bound, 3),
        "auto_over_cpu_bound": round(med["auto"] / cpu_bound, 3),
        "speedup_vs_flat_r1": round(med["flat_r1"] / med["auto"], 3),
        "partition_vs_ddp": round(med["pipelined_ddp"] / med["pipelined_partition"], 3),
        "microbatched_vs_pipelined": round(
            min(med["pipelined_ddp"], med["pipelined_partition"]) / med["microbatched"], 3
        ),
        "auto_over_bound": round(med["auto"] / lower, 3),
        "fits": {
            k: {"alpha_ms": round(f.alpha * 1e3, 3), "beta": f.beta, "rel_error": round(f.rel_error, 3)}
            for k, f in bench.profile.fits.items()
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="100mbit,300mbit,1gbit", help="inter-node rates, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per configuration")
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--trace", default="", help="write a Chrome trace of one auto step; RATE is replaced by the rate")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rate", default="", help=argparse.SUPPRESS)
    ap.add_argument("--ranks-per-node", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds through the `with`, which tears the cluster down

    signal.signal(signal.SIGTERM, on_term)
    failed = 0
    for rate in args.rates.split(","):
        config = ClusterConfig(nodes=2, ranks_per_node=2, rate=rate)
        cmd = [sys.executable, __file__, "--worker", f"--rate={rate}", f"--repeats={args.repeats}"]
        if args.trace:
            cmd.append(f"--trace={Path(args.trace).resolve()}")
        with EmulatedCluster(config) as cluster:
            codes = cluster.run(cmd, timeout_s=args.timeout)
        failed += any(codes)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
