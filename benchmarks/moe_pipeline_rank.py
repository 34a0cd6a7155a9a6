"""One rank's side of benchmarks/moe_pipeline.py: the block it times (dense projections around
an expert-parallel exchange, routed by a fixed random gate: 8 experts, top-2, d_model 512,
d_ff 1024, 4096 tokens per rank), its profile and cost model, one timed step of a plan, and
the step's parts timed apart for the lower bounds."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import sparta
from sparta.comm import Communicator, HierarchicalAllToAll
from sparta.parallel import DataParallel, ParallelDims, build_layout
from sparta.scheduling.chunks import PipelineDegrees
from sparta.scheduling.cost_model import CostModel, LayerShape
from sparta.scheduling.microbatch import Routed, overlapped_block
from sparta.scheduling.partition import GradientPartition, bucketed_exposed_s, partition_gradients
from sparta.scheduling.pipeline import Compute, pipelined_exchange
from sparta.scheduling.profiler import Profile, ProfileConfig, Profiler
from sparta.scheduling.trace import TracedExchange, Tracer, draw_timeline, gather, write_chrome_trace
from sparta.scheduling.tuner import UNPIPELINED, Choice, OnlineTuner

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


Plan = tuple[Choice, bool]  # a choice, and whether its dense gradients go as partitioned pieces
FLAT1: Plan = (UNPIPELINED, False)  # the baseline: one exchange, DDP's buckets


@dataclass(frozen=True)
class Bounds:
    """The step's parts timed apart (seconds, the slowest rank's median of three)."""

    exchange_s: float
    all_reduce_s: float
    experts_s: float
    dense_compute_s: float
    exchange_cpu_s: float  # CPU (every thread of a process) inside the exchange alone, the most any rank used


class Bench:
    """One rank's side: the block, its profile and cost model, and one timed step of a plan."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.world = world = sparta.init(backend="torch", ranks_per_node=args.ranks_per_node)
        self.size, self.local = world.size, EXPERTS // world.size
        intra, inter = world.node_comms()
        self.hier = HierarchicalAllToAll(world.comm, intra, inter)
        g = torch.Generator().manual_seed(world.rank)
        self.tokens = torch.randn(TOKENS, D_MODEL, generator=g)
        self.w1 = (torch.randn(self.local, D_MODEL, D_FF, generator=g) / D_MODEL**0.5).requires_grad_()
        self.w2 = (torch.randn(self.local, D_FF, D_MODEL, generator=g) / D_FF**0.5).requires_grad_()
        torch.manual_seed(0)  # dense weights equal on every rank, as data parallelism keeps them
        self.block = Block(D_MODEL)
        # each token's top_k rows, sorted by expert (what dispatch produces)
        self.block.perm, self.counts = self.block.route(self.tokens)
        # data parallelism over all ranks: DDP's default 25 MiB buckets, or (partitioned) the
        # cost model's pieces released into the backward's gaps, both through sparta.parallel.DataParallel
        self.layout = build_layout(ParallelDims(dp=world.size), world)
        self.buckets = DataParallel(self.layout, "ddp", microbatches=1, zero_bubble=False)
        self.ddp = self.buckets.wrap(self.block)
        self.profile = self.measure_profile(intra)
        self.shape = LayerShape(tokens=TOKENS, top_k=TOP_K, d_model=D_MODEL, d_ff=D_FF, ep_size=self.size)
        self.model = CostModel(self.profile)
        self.plan = self.model.plan(self.shape, max_degree=8)
        self.dense_bytes = sum(p.numel() * 4 for p in self.block.ready_order())
        self.ar = self.profile.fit("all_reduce", "world")
        self.dense_s = self.profile.fit("expert_fwd", "dense")(TOKENS) + self.profile.fit("expert_bwd", "dense")(TOKENS)
        self.syncs: dict[Choice, DataParallel] = {}

    def experts_mlp(self, x: torch.Tensor, chunk_counts: torch.Tensor) -> torch.Tensor:
        # rows come grouped by (source, local expert): regroup by expert, run, restore order
        local = self.local
        slot = torch.repeat_interleave(torch.arange(local).repeat(self.size), chunk_counts.flatten())
        order = torch.sort(slot, stable=True).indices
        per_expert = torch.bincount(slot, minlength=local).tolist()
        parts = torch.split(x.index_select(0, order), per_expert)
        out = torch.cat([torch.nn.functional.gelu(p @ self.w1[e]) @ self.w2[e] for e, p in enumerate(parts)])
        return torch.empty_like(out).index_copy_(0, order, out)

    def balanced(self, rows: int) -> torch.Tensor:
        """Counts [size, local] of `rows` rows spread evenly (what the cost model assumes)."""
        cells = self.size * self.local
        flat = torch.full((cells,), rows // cells)
        flat[: rows % cells] += 1
        return flat.view(self.size, self.local)

    def dense_only(self, x: torch.Tensor) -> torch.Tensor:
        return self.block.tail(self.block.pre(x))

    def measure_profile(self, intra: Communicator) -> Profile:
        """The links, and the experts and dense layers as this benchmark runs them, not stand-ins."""
        comm, mib = self.world.comm, 2**20
        # up to the whole exchange (16 MiB at r=1): chunked transfers span 1 to 16 MiB
        config = ProfileConfig(bytes=(mib, 4 * mib, 16 * mib), rows=(1024, 4096, 8192), repeats=3)
        profiler = Profiler(comm, {"world": comm, "hier": self.hier, "intra": intra}, config)
        return (
            profiler.collectives(("all_to_all",))
            | Profiler(comm, {"world": comm}, config).collectives(("all_reduce",))
            | profiler.forward_backward(
                f"{D_MODEL}x{D_FF}", lambda x: self.experts_mlp(x, self.balanced(x.shape[0])), D_MODEL
            )
            | profiler.forward_backward("dense", self.dense_only, D_MODEL)
            | profiler.forward_backward("before", self.block.pre, D_MODEL, op="dense")
            | profiler.forward_backward("after", self.block.tail, D_MODEL, op="dense")
        )

    def partition_of(self, choice: Choice) -> tuple[GradientPartition, tuple[int, ...]]:
        """The pieces for `choice`'s backward gaps, and the transfers after which each gap opens."""
        line = self.model.backward_timeline(self.shape, choice.degrees, choice.hierarchical)
        gaps = [e - b for b, e in line.idle_network()]
        return partition_gradients(self.dense_bytes, gaps, self.ar, 4096, element_bytes=4), line.gap_openings()

    def partitioned(self, choice: Choice) -> DataParallel:
        # wrap() broadcasts the dense weights (collective): only from step(), which every rank
        # runs. Each choice's hooks act only between its own start() and finish().
        if choice not in self.syncs:
            part, openings = self.partition_of(choice)
            self.syncs[choice] = DataParallel(self.layout, "sparta", 1, False, partition=part, openings=openings)
            self.syncs[choice].wrap(self.block)  # its ready order (reverse registration) is block.ready_order()
        return self.syncs[choice]

    def parts(self, choice: Choice, partition: bool) -> tuple[float, float]:
        """The model's (overlapped, serial) step seconds: with its pipeline and the gradient
        pieces in their gaps, and with every transfer, compute and all-reduce in turn."""
        model, shape, ar = self.model, self.shape, self.ar
        if choice.microbatches > 1:  # the dense layers are in the pipeline's prediction
            p = model.predict_microbatched(shape, choice.microbatches, choice.hierarchical, "before", "after")
            exposed = bucketed_exposed_s(self.dense_bytes, ar)
            return p.forward_s + p.backward_s + exposed, p.forward_serial_s + p.backward_serial_s + exposed
        p = model.predict_degrees(shape, choice.degrees, choice.hierarchical)
        if partition:
            pieces = self.partition_of(choice)[0]
            exposed, all_ar = pieces.exposed_s, sum(ar(n) for n in pieces.pieces)
        else:
            exposed = all_ar = bucketed_exposed_s(self.dense_bytes, ar)
        return (
            p.forward_s + p.backward_s + self.dense_s + exposed,
            p.forward_serial_s + p.backward_serial_s + self.dense_s + all_ar,
        )

    def step(self, choice: Choice, partition: bool, tracer: Tracer | None = None) -> float:
        """One timed forward + backward of the block under `choice` (seconds, this rank)."""
        block, weights = self.block, [self.w1, self.w2]
        sync = self.partitioned(choice) if partition else None
        exchange: object = self.hier if choice.hierarchical else self.world.comm
        if tracer is not None:
            exchange = TracedExchange(exchange, tracer, "inter-node comm" if not choice.hierarchical else None)
        if sync is not None:
            exchange = sync.watch(exchange)
        block.moe = lambda r: pipelined_exchange(r, self.counts, self.experts_mlp, exchange, choice.degrees, weights)
        block.microbatches, block.exchange = choice.microbatches, exchange
        block.experts, block.expert_weights = self.experts_mlp, weights
        block.zero_grad(set_to_none=True)
        self.world.comm.barrier()
        begin = time.perf_counter()
        if sync is None:
            self.buckets.start()
            self.ddp(self.tokens).square().mean().backward()
            self.buckets.finish()
        else:
            y = block(self.tokens)
            sync.start()
            y.square().mean().backward()
            sync.finish()
        return time.perf_counter() - begin

    def tune(self) -> tuple[OnlineTuner, list[Plan]]:
        """The online check and calibration, and the micro-batched plans it weighed."""
        # the model's three best choices, degrees apart (gradients partitioned; the profile's
        # per-transfer latency is the least certain fit), its best with DDP buckets, and flat
        # r=1 with DDP buckets, the baseline auto must clearly beat (by 3%, above this
        # machine's step-to-step noise) or fall back to; two untimed rounds (with one, r=1's
        # large buffers were still warming up: its steps ran 13-25% slower than later ones),
        # then two timed; the agreed timings calibrate the model before any timed step
        # The model's two best micro-batch counts (flat or hierarchical), gradients in DDP's
        # buckets: overlapped_block hands them to autograd only once the block's backward is done.
        micro_plans = sorted(
            ((Choice(PipelineDegrees(1, 1), h, m), False) for h in (False, True) for m in range(2, 9)),
            key=lambda c: self.parts(*c)[0],
        )[:2]
        candidates = [*((c, True) for c in self.plan.ranked(3)), (self.plan.choice, False), *micro_plans, FLAT1]
        tuner = OnlineTuner(self.world.comm, candidates, trials=2, baseline=FLAT1, margin=0.03, warmup=2)
        while tuner.chosen is None:
            tuner.observe(self.step(*tuner.current))
        return tuner, micro_plans

    def bounds(self, auto: Plan) -> Bounds:
        """Each part of `auto`'s step timed apart, for the lower bounds."""
        # The chosen exchange's communication alone (same chunks, the experts replaced by the
        # identity; chunked transfers cross the shaped link faster than one large one, so
        # unchunked timings would not bound it) plus the dense all-reduce, against the experts'
        # and dense layers' compute alone. A micro-batched auto is timed over as many equal
        # chunks.
        comm = self.world.comm
        exchange = self.hier if auto[0].hierarchical else comm
        degrees = auto[0].degrees if auto[0].microbatches == 1 else PipelineDegrees.of(auto[0].microbatches)
        xb = torch.randn(TOKENS * TOP_K, D_MODEL, requires_grad=True)

        def timed(run: Callable[[], object]) -> tuple[float, float]:
            """(wall, CPU) seconds of `run` on this rank; CPU counts every thread of the process."""
            comm.barrier()
            begin, cpu = time.perf_counter(), time.process_time()
            run()
            return time.perf_counter() - begin, time.process_time() - cpu

        # and the CPU time the exchange alone costs this rank (gloo's threads and the kernel's
        # TCP work in its syscalls): on this machine that CPU is taken from the cores the experts
        # compute on, which a cluster's NICs would spare
        runs: list[list[float]] = [[], [], [], []]
        exchange_cpu: list[float] = []
        for _ in range(3):
            for k, run in enumerate(
                (
                    lambda: (
                        pipelined_exchange(xb, self.counts, lambda x, c: x * 1.0, exchange, degrees).sum().backward()
                    ),
                    lambda: comm.all_reduce(torch.zeros(self.dense_bytes // 4)),
                    lambda: (
                        self.experts_mlp(xb.detach().requires_grad_(), self.balanced(TOKENS * TOP_K)).sum().backward()
                    ),
                    lambda: self.dense_only(self.tokens.detach().requires_grad_()).sum().backward(),
                )
            ):
                wall, cpu = timed(run)
                runs[k].append(wall)
                if k == 0:
                    exchange_cpu.append(cpu)
        mine = torch.tensor([sorted(r)[1] for r in [*runs, exchange_cpu]], dtype=torch.float64)
        return Bounds(*torch.stack(comm.all_gather(mine)).max(0).values.tolist())  # type: ignore[arg-type]

    def trace(self, auto: Plan) -> None:
        tracer = Tracer()
        self.step(*auto, tracer)
        spans = gather(self.world.comm, tracer)
        if spans is not None:
            path = self.args.trace.replace("RATE", self.args.rate)
            write_chrome_trace(path, spans)
            draw_timeline(path.replace(".json", "") + ".png", spans, f"auto at {self.args.rate}")
