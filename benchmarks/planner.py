"""The planner against the trainer: predicted vs measured step time for plans spread over
the ranking, and how the chosen plan compares with the median and the best measured.

    python benchmarks/planner.py                       # 8 ranks, both models, 6 plans each
    python benchmarks/planner.py --models moe --plans 3 --steps 4     # quicker
    python benchmarks/planner.py --models moe --plans 2 --also 'tp[248] ep[248]'   # + a kind

For each model (``dense``: the reference Decoder; ``moe``: the same with MoE MLPs, 8 experts
top-2, as the demo), on ``--world`` ranks of this machine (torchrun, gloo, one thread each):
1. ``sparta plan --measure`` on all the ranks at once (so their competition for the cores is
   in the costs);
2. the search, in this process, under ``--memory`` GiB per rank;
3. ``--plans`` plans evenly spaced over the ranking (the first is the planner's choice, the
   last its slowest), each trained by ``sparta train --plan`` for ``--steps`` steps; the
   measured step is the median of rank 0's ``step_s`` after the first two steps;
4. the chosen plan trained once more at the end: ``same_plan_spread`` is how far apart two
   launches of one plan came, the noise floor under every error.
Prints JSON lines: a ``planner_header``, one ``planner_plan`` per plan (predicted and
measured seconds, the error, predicted peak memory per pipeline rank and rank 0's measured
peak, with ``memory_error`` on CUDA), and one
``planner_summary`` per model (mean and max absolute error; the chosen plan's measured
speed over the median measured plan and against the best measured; targets: error <= 5 %,
chosen >= 1.2x the median and within 5 % of the best).

``--nodes 2 --rate 1gbit`` (root) runs every launch on an emulated cluster
(sparta_tools/cluster.py): the ranks as 2 nodes of network namespaces, loopback inside a
node, a 1 Gbit/s link between them; the costs are measured there too, every group shape
(size and stride) apart, so the planner sees which groups cross the link.

``--cluster`` adds clusters we do not have, from published figures (sparta/planner/hardware.py,
GEMMs at an assumed 75 % of peak): the best plan of a GPT MoE (Mixtral's shape: d 4096, 32
layers, 8 experts top-2, seq 4096, batch 1,024) on 8 to 1,024 H100s under 80 GiB
(``planner_cluster``), and Megatron-LM's 1T GPT on 3,072 A100s (tp8 pp64 dp6, 1F1B, batch
3,072, recomputation) against its published 163 TFLOP/s per GPU, 52 % of peak
(``planner_megatron``, with the error).

Memory is predicted as model state plus activations; on CPU the only peak a rank reports is
its resident set, which adds the interpreter and libraries (hundreds of MiB), so the memory
error is not judged there. ``--device cuda`` (one GPU per rank: ``--world 1`` on one GPU)
compares the prediction with `sparta train`'s CUDA allocator peak instead; ``--d-model`` and
``--seq-len`` size the models for a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

import sparta
from sparta.parallel import DecoderConfig, MoESpec, ParallelConfig, ParallelDims
from sparta.parallel.config_file import load_config
from sparta.planner import (
    GIB,
    HARDWARE,
    ModelCosts,
    Plan,
    Space,
    Workload,
    analytic_costs,
    model_flops_per_step,
    search,
    simulate,
    workload,
    write_plan,
)
from sparta_tools.cluster import ClusterConfig, EmulatedCluster

MODELS = {
    "dense": "",
    "moe": "[parallel.moe]\nnum_experts = 8\ntop_k = 2\n",
}
RUN = """
[model]
vocab_size = 2048
seq_len = {seq_len}
d_model = {d_model}
n_layers = 8
n_heads = 4
d_ff = {d_ff}
{moe}
[train]
device = "{device}"
steps = {steps}
global_batch = 16
lr = 1e-3
warmup_steps = 1
eval_every = 0
eval_batches = 1
[data]
source = "random"
random_tokens = 200000
"""


class Launcher:
    """Runs `sparta <args>` on ``world`` ranks: under torchrun on this machine's loopback, or,
    given ``cluster``, in its network namespaces (ranks of one node on loopback, nodes behind
    the shaped link)."""

    def __init__(self, world: int, timeout: float, cluster: EmulatedCluster | None) -> None:
        self.world, self.timeout, self.cluster = world, timeout, cluster

    def __call__(self, args: list[str]) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if self.cluster is not None:
            with tempfile.TemporaryFile("w+") as log:
                codes = self.cluster.run([sys.executable, "-m", "sparta.cli", *args], self.timeout, env, log)
                if any(codes):
                    log.seek(0)
                    raise RuntimeError(f"{' '.join(args)} exited with {codes}:\n{log.read()[-3000:]}")
            return
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={self.world}", "-m", "sparta.cli"]
        done = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=self.timeout)
        if done.returncode:
            # torchrun's own report fills the tail; the ranks' exceptions are what says why
            causes = sorted({line for line in done.stderr.splitlines() if "Error:" in line and "]: " in line})
            raise RuntimeError(
                f"{' '.join(args)} exited with {done.returncode}:\n{done.stdout[-2000:]}\n" + "\n".join(causes[:10])
            )


def _spread(n: int, k: int) -> list[int]:
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(min(k, n))})


def bench_model(name: str, a: argparse.Namespace, tmp: Path, launch: Launcher) -> None:
    run = tmp / f"{name}.toml"
    width = {"moe": MODELS[name], "steps": a.steps, "device": a.device, "seq_len": a.seq_len, "d_model": a.d_model}
    run.write_text(RUN.format(**width, d_ff=2 * a.d_model))
    config = load_config(run)
    costs_path = tmp / f"{name}.costs.json"
    began = time.perf_counter()
    launch(["plan", "--config", str(run), "--measure", str(costs_path)])
    measure_s = time.perf_counter() - began
    costs = ModelCosts.load(costs_path)
    work = workload(config)
    result = search(costs, work, a.world, a.memory * GIB, config.parallel)
    rows = []

    def train(index: int, tag: str) -> tuple[float, list[dict]]:
        plan_path = tmp / f"{name}.{index}.toml"
        write_plan(plan_path, result.fits[index], work, a.world, costs)
        metrics = tmp / f"{name}.{index}{tag}.jsonl"
        launch(["train", "--config", str(run), "--plan", str(plan_path), "--set", f"output.metrics={metrics}"])
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        return statistics.median(r["step_s"] for r in records[2:] or records), records

    # plus the best-ranked plan matching each --also pattern (a kind the spread may miss)
    picked = set(_spread(len(result.fits), a.plans))
    for pattern in a.also:
        found = [i for i, r in enumerate(result.fits) if re.search(pattern, r.plan.describe())]
        if found:
            picked.add(found[0])
        else:
            skipped = {"record": "skipped", "model": name, "also": pattern, "reason": "no plan that fits matches"}
            print(json.dumps(skipped), flush=True)
    for index in sorted(picked):
        ranked = result.fits[index]
        measured, records = train(index, "")
        predicted = ranked.prediction.step_s
        row = {
            "record": "planner_plan",
            "model": name,
            "rank_in_search": index + 1,
            "of": len(result.fits),
            "plan": ranked.plan.describe(),
            "predicted_s": round(predicted, 5),
            "measured_s": round(measured, 5),
            "error": round(predicted / measured - 1, 4),
            "predicted_peak_mib": {r: round(b / 2**20, 1) for r, b in ranked.prediction.peak_bytes.items()},
            "rank0_peak_mib": records[-1].get("peak_mem_mb"),
        }
        if a.device == "cuda":  # the allocator's peak, which the prediction models (see above)
            row["memory_error"] = round(ranked.prediction.peak_bytes[0] / 2**20 / row["rank0_peak_mib"] - 1, 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    times = [r["measured_s"] for r in rows]
    errors = [abs(r["error"]) for r in rows]
    chosen = rows[0]["measured_s"]
    # the chosen plan once more, last: how far one launch is from another of the same plan
    # (the floor under every error above)
    again, _ = train(0, ".again")
    summary = {
        "record": "planner_summary",
        "model": name,
        "world": a.world,
        "plans_measured": len(rows),
        "plans_searched": len(result.fits),
        "rejected": sum(result.rejected.values()),
        "measure_s": round(measure_s, 1),
        "chosen_measured_again_s": round(again, 5),
        "same_plan_spread": round(abs(again / chosen - 1), 4),
        "mean_abs_error": round(statistics.mean(errors), 4),
        "max_abs_error": round(max(errors), 4),
        "chosen_vs_median": round(statistics.median(times) / chosen, 3),
        "chosen_vs_best": round(min(times) / chosen, 3),
        "targets": {
            "error_within_5pct": max(errors) <= 0.05,
            "chosen_1.2x_median": statistics.median(times) / chosen >= 1.2,
            "chosen_within_5pct_of_best": min(times) / chosen >= 0.95,
        },
    }
    print(json.dumps(summary), flush=True)


def bench_cluster() -> None:
    """Predictions only: plans of a GPT MoE on H100 clusters, and Megatron-LM's 1T check."""
    mixtral = DecoderConfig(vocab_size=32000, seq_len=4096, d_model=4096, n_layers=32, n_heads=32, d_ff=14336)
    moe = MoESpec(num_experts=8, top_k=2)
    work = Workload(mixtral, moe, 1024)
    hw = HARDWARE["H100"]
    space = Space(schedules=("1F1B", "ZBVZeroBubble"), max_microbatches=64, max_tp=hw.devices_per_node)
    for world in (8, 64, 256, 1024):
        began = time.perf_counter()
        result = search(
            analytic_costs(hw, mixtral, moe, world), work, world, hw.memory_bytes, ParallelConfig(moe=moe), space
        )
        record: dict[str, object] = {
            "record": "planner_cluster",
            "hardware": hw.name,
            "world": world,
            "model": "GPT MoE 8x(4096, 14336) top-2, 32 layers, seq 4096, batch 1024",
        }
        if result.fits:
            best = result.fits[0]
            flops = model_flops_per_step(mixtral, moe, 1024)
            record.update(
                plan=best.plan.describe().split(" split@")[0],
                step_s=round(best.prediction.step_s, 3),
                mfu=round(flops / best.prediction.step_s / world / hw.peak_flops, 3),
                peak_gib=round(best.prediction.max_peak_bytes / GIB, 1),
                plans_fit=len(result.fits),
            )
        else:
            record["none_fit"] = result.no_fit_message()
        record["search_s"] = round(time.perf_counter() - began, 1)
        print(json.dumps(record), flush=True)
    # Megatron-LM (Narayanan et al., SC'21, Table 1): 1T GPT, 3,072 A100s, 163 TFLOP/s per GPU
    gpt = DecoderConfig(vocab_size=51200, seq_len=2048, d_model=25600, n_layers=128, n_heads=160, d_ff=102400)
    a100 = HARDWARE["A100"]
    stages = 64
    plan = Plan(
        ParallelDims(pp=stages, dp=6, tp=8),
        ParallelConfig(
            microbatches=512,
            split_points=tuple(f"layers.{i * 2}" for i in range(1, stages)),
            recompute=tuple(range(stages)),
        ),
    )
    pred = simulate(analytic_costs(a100, gpt, None, 3072), Workload(gpt, None, 3072), plan)
    b, s, layers, h, v = 3072, 2048, 128, 25600, 51200
    megatron_flops = 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))  # their formula
    predicted = megatron_flops / pred.step_s / 3072 / 1e12
    print(json.dumps({
        "record": "planner_megatron", "hardware": a100.name, "plan": "tp8 pp64 dp6 1F1B x512, recompute",
        "predicted_tflops_per_gpu": round(predicted, 1), "published_tflops_per_gpu": 163.0,
        "error": round(predicted / 163.0 - 1, 3), "predicted_step_s": round(pred.step_s, 2),
        "predicted_peak_gib": round(pred.max_peak_bytes / GIB, 1),
        "assumed_gemm_efficiency": a100.gemm_efficiency,
    }), flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--models", default="dense,moe")
    parser.add_argument("--plans", type=int, default=6, help="plans measured per model, spread over the ranking")
    parser.add_argument(
        "--also", action="append", default=[], metavar="REGEX",
        help="also measure the best-ranked plan whose description matches, e.g. 'tp[248] ep[248]' (repeatable)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--memory", type=float, default=4.0, help="GiB per rank")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank")
    parser.add_argument("--d-model", type=int, default=128, help="the models' width (d_ff is twice it)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--cluster", action="store_true", help="also predict H100/A100 clusters (see above)")
    parser.add_argument("--only-cluster", action="store_true", help="only the cluster predictions (no launches)")
    parser.add_argument("--nodes", type=int, default=1, help="> 1: an emulated cluster of this many nodes (root)")
    parser.add_argument("--rate", default="1gbit", help="with --nodes: each node's link rate, in tc's units")
    parser.add_argument("--keep", type=Path, help="keep the run files, costs, plans and metrics in this folder")
    a = parser.parse_args()
    if a.nodes < 1 or a.world % a.nodes:
        parser.error(f"--nodes {a.nodes} must be >= 1 and divide --world {a.world}")
    header = {
        "record": "planner_header",
        "sparta": sparta.__version__,
        "torch": torch.__version__,
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "world": a.world,
        "nodes": a.nodes,
        "device": torch.cuda.get_device_name() if a.device == "cuda" else None,
        "rate": a.rate if a.nodes > 1 else None,
        "command": " ".join(sys.argv),
    }
    print(json.dumps(header), flush=True)
    if a.cluster or a.only_cluster:
        bench_cluster()
    if a.only_cluster:
        return
    with ExitStack() as stack:
        if a.keep is not None:
            a.keep.mkdir(parents=True, exist_ok=True)
        tmp = str(a.keep) if a.keep is not None else stack.enter_context(tempfile.TemporaryDirectory())
        cluster = None
        if a.nodes > 1:
            # unpinned: all ranks share this machine's cores, as the costs (measured in the same
            # namespaces) assume; only the network between nodes differs from loopback
            config = ClusterConfig(nodes=a.nodes, ranks_per_node=a.world // a.nodes, rate=a.rate, pin_nodes=False)
            cluster = stack.enter_context(EmulatedCluster(config))
        for name in a.models.split(","):
            bench_model(name, a, Path(tmp), Launcher(a.world, a.timeout, cluster))


if __name__ == "__main__":
    main()
