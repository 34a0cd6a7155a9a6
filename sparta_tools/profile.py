"""`sparta profile`: run an expert-parallel MoE block on N local ranks and show where the time goes.

    sparta profile --nprocs 4 --ranks-per-node 2 --tokens 4096 --d-model 512 --d-ff 1024 \\
        --experts 8 --top-k 2 --pipeline-degree auto --out prof/ [--rate 300mbit]

Each rank profiles the collectives (all-to-all and all-reduce over the world, the node's ranks,
the ranks of its local index across nodes, and the two-level all-to-all) and one expert's
GEMMs, fits t = alpha + beta * n, and plans the layer's exchange with the cost model; then
builds the layer (with `--pipeline-degree auto`, `sparta.moe.tune_schedule` times the model's
best plans on the layer and the layer takes the fastest), runs a warm-up step and `steps`
traced forward+backward steps. Rank 0 writes `<out>/trace.json` (Chrome trace:
a process per rank, a thread per stream: step, compute, intra-node comm, inter-node comm,
world comm; every chunk labelled "fwd out 2", "bwd compute 1", ...), `<out>/timeline.png`
and `<out>/profile.json`, and prints one JSON line per fit and one with the plan, the degrees
the layer ran and the step time.

Ranks start under torchrun on this machine, or with `rate` inside an emulated cluster
(sparta_tools.cluster: root only) whose nodes are `ranks_per_node` ranks each.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from sparta.errors import ConfigError
from sparta.moe import MoELayer, tune_schedule
from sparta.scheduling.chunks import DEGREES_HELP, PipelineDegrees
from sparta.scheduling.cost_model import CostModel, LayerShape
from sparta.scheduling.profiler import Profile, ProfileConfig, Profiler
from sparta.scheduling.trace import TracedExchange, Tracer, draw_timeline, gather, write_chrome_trace
from sparta_tools.cluster import ClusterConfig, EmulatedCluster
from sparta_tools.processes import run_bounded

TRACKS = ("step", "compute", "intra-node comm", "inter-node comm", "world comm")


def parse_degree(text: str, flag: str = "--pipeline-degree") -> int | tuple[int, ...] | str:
    """ "auto" (tuned by sparta.moe.tune_schedule), or "3", "2,4" (forward, backward) or
    "8,8,2" (and a taper), as MoELayer's pipeline_degree takes it; ConfigError naming
    ``flag`` otherwise."""
    if text == "auto":
        return text
    try:
        parts = tuple(int(p) for p in text.split(","))
        PipelineDegrees.of(parts)
    except (ValueError, ConfigError):
        raise ConfigError(
            f"{flag} {text!r}; give 'auto' or {DEGREES_HELP}, comma-separated (e.g. 2,4 or 8,8,2)"
        ) from None
    return parts[0] if len(parts) == 1 else parts


@dataclass(frozen=True)
class ProfileRun:
    """One `sparta profile` configuration. tokens: rows entering the layer per rank;
    experts are spread over all `nprocs` ranks; ranks_per_node (default: all on one node)
    sets the intra/inter split; hierarchical: give the layer a two-level exchange; rate:
    run inside an emulated cluster with this inter-node link rate (tc units, root only);
    steps: traced steps after one warm-up step; out: the folder for the outputs."""

    out: str
    nprocs: int = 2
    ranks_per_node: int = 0
    tokens: int = 1024
    d_model: int = 256
    d_ff: int = 512
    experts: int = 4
    top_k: int = 2
    pipeline_degree: str = "auto"
    hierarchical: bool = True
    steps: int = 2
    rate: str = ""
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("nprocs", "tokens", "d_model", "d_ff", "experts", "top_k", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"sparta profile: --{name.replace('_', '-')} = {getattr(self, name)}; use >= 1")
        if self.experts % self.nprocs:
            raise ConfigError(
                f"sparta profile: --experts {self.experts} cannot be spread over --nprocs {self.nprocs}; "
                "use a multiple of the rank count"
            )
        if self.top_k > self.experts:
            raise ConfigError(f"sparta profile: --top-k {self.top_k} > --experts {self.experts}; use top_k <= experts")
        if self.ranks_per_node < 0 or (self.ranks_per_node and self.nprocs % self.ranks_per_node):
            raise ConfigError(
                f"sparta profile: --ranks-per-node {self.ranks_per_node} must divide --nprocs {self.nprocs}"
            )
        parse_degree(self.pipeline_degree)
        if self.rate:
            ClusterConfig(nodes=self.nodes, ranks_per_node=self.per_node, rate=self.rate)  # validates the rate

    @property
    def per_node(self) -> int:
        return self.ranks_per_node or self.nprocs

    @property
    def nodes(self) -> int:
        return self.nprocs // self.per_node

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ProfileRun:
        return cls(**json.loads(text))


def launch(run: ProfileRun) -> int:
    """Start the workers (`python -m sparta.cli profile --worker <run>`) on `nprocs` ranks;
    returns 0 when every rank succeeded."""
    Path(run.out).mkdir(parents=True, exist_ok=True)
    run = ProfileRun(**{**asdict(run), "out": str(Path(run.out).resolve())})
    worker = ["-m", "sparta.cli", "profile", "--worker", run.to_json()]
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if run.rate:
        config = ClusterConfig(nodes=run.nodes, ranks_per_node=run.per_node, rate=run.rate)
        with EmulatedCluster(config) as cluster:
            codes = cluster.run([sys.executable, *worker], timeout_s=run.timeout_s, env={**os.environ, **env})
        return 1 if any(codes) else 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={run.nprocs}",
           "--master-addr=127.0.0.1", f"--master-port={port}", *worker]  # fmt: skip
    code, _, timed_out = run_bounded(cmd, {**os.environ, **env}, run.timeout_s, echo=sys.stdout)
    if timed_out:
        print(f"sparta profile: ranks ran past {run.timeout_s:g} s and were stopped", file=sys.stderr)
        return 1
    return code


def fit_lines(profile: Profile) -> list[dict[str, Any]]:
    """One record per fitted operation: alpha (s), beta (s per byte, or per row for GEMMs)."""
    return [
        {
            "fit": key,
            "alpha_s": f.alpha,
            "beta_s_per_unit": f.beta,
            "unit": "row" if key.startswith("expert_") else "byte",
            "rel_error": round(f.rel_error, 4),
        }
        for key, f in sorted(profile.fits.items())
    ]


def run_worker(run: ProfileRun) -> None:
    """Every rank: profile, plan, run the MoE layer (its rows' exchanges traced; flat unless
    `run.hierarchical`), and on rank 0 write and print the results."""
    from sparta.comm import HierarchicalAllToAll
    from sparta.comm.world import init

    torch.set_num_threads(1)
    world = init(backend="torch", ranks_per_node=run.per_node)
    intra, inter = world.node_comms()
    rows = run.tokens * run.top_k
    exchange_bytes = rows * run.d_model * 4
    sizes = sorted({max(4096, exchange_bytes // d) for d in (16, 4, 1)})
    row_counts = sorted({max(16, rows // d) for d in (8, 2, 1)})
    config = ProfileConfig(bytes=tuple(sizes) if len(sizes) > 1 else (4096, 65536), rows=tuple(row_counts))
    profiler = Profiler(world.comm, {"world": world.comm, "intra": intra, "inter": inter}, config)
    hier = Profiler(world.comm, {"hier": HierarchicalAllToAll(world.comm, intra, inter)}, config)  # all-to-all only
    profile = (
        profiler.collectives(("all_to_all", "all_reduce"))
        | hier.collectives(("all_to_all",))
        | profiler.expert_mlp(run.d_model, run.d_ff)
    )
    shape = LayerShape(run.tokens, run.top_k, run.d_model, run.d_ff, ep_size=world.size)
    plan = CostModel(profile).plan(shape, hierarchical=None if run.hierarchical else False)

    tracer = Tracer()
    flat = TracedExchange(world.comm, tracer, "world comm")
    two_level = None
    if run.hierarchical:
        two_level = HierarchicalAllToAll(
            world.comm,
            TracedExchange(intra, tracer, "intra-node comm"),
            TracedExchange(inter, tracer, "inter-node comm"),
        )
    hier = None if two_level is None else TracedExchange(two_level, tracer, None)  # its steps record themselves
    degree = parse_degree(run.pipeline_degree)
    block = MoELayer(
        run.d_model, run.d_ff, run.experts, run.top_k, ep_size=run.nprocs, comm=world.comm, exchange=hier or flat,
        pipeline_degree=1 if degree == "auto" else degree,
    )  # fmt: skip
    x = torch.randn(run.tokens, run.d_model, generator=torch.Generator().manual_seed(world.rank))
    if degree == "auto":
        chosen = tune_schedule(block, x, two_level)
        block.apply_schedule(chosen, hier)
        block.set_exchange(hier if chosen.hierarchical else flat)  # a flat plan's rows traced too

    def step() -> float:
        xi = x.clone().requires_grad_()
        world.comm.barrier()
        begin = time.perf_counter()
        with tracer.span("forward", "step"):
            y = block(xi)
        with tracer.span("backward", "step"):
            y.square().mean().backward()
        return time.perf_counter() - begin

    step()  # warm-up: connections, first-call allocations
    tracer.spans.clear()
    times = [step() for _ in range(run.steps)]
    # each step's slowest rank, then the median over the steps
    every = torch.stack(world.comm.all_gather(torch.tensor(times, dtype=torch.float64)))  # type: ignore[arg-type]
    step_s = statistics.median(every.max(0).values.tolist())
    spans = gather(world.comm, tracer)
    if spans is not None:
        out = Path(run.out)
        write_chrome_trace(out / "trace.json", spans)
        layer_plan = getattr(block, "schedule_plan", None)
        degrees = getattr(block, "degrees", None)
        title = f"{run.nprocs} ranks ({run.nodes} nodes{', ' + run.rate if run.rate else ''}), degrees {degrees}"
        draw_timeline(out / "timeline.png", spans, title)
        profile.save(out / "profile.json")
        for line in fit_lines(profile):
            print(json.dumps(line), flush=True)
        summary = {
            "model_plan": {
                "r_fwd": plan.degrees.forward,
                "r_bwd": plan.degrees.backward,
                "taper": plan.degrees.taper,
                "hierarchical": plan.hierarchical,
                "predicted_forward_s": round(plan.forward_s, 4),
                "predicted_backward_s": round(plan.backward_s, 4),
            },
            "layer_ran": {
                "r_fwd": degrees.forward if degrees else None,
                "r_bwd": degrees.backward if degrees else None,
                "taper": degrees.taper if degrees else None,
                "hierarchical": hier is not None and block.exchange is hier,
                "planned_in_layer": layer_plan is not None,
            },
            # the layer's own plan: its timed trials' correction of the model, and its
            # corrected prediction of the exchange and the router's profiled time
            "layer_plan": None
            if layer_plan is None
            else {
                "scale": round(layer_plan.calibration.scale, 4),
                "efficiency": round(layer_plan.calibration.efficiency, 4),
                "predicted_exchange_s": round(layer_plan.forward_s + layer_plan.backward_s, 4),
                "router_s": [round(t, 5) for t in layer_plan.router_s],
            },
            "step_s": round(step_s, 4),
            "trace": str(out / "trace.json"),
            "png": str(out / "timeline.png"),
        }
        print(json.dumps(summary), flush=True)
    world.shutdown()
