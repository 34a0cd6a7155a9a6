"""Benchmark one MoE layer (forward + backward) on one process; prints one JSON line each.

Candidates, all fed the same input and sharing router / expert weights:
  dense            floor: one MLP (d_model -> d_ff -> d_model) on T * top_k tokens, no routing
  naive            top-k routing, then a loop over experts with boolean masks
  deepspeed        deepspeed.moe.layer.MoE, if ``import deepspeed`` works
  sparta_dropless  MoELayer(capacity_factor=None), expert_gemm=auto (on CPU: the expert loop)
  sparta_grouped_mm  MoELayer(capacity_factor=None), expert_gemm=grouped_mm (torch._grouped_mm)
  sparta_cap1.25   MoELayer(capacity_factor=1.25)

Times: each repeat runs every candidate once, in a rotated order, so that machine noise
hits all of them alike; the median (and the minimum) over repeats is reported with its
ratio to ``dense``, both as wall-clock time and as process CPU time (user + system). With
one thread the CPU time is the step's own work and moves much less than wall time when
other processes share the cores (their cache pressure still shows); the wall time is what a
user waits for on an idle machine.

Memory (``--memory``): each candidate runs one forward + backward in a fresh subprocess;
``peak_rss_mib`` is that process's peak resident set (``ru_maxrss``) and
``step_rss_mib`` that peak minus the resident set just before the step, i.e. what the
step (activations, parameter gradients, workspace) added on top of weights and input;
the MoE candidates' parameter gradients are num_experts times the dense MLP's. It is
process-level memory as the OS sees it (allocator caching included), not a tensor count.

  python benchmarks/moe_layer.py [--threads 1] [--repeats 7] [--config small|large|all] [--memory]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from sparta.moe import MoELayer


@dataclass(frozen=True)
class BenchConfig:
    name: str
    tokens: int
    d_model: int
    d_ff: int
    num_experts: int
    top_k: int = 2


CONFIGS = {
    "small": BenchConfig("small", tokens=4096, d_model=512, d_ff=1024, num_experts=8),
    "large": BenchConfig("large", tokens=8192, d_model=1024, d_ff=2048, num_experts=16),
}
CANDIDATES = ("dense", "naive", "deepspeed", "sparta_dropless", "sparta_grouped_mm", "sparta_cap1.25")

Step = Callable[[], None]


def _sparta(cfg: BenchConfig, x: Tensor, capacity_factor: float | None, gemm: str) -> Step:
    torch.manual_seed(0)
    layer = MoELayer(
        cfg.d_model,
        cfg.d_ff,
        cfg.num_experts,
        top_k=cfg.top_k,
        capacity_factor=capacity_factor,
        expert_gemm=gemm,
    )
    grad = torch.randn_like(x)

    def step() -> None:
        layer(x).backward(grad)

    return step


def _dense(cfg: BenchConfig, x: Tensor) -> Step:
    torch.manual_seed(0)
    w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
    w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
    rows = x.detach().repeat(cfg.top_k, 1).requires_grad_()
    grad = torch.randn_like(rows)

    def step() -> None:
        w2(nn.functional.gelu(w1(rows))).backward(grad)

    return step


def _naive(cfg: BenchConfig, x: Tensor) -> Step:
    torch.manual_seed(0)
    layer = MoELayer(cfg.d_model, cfg.d_ff, cfg.num_experts, top_k=cfg.top_k)
    gate, experts = layer.router.gate.weight, layer.experts
    grad = torch.randn_like(x)

    def step() -> None:
        # Per-expert weight tensors, as an nn.ModuleList of experts would have.
        w1, w2 = experts.w1.unbind(0), experts.w2.unbind(0)
        probs = torch.softmax(x @ gate.t(), dim=-1)
        top, ids = torch.topk(probs, cfg.top_k, dim=-1)
        weights = top / top.sum(dim=-1, keepdim=True)
        y = torch.zeros_like(x)
        for e in range(cfg.num_experts):
            chosen = ids == e
            rows = chosen.any(dim=-1)
            w = (weights * chosen).sum(dim=-1)[rows].unsqueeze(1)
            h = nn.functional.gelu(x[rows] @ w1[e]) @ w2[e]
            y = y.index_put((rows,), w * h, accumulate=True)
        y.backward(grad)

    return step


def _deepspeed(cfg: BenchConfig, x: Tensor) -> Step | str:
    try:
        import deepspeed  # noqa: F401
    except ImportError as err:
        return f"not installed ({err})"
    return "installed, but its MoE needs an initialised deepspeed.comm group: not wired up"


def build(name: str, cfg: BenchConfig, x: Tensor) -> Step | str:
    """The candidate's forward+backward step, or why it cannot run."""
    if name == "dense":
        return _dense(cfg, x)
    if name == "naive":
        return _naive(cfg, x)
    if name == "deepspeed":
        return _deepspeed(cfg, x)
    if name == "sparta_dropless":
        return _sparta(cfg, x, None, "auto")
    if name == "sparta_grouped_mm":
        return _sparta(cfg, x, None, "grouped_mm")
    return _sparta(cfg, x, 1.25, "auto")


def _input(cfg: BenchConfig) -> Tensor:
    torch.manual_seed(1)
    return torch.randn(cfg.tokens, cfg.d_model, requires_grad=True)


def time_candidates(cfg: BenchConfig, candidates: list[str], repeats: int, threads: int) -> None:
    x = _input(cfg)
    steps: dict[str, Step] = {}
    for name in candidates:
        step = build(name, cfg, x)
        if isinstance(step, str):
            print(json.dumps({"bench": "moe_layer", "config": cfg.name, "candidate": name, "skipped": step}))
            continue
        step()  # warm-up: first-touch allocations and lazy init stay out of the timings
        steps[name] = step
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            x.grad = None
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            steps[name]()
            cpu[name].append(time.process_time() - start_cpu)
            wall[name].append(time.perf_counter() - start_wall)
    for name in names:
        record = {
            "bench": "moe_layer",
            "config": cfg.name,
            "candidate": name,
            "median_s": round(statistics.median(wall[name]), 5),
            "min_s": round(min(wall[name]), 5),
            "median_cpu_s": round(statistics.median(cpu[name]), 5),
            "min_cpu_s": round(min(cpu[name]), 5),
            "ratio_to_dense": round(statistics.median(wall[name]) / statistics.median(wall["dense"]), 4),
            "cpu_ratio_to_dense": round(statistics.median(cpu[name]) / statistics.median(cpu["dense"]), 4),
            "min_cpu_ratio_to_dense": round(min(cpu[name]) / min(cpu["dense"]), 4),
            "repeats": repeats,
            "threads": threads,
            **asdict(cfg),
        }
        print(json.dumps(record), flush=True)


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def measure_peak(name: str, cfg: BenchConfig) -> None:
    """Child process: one step of one candidate, print its memory as JSON."""
    x = _input(cfg)
    step = build(name, cfg, x)
    if isinstance(step, str):
        print(json.dumps({"skipped": step}))
        return
    before = _rss_mib()
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_rss_mib": round(peak, 1), "step_rss_mib": round(peak - before, 1)}))


def memory_candidates(cfg: BenchConfig, candidates: list[str], threads: int) -> None:
    for name in candidates:
        cmd = [sys.executable, __file__, "--config", cfg.name, "--threads", str(threads), "--_child", name]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        record = {"bench": "moe_layer_memory", "config": cfg.name, "candidate": name, **json.loads(out)}
        print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per candidate (0: memory only)")
    parser.add_argument("--config", choices=[*CONFIGS, "all"], default="all")
    parser.add_argument("--memory", action="store_true", help="also measure peak RSS per candidate")
    parser.add_argument(
        "--candidates", default=",".join(CANDIDATES), help="comma-separated subset (dense is always timed)"
    )
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = list(CONFIGS.values()) if args.config == "all" else [CONFIGS[args.config]]
    if args._child:
        measure_peak(args._child, configs[0])
        return
    candidates = ["dense", *(c for c in args.candidates.split(",") if c in CANDIDATES and c != "dense")]
    for cfg in configs:
        if args.repeats > 0:
            time_candidates(cfg, candidates, args.repeats, args.threads)
        if args.memory:
            memory_candidates(cfg, candidates, args.threads)


if __name__ == "__main__":
    main()
