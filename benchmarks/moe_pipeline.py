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
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sparta.scheduling.microbatch import Routed, overlapped_block  # noqa: E402
from sparta.scheduling.pipeline import Compute  # noqa: E402
from sparta_tools.cluster import ClusterConfig, EmulatedCluster  # noqa: E402

EXPERTS, TOP_K, D_MODEL, D_FF, TOKENS = 8, 2, 512, 1024, 4096


class Block(torch.nn.Module):
    """The benchmark's model: dense projections around the expert-parallel exchange (an
    attention block's projections stand-in: their gradients are the dense all-reduce).
    `moe(rows)` runs the exchange; rows are this rank's tokens repeated top_k times in
    expert order (`perm`), combined back by summing."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(d, d)
        self.post = torch.nn.Linear(d, d)
        self.out = torch.nn.Linear(d, d)
        self.gate = torch.randn(d, EXPERTS)  # fixed: every configuration routes alike
        self.moe: Callable[[torch.Tensor], torch.Tensor] = lambda r: r
        self.perm = torch.zeros(0, dtype=torch.int64)
        # micro-batched (overlapped_block): the micro-batch count, the experts, their weights
        self.microbatches = 1
        self.experts: Compute = lambda r, c: r
        self.expert_weights: list[torch.Tensor] = []
        self.exchange: object = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows' tokens in expert order [n * top_k], rows per expert [EXPERTS])."""
        experts = (x @ self.gate).topk(TOP_K, dim=1).indices.flatten()
        return torch.sort(experts, stable=True).indices // TOP_K, torch.bincount(experts, minlength=EXPERTS)

    def before(self, x: torch.Tensor) -> Routed:
        perm, counts = self.route(x)
        return Routed(self.pre(x).index_select(0, perm), counts, (perm,))

    def after(self, back: torch.Tensor, side: tuple[torch.Tensor, ...]) -> torch.Tensor:
        (perm,) = side
        return self.tail(back.new_zeros(perm.numel() // TOP_K, back.shape[1]).index_add(0, perm, back))

    def tail(self, h: torch.Tensor) -> torch.Tensor:
        """The dense layers after the combine, over tokens."""
        return self.out(torch.nn.functional.gelu(self.post(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.microbatches > 1:
            params = [*self.parameters(), *self.expert_weights]
            return overlapped_block(x, self.microbatches, self.before, self.experts, self.after, self.exchange, params)  # type: ignore[arg-type]
        return self.after(self.moe(self.pre(x).index_select(0, self.perm)), (self.perm,))

    def ready_order(self) -> list[torch.nn.Parameter]:
        """Dense parameters in the order backward produces their gradients."""
        return [self.out.bias, self.out.weight, self.post.bias, self.post.weight, self.pre.bias, self.pre.weight]


def worker(args: argparse.Namespace) -> None:
    import sparta
    from sparta.comm import HierarchicalAllToAll
    from sparta.parallel import DataParallel, ParallelDims, build_layout
    from sparta.scheduling.chunks import PipelineDegrees
    from sparta.scheduling.cost_model import Calibration, CostModel, LayerShape
    from sparta.scheduling.partition import GradientPartition, bucketed_exposed_s, partition_gradients
    from sparta.scheduling.pipeline import pipelined_exchange
    from sparta.scheduling.profiler import ProfileConfig, Profiler
    from sparta.scheduling.trace import TracedExchange, Tracer, draw_timeline, gather, write_chrome_trace
    from sparta.scheduling.tuner import UNPIPELINED, Choice, OnlineTuner

    torch.set_num_threads(1)
    world = sparta.init(backend="torch", ranks_per_node=args.ranks_per_node)
    size, local = world.size, EXPERTS // world.size
    intra, inter = world.node_comms()
    hier = HierarchicalAllToAll(world.comm, intra, inter)
    mib = 2**20
    # up to the whole exchange (16 MiB at r=1): chunked transfers span 1 to 16 MiB
    config = ProfileConfig(bytes=(mib, 4 * mib, 16 * mib), rows=(1024, 4096, 8192), repeats=3)
    g = torch.Generator().manual_seed(world.rank)
    tokens = torch.randn(TOKENS, D_MODEL, generator=g)
    w1 = (torch.randn(local, D_MODEL, D_FF, generator=g) / D_MODEL**0.5).requires_grad_()
    w2 = (torch.randn(local, D_FF, D_MODEL, generator=g) / D_FF**0.5).requires_grad_()
    torch.manual_seed(0)  # dense weights equal on every rank, as data parallelism keeps them
    block = Block(D_MODEL)
    # each token's top_k rows, sorted by expert (what dispatch produces)
    block.perm, counts = block.route(tokens)
    # data parallelism over all ranks: DDP's default 25 MiB buckets, or (partitioned) the
    # cost model's pieces released into the backward's gaps, both through sparta.parallel.DataParallel
    layout = build_layout(ParallelDims(dp=world.size), world)
    buckets = DataParallel(layout, "ddp", microbatches=1, zero_bubble=False)
    ddp = buckets.wrap(block)

    def experts_mlp(x: torch.Tensor, chunk_counts: torch.Tensor) -> torch.Tensor:
        # rows come grouped by (source, local expert): regroup by expert, run, restore order
        slot = torch.repeat_interleave(torch.arange(local).repeat(size), chunk_counts.flatten())
        order = torch.sort(slot, stable=True).indices
        per_expert = torch.bincount(slot, minlength=local).tolist()
        parts = torch.split(x.index_select(0, order), per_expert)
        out = torch.cat([torch.nn.functional.gelu(p @ w1[e]) @ w2[e] for e, p in enumerate(parts)])
        return torch.empty_like(out).index_copy_(0, order, out)

    def balanced(rows: int) -> torch.Tensor:
        """Counts [size, local] of `rows` rows spread evenly (what the cost model assumes)."""
        flat = torch.full((size * local,), rows // (size * local))
        flat[: rows % (size * local)] += 1
        return flat.view(size, local)

    def dense_only(x: torch.Tensor) -> torch.Tensor:
        return block.tail(block.pre(x))

    # the experts and dense layers as this benchmark runs them, not stand-ins
    profiler = Profiler(world.comm, {"world": world.comm, "hier": hier, "intra": intra}, config)
    profile = (
        profiler.collectives(("all_to_all",))
        | Profiler(world.comm, {"world": world.comm}, config).collectives(("all_reduce",))
        | profiler.forward_backward(f"{D_MODEL}x{D_FF}", lambda x: experts_mlp(x, balanced(x.shape[0])), D_MODEL)
        | profiler.forward_backward("dense", dense_only, D_MODEL)
        | profiler.forward_backward("before", block.pre, D_MODEL, op="dense")
        | profiler.forward_backward("after", block.tail, D_MODEL, op="dense")
    )
    shape = LayerShape(tokens=TOKENS, top_k=TOP_K, d_model=D_MODEL, d_ff=D_FF, ep_size=size)
    model = CostModel(profile)
    plan = model.plan(shape, max_degree=8)
    dense_bytes = sum(p.numel() * 4 for p in block.ready_order())
    ar = profile.fit("all_reduce", "world")
    dense_s = profile.fit("expert_fwd", "dense")(TOKENS) + profile.fit("expert_bwd", "dense")(TOKENS)
    syncs: dict[Choice, DataParallel] = {}

    def partition_of(choice: Choice) -> tuple[GradientPartition, tuple[int, ...]]:
        """The pieces for `choice`'s backward gaps, and the transfers after which each gap opens."""
        line = model.backward_timeline(shape, choice.degrees, choice.hierarchical)
        part = partition_gradients(dense_bytes, [e - b for b, e in line.idle_network()], ar, 4096, element_bytes=4)
        return part, line.gap_openings()

    def partitioned(choice: Choice) -> DataParallel:
        # wrap() broadcasts the dense weights (collective): only from step(), which every rank
        # runs. Each choice's hooks act only between its own start() and finish().
        if choice not in syncs:
            part, openings = partition_of(choice)
            syncs[choice] = DataParallel(layout, "sparta", 1, False, partition=part, openings=openings)
            syncs[choice].wrap(block)  # its ready order (reverse registration) is block.ready_order()
        return syncs[choice]

    def parts(choice: Choice, partition: bool) -> tuple[float, float]:
        """The model's (overlapped, serial) step seconds: with its pipeline and the gradient
        pieces in their gaps, and with every transfer, compute and all-reduce in turn."""
        if choice.microbatches > 1:  # the dense layers are in the pipeline's prediction
            p = model.predict_microbatched(shape, choice.microbatches, choice.hierarchical, "before", "after")
            exposed = bucketed_exposed_s(dense_bytes, ar)
            return p.forward_s + p.backward_s + exposed, p.forward_serial_s + p.backward_serial_s + exposed
        p = model.predict_degrees(shape, choice.degrees, choice.hierarchical)
        if partition:
            pieces = partition_of(choice)[0]
            exposed, all_ar = pieces.exposed_s, sum(ar(n) for n in pieces.pieces)
        else:
            exposed = all_ar = bucketed_exposed_s(dense_bytes, ar)
        return (
            p.forward_s + p.backward_s + dense_s + exposed,
            p.forward_serial_s + p.backward_serial_s + dense_s + all_ar,
        )

    def step(choice: Choice, partition: bool, tracer: Tracer | None = None) -> float:
        sync = partitioned(choice) if partition else None
        exchange: object = hier if choice.hierarchical else world.comm
        if tracer is not None:
            exchange = TracedExchange(exchange, tracer, "inter-node comm" if not choice.hierarchical else None)
        if sync is not None:
            exchange = sync.watch(exchange)
        block.moe = lambda r: pipelined_exchange(r, counts, experts_mlp, exchange, choice.degrees, [w1, w2])
        block.microbatches, block.exchange = choice.microbatches, exchange
        block.experts, block.expert_weights = experts_mlp, [w1, w2]
        block.zero_grad(set_to_none=True)
        world.comm.barrier()
        begin = time.perf_counter()
        if sync is None:
            buckets.start()
            ddp(tokens).square().mean().backward()
            buckets.finish()
        else:
            y = block(tokens)
            sync.start()
            y.square().mean().backward()
            sync.finish()
        return time.perf_counter() - begin

    # online check and calibration: the model's three best choices, degrees apart (gradients
    # partitioned; the profile's per-transfer latency is the least certain fit), its
    # best with DDP buckets, and flat r=1 with DDP buckets, the baseline auto must clearly
    # beat (by 3%, above this machine's step-to-step noise) or fall back to; two untimed
    # rounds (with one, r=1's large buffers were still warming up: its steps ran 13-25%
    # slower than later ones), then two timed; the agreed timings calibrate the model
    # before any timed step
    flat1 = (UNPIPELINED, False)
    # the model's two best micro-batch counts (flat or hierarchical), gradients in DDP's
    # buckets: overlapped_block hands them to autograd only once the block's backward is done
    micro_plans = sorted(
        ((Choice(PipelineDegrees(1, 1), h, m), False) for h in (False, True) for m in range(2, 9)),
        key=lambda c: parts(*c)[0],
    )[:2]
    candidates = [*((c, True) for c in plan.ranked(3)), (plan.choice, False), *micro_plans, flat1]
    tuner = OnlineTuner(world.comm, candidates, trials=2, baseline=flat1, margin=0.03, warmup=2)
    while tuner.chosen is None:
        tuner.observe(step(*tuner.current))
    auto = tuner.chosen
    calibration = Calibration.fit([(*parts(*c), t) for c, t in tuner.measured.items()])
    calibrated_plan = CostModel(profile, calibration).plan(shape, max_degree=8)
    # the chunked pipeline to compare with: auto's if it is one, else the fastest the tuner timed
    chunked = [c for c, _ in sorted(tuner.measured.items(), key=lambda kv: kv[1]) if c[0].microbatches == 1]
    piped = auto[0] if auto[0].microbatches == 1 else chunked[0][0]
    micro = auto if auto[0].microbatches > 1 else min(micro_plans, key=lambda c: tuner.measured[c])
    configs = {
        "flat_r1": flat1,
        "hier_r1": (Choice(PipelineDegrees(1, 1), True), False),
        "pipelined_ddp": (piped, False),
        "pipelined_partition": (piped, True),
        "microbatched": micro,
    }
    times: dict[tuple[Choice, bool], list[float]] = {c: [] for c in dict.fromkeys(configs.values())}
    for _ in range(args.repeats):
        for cfg, seen in times.items():
            seen.append(step(*cfg))
    configs["auto"] = auto

    # lower bound: the chosen exchange's communication alone (same chunks, the experts
    # replaced by the identity; chunked transfers cross the shaped link faster than one large
    # one, so unchunked timings would not bound it) plus the dense all-reduce, against the
    # experts' and dense layers' compute alone. Each part timed apart, median of three.
    # Where the block's dense layers run whole before and after the exchange (all but
    # micro-batched plans: only their all-reduce can overlap it), no schedule beats dense
    # compute + max(exchange, experts' compute) either: the larger of the two bounds is
    # "block_bound_s". A micro-batched auto is timed over as many equal chunks.
    exchange = hier if auto[0].hierarchical else world.comm
    auto_degrees = auto[0].degrees if auto[0].microbatches == 1 else PipelineDegrees.of(auto[0].microbatches)
    xb = torch.randn(TOKENS * TOP_K, D_MODEL, requires_grad=True)

    def timed(run: Callable[[], object]) -> tuple[float, float]:
        """(wall, CPU) seconds of `run` on this rank; CPU counts every thread of the process."""
        world.comm.barrier()
        begin, cpu = time.perf_counter(), time.process_time()
        run()
        return time.perf_counter() - begin, time.process_time() - cpu

    # and the CPU time the exchange alone costs this rank (gloo's threads and the kernel's
    # TCP work in its syscalls): on this machine that CPU is taken from the cores the experts
    # compute on, which a cluster's NICs would spare
    parts_runs: list[list[float]] = [[], [], [], []]
    exchange_cpu: list[float] = []
    for _ in range(3):
        for k, run in enumerate(
            (
                lambda: pipelined_exchange(xb, counts, lambda x, c: x * 1.0, exchange, auto_degrees).sum().backward(),
                lambda: world.comm.all_reduce(torch.zeros(dense_bytes // 4)),
                lambda: experts_mlp(xb.detach().requires_grad_(), balanced(TOKENS * TOP_K)).sum().backward(),
                lambda: dense_only(tokens.detach().requires_grad_()).sum().backward(),
            )
        ):
            wall, cpu = timed(run)
            parts_runs[k].append(wall)
            if k == 0:
                exchange_cpu.append(cpu)
    bound = torch.tensor([sorted(r)[1] for r in [*parts_runs, exchange_cpu]], dtype=torch.float64)
    exchange_s, all_reduce_s, experts_s, dense_compute_s, exchange_cpu_s = (
        torch.stack(world.comm.all_gather(bound)).max(0).values.tolist()  # type: ignore[arg-type]
    )
    comm_s, compute_s = exchange_s + all_reduce_s, experts_s + dense_compute_s
    # ranks time-slicing one core (a node's ranks on its pinned CPUs): each's exchange CPU
    # stretches the others' compute by as much
    sharing = max(1, -(-args.ranks_per_node // len(os.sched_getaffinity(0))))

    if args.trace:
        tracer = Tracer()
        step(*auto, tracer)
        spans = gather(world.comm, tracer)
        if spans is not None:
            path = args.trace.replace("RATE", args.rate)
            write_chrome_trace(path, spans)
            draw_timeline(path.replace(".json", "") + ".png", spans, f"auto at {args.rate}")

    # each configuration's median over this rank's steps, then the slowest rank's
    mine = torch.tensor([sorted(t)[len(t) // 2] for t in times.values()], dtype=torch.float64)
    slowest = torch.stack(world.comm.all_gather(mine)).max(0).values  # type: ignore[arg-type]
    by_cfg = dict(zip(times, slowest.tolist(), strict=True))
    med = {name: by_cfg[cfg] for name, cfg in configs.items()}
    # every timed step's slowest rank, to show the step-to-step noise the medians sit in
    per_step = torch.tensor(list(times.values()), dtype=torch.float64)
    steps = torch.stack(world.comm.all_gather(per_step)).max(0).values  # type: ignore[arg-type]
    each = dict(zip(times, steps.tolist(), strict=True))
    if world.rank == 0:
        lower = max(comm_s, compute_s)
        block_bound = max(lower, dense_compute_s + max(exchange_s, experts_s))
        # the same with the exchange's CPU work counted on the compute side (this machine only)
        cpu_bound = max(block_bound, dense_compute_s + experts_s + sharing * exchange_cpu_s)
        raw = {name: parts(*cfg)[0] for name, cfg in configs.items()}
        cal = {name: calibration(*parts(*cfg)) for name, cfg in configs.items()}
        part = partition_of(piped)[0]

        def choice_json(c: Choice) -> dict[str, object]:
            d = c.degrees
            return {
                "r_fwd": d.forward,
                "r_bwd": d.backward,
                "taper": d.taper,
                "hier": c.hierarchical,
                "microbatches": c.microbatches,
            }

        result = {
            "rate": args.rate,
            "load_avg": [round(x, 2) for x in os.getloadavg()],
            "step_s": {k: round(v, 3) for k, v in med.items()},
            "steps_s": {k: [round(t, 3) for t in each[cfg]] for k, cfg in configs.items()},
            "model_choice": choice_json(plan.choice),
            "calibrated_model_choice": choice_json(calibrated_plan.choice),
            "auto_choice": {**choice_json(auto[0]), "partition": auto[1]},
            "tuner_s": {
                f"{choice_json(c[0])}/{'part' if c[1] else 'ddp'}": round(t, 3) for c, t in tuner.measured.items()
            },
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
                f"{m}{'h' if h else ''}": round(parts(Choice(PipelineDegrees(1, 1), h, m), False)[0], 3)
                for h in (False, True)
                for m in range(2, 9)
            },
            "partition": {"dense_bytes": dense_bytes, "pieces": list(part.pieces), "gaps": list(part.gaps)},
            "lower_bound_s": round(lower, 3),
            "comm_s": {"exchange": round(exchange_s, 3), "all_reduce": round(all_reduce_s, 3)},
            "compute_s": {"experts": round(experts_s, 3), "dense": round(dense_compute_s, 3)},
            "block_bound_s": round(block_bound, 3),
            "auto_over_block_bound": round(med["auto"] / block_bound, 3),
            "exchange_cpu_s": round(exchange_cpu_s, 3),
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
                for k, f in profile.fits.items()
            },
        }
        print(json.dumps(result), flush=True)
    world.shutdown()


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
