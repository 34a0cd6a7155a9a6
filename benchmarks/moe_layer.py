"""Benchmark one MoE layer (forward + backward); prints one JSON line per point.

Candidates, all fed the same input and sharing router / expert weights:
  dense              floor: one MLP (d_model -> d_ff -> d_model) on T * top_k tokens, no routing
  naive              top-k routing, then a loop over experts with boolean masks
  deepspeed_dropless deepspeed.moe.layer.MoE(drop_tokens=False), if ``import deepspeed`` works
  deepspeed_cap1.25  deepspeed.moe.layer.MoE(capacity_factor=1.25)
  sparta_dropless    MoELayer(capacity_factor=None), expert_gemm=auto (on CPU: the expert loop)
  sparta_grouped_mm  MoELayer(capacity_factor=None), expert_gemm=grouped_mm (torch._grouped_mm)
  sparta_cap1.25     MoELayer(capacity_factor=1.25)
  sparta_tcp         dropless on the torch engine with CommConfig(shared_memory="off"): rows through
                     gloo's loopback TCP instead of /dev/shm (expert parallel, --engine torch only)
  sparta_pipelined   dropless, pipeline_degree="auto" (expert parallel only; planned untimed)

Times: each repeat runs every candidate once, in a rotated order, so that machine noise
hits all of them alike; the median (and the minimum) over repeats is reported with its
ratio to ``dense``, both as wall-clock time and as process CPU time (user + system). With
one thread the CPU time is the step's own work and moves much less than wall time when
other processes share the cores (their cache pressure still shows); the wall time is what a
user waits for on an idle machine.

Gradients: each step drops its input's gradient first. Parameter gradients carry over from
step to step, as over the micro-batches of gradient accumulation, so backward adds into
them (autograd for the floor, in place for Sparta's expert weights); ``--zero-grad`` drops
them too before each step, as ``optimizer.zero_grad()`` does, and backward allocates them
afresh.

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
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
from baseline_deepspeed import deepspeed_step
from torch import Tensor, nn

from sparta.comm import CommConfig
from sparta.errors import InputError
from sparta.moe import MoELayer

if TYPE_CHECKING:
    from sparta.comm import Communicator

T = TypeVar("T", Tensor, nn.Module)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class BenchConfig:
    name: str
    tokens: int
    d_model: int
    d_ff: int
    num_experts: int
    top_k: int = 2
    zero_grad: bool = False  # drop parameter gradients before each step (--zero-grad)
    device: str = "cpu"  # where inputs, weights and steps live (--device)
    dtype: str = "float32"  # inputs' and weights' dtype (--dtype); routing stays float32 in Sparta

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: known {sorted(DTYPES)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r}: cpu or cuda")

    def place(self, module_or_tensor: T) -> T:
        """``module_or_tensor`` on this config's device in its dtype. Made on CPU first, so
        that every device starts from the same values."""
        return module_or_tensor.to(device=self.device, dtype=DTYPES[self.dtype])


CONFIGS = {
    "small": BenchConfig("small", tokens=4096, d_model=512, d_ff=1024, num_experts=8),
    "large": BenchConfig("large", tokens=8192, d_model=1024, d_ff=2048, num_experts=16),
}
CANDIDATES = (
    "dense",
    "naive",
    "deepspeed_dropless",
    "deepspeed_cap1.25",
    "sparta_dropless",
    "sparta_grouped_mm",
    "sparta_cap1.25",
    "sparta_tcp",
    "sparta_pipelined",
)
# Under expert parallelism the naive loop has no meaning (it holds every expert).
EP_CANDIDATES = (
    "dense",
    "deepspeed_dropless",
    "deepspeed_cap1.25",
    "sparta_dropless",
    "sparta_cap1.25",
    "sparta_tcp",
    "sparta_pipelined",
)
AUX_LOSS_COEF = 1e-2  # Sparta's default; DeepSpeed's l_aux gets the same weight in backward

Step = Callable[[], None]


@dataclass(frozen=True)
class Place:
    """Where a candidate runs: the expert-parallel communicator (None on one process)."""

    comm: Communicator | None = None
    tcp_comm: Communicator | None = None  # the same ranks without shared memory (sparta_tcp)

    @property
    def ranks(self) -> int:
        return 1 if self.comm is None else self.comm.size


def _timed(run: Callable[[], None], cfg: BenchConfig, leaf: Tensor, params: Iterable[Tensor]) -> Step:
    """``run`` as a timed step that first drops the gradient of its input ``leaf`` (each
    step's is its own) and, with ``cfg.zero_grad``, its parameters' gradients, as
    ``optimizer.zero_grad()`` does: backward then writes them afresh instead of adding
    into the previous step's, as it does in gradient accumulation. On CUDA the step ends
    when its kernels have, so that a wall clock around it times the device's work."""
    dropped = [leaf, *params] if cfg.zero_grad else [leaf]

    def step() -> None:
        for t in dropped:
            t.grad = None
        run()
        if leaf.is_cuda:
            torch.cuda.synchronize(leaf.device)

    return step


def _sparta_layer(
    cfg: BenchConfig, place: Place, capacity_factor: float | None, gemm: str = "auto", pipeline: int | str = 1
) -> MoELayer:
    # Same seed on every rank and for every candidate: the experts of global id e get the
    # same weights whatever the expert-parallel size, and the router is the same gate.
    torch.manual_seed(0)
    layer = MoELayer(
        cfg.d_model,
        cfg.d_ff,
        cfg.num_experts,
        top_k=cfg.top_k,
        capacity_factor=capacity_factor,
        ep_size=place.ranks,
        comm=place.comm,
        aux_loss_coef=AUX_LOSS_COEF,
        expert_gemm=gemm,
        pipeline_degree=pipeline,
    )
    return cfg.place(layer)


def _sparta(
    cfg: BenchConfig, x: Tensor, place: Place, capacity_factor: float | None, gemm: str, pipeline: int | str = 1
) -> Step | str:
    layer = _sparta_layer(cfg, place, capacity_factor, gemm, pipeline)
    try:
        layer.experts.uses_grouped_mm(x)  # raises where a forced expert_gemm cannot take x
    except InputError as err:
        return str(err)
    grad = torch.randn_like(x)
    step = _timed(lambda: layer(x).backward(grad), cfg, x, layer.parameters())
    if pipeline == "auto":
        step()  # the first forward profiles and plans; time the steps after it
    return step


def _dense(cfg: BenchConfig, x: Tensor) -> Step:
    torch.manual_seed(0)
    w1 = cfg.place(nn.Linear(cfg.d_model, cfg.d_ff, bias=False))
    w2 = cfg.place(nn.Linear(cfg.d_ff, cfg.d_model, bias=False))
    rows = x.detach().repeat(cfg.top_k, 1).requires_grad_()
    grad = torch.randn_like(rows)
    params = [w1.weight, w2.weight]
    return _timed(lambda: w2(nn.functional.gelu(w1(rows))).backward(grad), cfg, rows, params)


def _naive(cfg: BenchConfig, x: Tensor) -> Step:
    layer = _sparta_layer(cfg, Place(), None)
    gate, experts = layer.router.gate.weight, layer.experts
    grad = torch.randn_like(x)

    def run() -> None:
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

    return _timed(run, cfg, x, layer.parameters())


def _deepspeed(cfg: BenchConfig, x: Tensor, place: Place, drop_tokens: bool) -> Step | str:
    # Sparta's weights (same seed), copied in, so both route the same tokens to the same experts.
    reference = _sparta_layer(cfg, place, None)
    built = deepspeed_step(reference, x, place.ranks, drop_tokens, AUX_LOSS_COEF)
    if isinstance(built, str):
        return built
    run, params = built
    return _timed(run, cfg, x, params)


def build(name: str, cfg: BenchConfig, x: Tensor, place: Place | None = None) -> Step | str:
    """The candidate's forward+backward step, or why it cannot run."""
    place = place or Place()
    if name == "dense":
        return _dense(cfg, x)
    if name == "naive":
        return _naive(cfg, x)
    if name.startswith("deepspeed"):
        return _deepspeed(cfg, x, place, drop_tokens=name != "deepspeed_cap1.25")
    if name == "sparta_dropless":
        return _sparta(cfg, x, place, None, "auto")
    if name == "sparta_grouped_mm":
        return _sparta(cfg, x, place, None, "grouped_mm")
    if name == "sparta_cap1.25":
        return _sparta(cfg, x, place, 1.25, "auto")
    if name == "sparta_tcp":
        if place.tcp_comm is None:
            return "expert parallel on the torch engine only: the others have no shared_memory switch"
        return _sparta(cfg, x, Place(place.tcp_comm), None, "auto")
    if name == "sparta_pipelined":
        if place.comm is None:
            return "expert parallel only: one process has no exchange to pipeline"
        return _sparta(cfg, x, place, None, "auto", pipeline="auto")
    raise ValueError(f"unknown candidate {name!r}; known: {CANDIDATES}")


def _input(cfg: BenchConfig, rank: int = 0, ranks: int = 1) -> Tensor:
    """This rank's slice of the one-process input (all of it on one process)."""
    torch.manual_seed(1)
    share = cfg.tokens // ranks
    return cfg.place(torch.randn(cfg.tokens, cfg.d_model)[rank * share : (rank + 1) * share].clone()).requires_grad_()


def busiest_rank_load(cfg: BenchConfig, ranks: int) -> float:
    """Rows the busiest expert-parallel rank computes over the mean, for this benchmark's
    input and gate (dropless top-k): the floor that routing imbalance sets for any dropless
    layer, Sparta's or DeepSpeed's, over a dense floor of T / ranks * top_k rows per rank."""
    layer = _sparta_layer(cfg, Place(), None)
    with torch.no_grad():
        layer(_input(cfg))
    assert layer.last_stats is not None
    per_rank = torch.tensor(layer.last_stats.tokens_per_expert).view(ranks, -1).sum(1).double()
    return float(per_rank.max() / per_rank.mean())


def _emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


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


def time_candidates(
    cfg: BenchConfig, candidates: list[str], repeats: int, threads: int, comm: Communicator | None = None
) -> None:
    tcp = None
    if "sparta_tcp" in candidates and comm is not None and comm.backend == "torch":
        tcp = comm.split(list(range(comm.size)), CommConfig(shared_memory="off"))
    place = Place(comm, tcp)
    rank = 0 if comm is None else comm.rank
    bench = "moe_layer" if comm is None else "moe_layer_ep"
    x = _input(cfg, rank, place.ranks)
    steps: dict[str, Step] = {}
    for name in candidates:
        step = build(name, cfg, x, place)
        if isinstance(step, str):
            if rank == 0:
                _emit({"bench": bench, "config": cfg.name, "ranks": place.ranks, "candidate": name, "skipped": step})
            continue
        step()  # warm-up: first-touch allocations and lazy init stay out of the timings
        steps[name] = step
    wall, cpu = _timings(steps, repeats, comm)
    if rank != 0:
        return
    load = {"busiest_rank_load": round(busiest_rank_load(cfg, place.ranks), 4)} if place.ranks > 1 else {}
    for name in steps:
        _emit(
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
                "repeats": repeats,
                "threads": threads,
                **asdict(cfg),
                "tokens_per_rank": cfg.tokens // place.ranks,
                **load,
            }
        )


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
    x = _input(cfg)
    step = build(name, cfg, x)
    if isinstance(step, str):
        _emit({"skipped": step})
        return
    if cfg.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
        step()
        peak = torch.cuda.max_memory_allocated() / 2**20
        _emit({"peak_cuda_mib": round(peak, 1), "step_cuda_mib": round(peak - before, 1)})
        return
    before = _status_mib("VmRSS")
    step()
    peak = _status_mib("VmHWM")
    _emit({"peak_rss_mib": round(peak, 1), "step_rss_mib": round(peak - before, 1)})


def memory_candidates(cfg: BenchConfig, candidates: list[str], threads: int) -> None:
    dense: dict[str, float] = {}
    kind = "cuda" if cfg.device == "cuda" else "rss"
    for name in candidates:
        cmd = [sys.executable, __file__, *_config_args(cfg), "--threads", str(threads), "--_child", name]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        result = json.loads(out)
        if name == "dense":
            dense = result
        elif "skipped" not in result and dense:
            for what in ("step", "peak"):
                key = f"{what}_{kind}_mib"
                result[f"{what}_ratio_to_dense"] = round(result[key] / dense[key], 4)
        _emit({"bench": "moe_layer_memory", "config": cfg.name, "candidate": name, **asdict(cfg), **result})


def _config_args(cfg: BenchConfig) -> list[str]:
    """The command-line flags that rebuild ``cfg`` in a child process."""
    flags = ["--config", cfg.name, "--device", cfg.device, "--dtype", cfg.dtype]
    return flags + (["--zero-grad"] if cfg.zero_grad else [])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(ranks: int, args: argparse.Namespace, configs: list[BenchConfig], candidates: list[str]) -> None:
    """Run the expert-parallel timings on ``ranks`` processes under torchrun (``--engine
    torch``) or mpirun (``--engine mpi``); rank 0's JSON lines come out on our stdout."""
    # One thread per rank: the ranks share the machine's cores, more would only contend.
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for cfg in configs:
        port = _free_port()
        if args.engine == "mpi":
            launcher = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(ranks)]
            launcher += ["-x", "OMP_NUM_THREADS", "-x", "MKL_NUM_THREADS", "-x", "PYTHONUNBUFFERED", sys.executable]
        else:
            launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
            launcher += ["--master-addr=127.0.0.1", f"--master-port={port}"]
        cmd = [
            *launcher,
            __file__,
            "--_ep_worker",
            "--_port",
            str(port),
            "--engine",
            args.engine,
            *_config_args(cfg),
            "--repeats",
            str(args.repeats),
            "--bind",
            args.bind,
            "--candidates",
            ",".join(c for c in candidates if c in EP_CANDIDATES),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        for line in lines:
            print(line, flush=True)
        if proc.returncode != 0 or not lines:
            _emit(
                {
                    "bench": "moe_layer_ep",
                    "config": cfg.name,
                    "ranks": ranks,
                    "engine": args.engine,
                    "error": f"{launcher[0]} exited with {proc.returncode}",
                    "output_tail": (proc.stdout + proc.stderr)[-2000:],
                }
            )


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
    time_candidates(cfg, candidates, repeats, threads=1, comm=world.comm)
    world.exit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (one process)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per candidate (0: memory only)")
    parser.add_argument("--config", choices=[*CONFIGS, "all"], default="all")
    parser.add_argument("--memory", action="store_true", help="also measure peak RSS per candidate (one process)")
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
    configs = list(CONFIGS.values()) if args.config == "all" else [CONFIGS[args.config]]
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
    for ranks in (int(r) for r in args.ranks.split(",")):
        if ranks > 1:
            launch_ranks(ranks, args, configs, candidates)
            continue
        for cfg in configs:
            if args.repeats > 0:
                time_candidates(cfg, candidates, args.repeats, args.threads)
            if args.memory:
                memory_candidates(cfg, candidates, args.threads)


if __name__ == "__main__":
    main()
