"""Benchmark one MoE layer (forward + backward); prints one JSON line per point.

Candidates (built in moe_candidates.py), all fed the same input and sharing router / expert
weights:
  dense              floor: one MLP (d_model -> d_ff -> d_model) on T * top_k tokens, no routing
  naive              top-k routing, then a loop over experts with boolean masks
  deepspeed_dropless deepspeed.moe.layer.MoE(drop_tokens=False), if ``import deepspeed`` works
  deepspeed_cap1.25  deepspeed.moe.layer.MoE(capacity_factor=1.25)
  sparta_dropless    MoELayer(capacity_factor=None)
  sparta_cap1.25     MoELayer(capacity_factor=1.25)
  sparta_pipelined   dropless, degrees from sparta.moe.tune_schedule (expert parallel only; tuned untimed)

Times: each repeat runs every candidate once, in a rotated order, so that machine noise
hits all of them alike; the median (and the minimum) over repeats is reported with its
ratio to ``dense``, both as wall-clock time and as process CPU time (user + system). With
one thread the CPU time is the step's own work and moves much less than wall time when
other processes share the cores (their cache pressure still shows); the wall time is what a
user waits for on an idle machine.

Gradients: each step drops its input's gradient first. Parameter gradients carry over from
step to step, as over the micro-batches of gradient accumulation, so backward adds to
them; ``--zero-grad`` drops them too before each step, as ``optimizer.zero_grad()`` does.

Expert parallelism (``--ranks 2,4``): the script launches itself under torchrun on that
many ranks (gloo, one thread each; ``--bind core`` pins rank i to core i mod cores, as
``mpirun --bind-to core`` would), or under mpirun with ``--engine mpi`` (Sparta then
exchanges rows over MPI, whose shared-memory transport copies once where gloo goes through
loopback TCP; DeepSpeed and the timing barriers stay on torch.distributed's gloo). The T
tokens are split over the ranks (T / ranks each,
the one-process input cut in slices); the MoE candidates shard their experts over all ranks
(``ep_size = ranks``); ``dense`` is the per-rank floor, an MLP on T / ranks * top_k rows
with no communication. Every step starts with a barrier; a step's wall time is the
slowest rank's, its CPU time the mean over ranks (time blocked in a collective is wall
time, not CPU time). ``--ranks 1`` (the default) is the one-process run; ``--ranks 1,2,4``
does both.

Memory (``--memory``, one process): each candidate runs one forward + backward in a fresh
subprocess; ``peak_rss_mib`` is that process's peak resident set (VmHWM) and
``step_rss_mib`` that peak minus the resident set just before the step, i.e. what the
step (activations, parameter gradients, workspace) added on top of weights and input;
the MoE candidates' parameter gradients are num_experts times the dense MLP's. It is
process-level memory as the OS sees it (allocator caching included), not a tensor count.
``step_ratio_to_dense`` compares the step's own memory; ``peak_ratio_to_dense`` also counts
the interpreter and libraries (DeepSpeed's import alone adds some hundred MiB).

Device and dtype (``--device cuda``, ``--dtype bfloat16``): inputs and every candidate's
weights go there, made on CPU first (the same values on every device), and each CUDA step
ends with a synchronize, so its wall time is the device's; its CPU time is then only the
host's share. Sparta routes in float32 whatever the dtype, as its routers do. On CUDA one
process runs (one GPU), DeepSpeed skips, and ``--memory`` reports the caching allocator's
peak of allocated bytes (``peak_cuda_mib``, ``step_cuda_mib``) instead of the resident set.

DeepSpeed runs on CPU: its MoE needs deepspeed.comm initialised, so this script (not the
library) starts a torch.distributed world over gloo -- a world of one with an in-process
store on one process, torchrun's world otherwise -- and hands it to
``deepspeed.init_distributed``. Its top-2 gate samples the second expert with Gumbel noise
by default; that is turned off (``top2_2nd_expert_sampling=False``) so that it routes
exactly as Sparta's top-k router does on the shared gate weights.

  python benchmarks/moe_layer.py [--threads 1] [--repeats 7] [--config small|large|all] [--memory]
                                 [--ranks 1,2,4] [--candidates dense,sparta_dropless,...] [--zero-grad]
                                 [--device cpu|cuda] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from moe_candidates import (
    CANDIDATES,
    CONFIGS,
    DTYPES,
    GPU_CONFIGS,
    TOLERANCE,
    UNCHECKED,
    BenchConfig,
    Place,
    Step,
    all_configs,
    build,
    busiest_rank_load,
    make_input,
    reference_output,
    wrong_values,
)
from moe_layer_launch import emit, launch_ranks, memory_candidates

if TYPE_CHECKING:
    from sparta.comm import Communicator


def _timings(
    steps: dict[str, Step], repeats: int, comm: Communicator | None
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(wall, cpu) seconds per candidate per repeat; across ranks the wall time is the
    slowest rank's and the CPU time the mean."""
    names = list(steps)
    wall = torch.zeros(len(names), repeats, dtype=torch.float64)
    cpu = torch.zeros_like(wall)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if comm is not None:
                dist.barrier()  # ranks start together: a step is not charged for a late peer
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            steps[name]()
            cpu[names.index(name), r] = time.process_time() - start_cpu
            wall[names.index(name), r] = time.perf_counter() - start_wall
    if comm is not None:
        # torch.distributed directly: Sparta's all-reduce has no max (nor needs one).
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
        cpu /= comm.size
    return (
        {name: wall[i].tolist() for i, name in enumerate(names)},
        {name: cpu[i].tolist() for i, name in enumerate(names)},
    )


def profile_steps(steps: dict[str, Step], rows: int, device: str) -> None:
    """torch.profiler over three steps of each candidate: its top ``rows`` operators by self
    time on ``device`` (CUDA kernels' time on a GPU), printed to stderr."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device == "cuda" else [])]
    # on a GPU also by host time: a step that launches more than the device runs is host-bound
    keys = ["self_cuda_time_total", "self_cpu_time_total"] if device == "cuda" else ["self_cpu_time_total"]
    for name, step in steps.items():
        with profile(activities=activities) as prof:
            for _ in range(3):
                step()
        for key in keys:
            print(f"# profile of {name}, 3 steps, by {key}", file=sys.stderr)
            print(prof.key_averages().table(sort_by=key, row_limit=rows), file=sys.stderr, flush=True)


def _wrong(
    cfg: BenchConfig, steps: dict[str, Step], rank: int, ranks: int, comm: Communicator | None
) -> dict[str, int]:
    """Each checked candidate's output values off the one-process dropless layer's, summed
    over the ranks (each checks its own tokens), before any timing."""
    reference = reference_output(cfg, rank, ranks)
    atol, rtol = TOLERANCE[cfg.dtype]
    names = [n for n in steps if n not in UNCHECKED]
    counts = torch.zeros(len(names), dtype=torch.int64)
    for i, name in enumerate(names):
        with torch.no_grad():
            counts[i] = wrong_values(steps[name].forward().detach().cpu(), reference.cpu(), atol, rtol)
    if comm is not None:
        dist.all_reduce(counts)
    return dict(zip(names, counts.tolist(), strict=True))


def time_candidates(
    cfg: BenchConfig,
    candidates: list[str],
    repeats: int,
    threads: int,
    comm: Communicator | None = None,
    profile_rows: int = 0,
) -> int:
    """Time ``candidates`` on ``cfg`` and print a record each (rank 0); returns how many
    output values the checked ones got wrong (0: all right), the same on every rank."""
    place = Place(comm)
    rank = 0 if comm is None else comm.rank
    bench = "moe_layer" if comm is None else "moe_layer_ep"
    x = make_input(cfg, rank, place.ranks)
    steps: dict[str, Step] = {}
    for name in candidates:
        step = build(name, cfg, x, place)
        if isinstance(step, str):
            if rank == 0:
                emit({"bench": bench, "config": cfg.name, "ranks": place.ranks, "candidate": name, "skipped": step})
            continue
        step()  # warm-up: first-touch allocations and lazy init stay out of the timings
        steps[name] = step
    wrong = _wrong(cfg, steps, rank, place.ranks, comm)
    wall, cpu = _timings(steps, repeats, comm)
    if profile_rows:
        profile_steps(steps, profile_rows, cfg.device)
    if rank != 0:
        return sum(wrong.values())
    load = {"busiest_rank_load": round(busiest_rank_load(cfg, place.ranks), 4)} if place.ranks > 1 else {}
    for name in steps:
        emit(
            {
                "bench": bench,
                "config": cfg.name,
                "ranks": place.ranks,
                "engine": None if comm is None else comm.backend,
                "candidate": name,
                "median_s": round(statistics.median(wall[name]), 5),
                "min_s": round(min(wall[name]), 5),
                "median_cpu_s": round(statistics.median(cpu[name]), 5),
                "min_cpu_s": round(min(cpu[name]), 5),
                "ratio_to_dense": round(statistics.median(wall[name]) / statistics.median(wall["dense"]), 4),
                "min_ratio_to_dense": round(min(wall[name]) / min(wall["dense"]), 4),
                "cpu_ratio_to_dense": round(statistics.median(cpu[name]) / statistics.median(cpu["dense"]), 4),
                "min_cpu_ratio_to_dense": round(min(cpu[name]) / min(cpu["dense"]), 4),
                "wrong": wrong.get(name),
                **({"unchecked": UNCHECKED[name]} if name in UNCHECKED else {}),
                "repeats": repeats,
                "threads": threads,
                **asdict(cfg),
                "tokens_per_rank": cfg.tokens // place.ranks,
                **load,
            }
        )
    return sum(wrong.values())


def _status_mib(field: str) -> float:
    """``VmRSS`` / ``VmHWM`` of this process from /proc/self/status, in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_peak(name: str, cfg: BenchConfig) -> None:
    """Child process: one step of one candidate, print its memory as JSON.

    On CPU the peak is VmHWM, this address space's own high-water mark, not ``ru_maxrss``:
    Linux carries ``ru_maxrss`` over fork and exec, so a child of a parent that had just run
    the large timings would report the parent's resident set. On CUDA it is the caching
    allocator's peak of allocated bytes (``torch.cuda.max_memory_allocated``)."""
    x = make_input(cfg)
    step = build(name, cfg, x)
    if isinstance(step, str):
        emit({"skipped": step})
        return
    if cfg.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
        step()
        peak = torch.cuda.max_memory_allocated() / 2**20
        emit({"peak_cuda_mib": round(peak, 1), "step_cuda_mib": round(peak - before, 1)})
        return
    before = _status_mib("VmRSS")
    step()
    peak = _status_mib("VmHWM")
    emit({"peak_rss_mib": round(peak, 1), "step_rss_mib": round(peak - before, 1)})


def ep_worker(cfg: BenchConfig, candidates: list[str], repeats: int, engine: str, port: int, bind: bool) -> None:
    """One rank of a torchrun or mpirun launch: time the expert-parallel candidates. Sparta
    communicates over ``engine``; the timing barriers and DeepSpeed use torch.distributed
    (gloo), which under mpirun is started beside MPI."""
    import sparta

    torch.set_num_threads(1)
    if bind:
        # one core per rank, round-robin, as `mpirun --bind-to core` binds: unbound, the
        # scheduler moves ranks between cores and two can share one while another idles,
        # and every collective waits for the rank it starved
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[local % len(cpus)]})
    world = sparta.init(backend=engine)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank, world_size=world.size)
    if cfg.num_experts % world.size or cfg.tokens % world.size:
        raise SystemExit(f"{cfg.name}: {world.size} ranks must divide {cfg.num_experts} experts and {cfg.tokens} rows")
    wrong = time_candidates(cfg, candidates, repeats, threads=1, comm=world.comm)
    world.exit(1 if wrong else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (one process)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per candidate (0: memory only)")
    parser.add_argument("--config", choices=[*CONFIGS, *GPU_CONFIGS, "all"], default="all")
    parser.add_argument("--memory", action="store_true", help="also measure peak RSS per candidate (one process)")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="ROWS", help="print each candidate's top operators (one process)"
    )
    parser.add_argument("--ranks", default="1", help="comma-separated process counts; 1 is the one-process run")
    parser.add_argument(
        "--candidates", default=",".join(CANDIDATES), help="comma-separated subset (dense is always timed)"
    )
    parser.add_argument(
        "--engine", choices=["torch", "mpi"], default="torch", help="Sparta's engine with --ranks > 1 (torchrun/mpirun)"
    )
    parser.add_argument(
        "--bind", choices=["core", "none"], default="none", help="core: pin each rank to one core (--ranks > 1)"
    )
    parser.add_argument(
        "--zero-grad", action="store_true", help="drop parameter gradients before each step (optimizer.zero_grad())"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one process (--ranks 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="inputs' and weights' dtype")
    parser.add_argument("--_port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_ep_worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    configs = all_configs(args.device) if args.config == "all" else [{**CONFIGS, **GPU_CONFIGS}[args.config]]
    configs = [replace(cfg, zero_grad=args.zero_grad, device=args.device, dtype=args.dtype) for cfg in configs]
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if args.device == "cuda" and args.ranks != "1":
        parser.error("--device cuda times one process (--ranks 1): expert parallelism here runs ranks on CPU")
    unknown = [c for c in args.candidates.split(",") if c not in CANDIDATES]
    if unknown:
        parser.error(f"unknown candidates {unknown}; known: {', '.join(CANDIDATES)}")
    candidates = ["dense", *(c for c in args.candidates.split(",") if c != "dense")]
    if args._ep_worker:
        ep_worker(configs[0], candidates, args.repeats, args.engine, args._port, args.bind == "core")
        return
    torch.set_num_threads(args.threads)
    if args._child:
        measure_peak(args._child, configs[0])
        return
    wrong = failed = 0
    for ranks in (int(r) for r in args.ranks.split(",")):
        if ranks > 1:
            failed += launch_ranks(ranks, args, configs, candidates)
            continue
        for cfg in configs:
            if args.repeats > 0:
                wrong += time_candidates(cfg, candidates, args.repeats, args.threads, profile_rows=args.profile)
            if args.memory:
                memory_candidates(cfg, candidates, args.threads)
    if wrong or failed:
        sys.exit(f"{wrong} output values off the one-process reference, {failed} launches failed: see the records")


if __name__ == "__main__":
    main()
