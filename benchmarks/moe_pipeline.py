"""Pipelined vs unpipelined expert-parallel exchange on an emulated 2-node cluster (needs root).

    python benchmarks/moe_pipeline.py --rates 300mbit,1gbit

For each rate: starts 2 emulated nodes x 2 ranks (sparta.scheduling.cluster), profiles the
links and the expert GEMMs, lets the cost model choose (r_fwd, r_bwd, flat or hierarchical),
then times forward+backward of the MoE exchange (dispatch, experts, combine; 8 experts,
top-2, d_model 512, d_ff 1024, 4096 tokens per rank, expert parallel over all 4) for flat
r=1 (what DeepSpeed-MoE does), hierarchical r=1 and the chosen plan, alternating, and the
lower bound max(communication, computation) from the measured parts. Rank 0 prints one JSON
line per rate. The router and the dense block are left out: they are the same in all three.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sparta.scheduling.cluster import ClusterConfig, EmulatedCluster  # noqa: E402

EXPERTS, TOP_K, D_MODEL, D_FF, TOKENS = 8, 2, 512, 1024, 4096


def worker(args: argparse.Namespace) -> None:
    import sparta
    from sparta.comm import HierarchicalAllToAll
    from sparta.scheduling.cost_model import CostModel, LayerShape
    from sparta.scheduling.pipeline import PipelineDegrees, pipelined_exchange
    from sparta.scheduling.profiler import ProfileConfig, Profiler
    from sparta.scheduling.trace import Tracer, gather, write_chrome_trace
    from sparta.scheduling.tuner import UNPIPELINED, OnlineTuner

    torch.set_num_threads(1)
    world = sparta.init(backend="torch", ranks_per_node=args.ranks_per_node)
    size, local = world.size, EXPERTS // world.size
    intra, inter = world.node_comms()
    hier = HierarchicalAllToAll(world.comm, intra, inter)
    mib = 2**20
    profiler = Profiler(
        world.comm,
        {"world": world.comm, "hier": hier},
        ProfileConfig(bytes=(mib, 4 * mib, 8 * mib), rows=(1024, 4096, 8192), repeats=2),
    )
    g = torch.Generator().manual_seed(world.rank)
    experts = torch.randint(0, EXPERTS, (TOKENS * TOP_K,), generator=g)
    counts = torch.bincount(experts, minlength=EXPERTS)
    rows = torch.randn(TOKENS * TOP_K, D_MODEL, generator=g)
    w1 = (torch.randn(local, D_MODEL, D_FF, generator=g) / D_MODEL**0.5).requires_grad_()
    w2 = (torch.randn(local, D_FF, D_MODEL, generator=g) / D_FF**0.5).requires_grad_()

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

    # the experts as this benchmark runs them (regrouping included), not a stand-in
    profile = profiler.collectives(("all_to_all",)) | profiler.forward_backward(
        f"{D_MODEL}x{D_FF}", lambda x: experts_mlp(x, balanced(x.shape[0])), D_MODEL
    )
    shape = LayerShape(tokens=TOKENS, top_k=TOP_K, d_model=D_MODEL, d_ff=D_FF, ep_size=size)
    model = CostModel(profile)
    plan = model.plan(shape, max_degree=8)
    flat1 = model.predict(shape, 1, hierarchical=False)

    def step(degrees: PipelineDegrees, hierarchical: bool, tracer: Tracer | None = None) -> float:
        x = rows.clone().requires_grad_()
        world.comm.barrier()
        begin = time.perf_counter()
        exchange = hier if hierarchical else world.comm
        y = pipelined_exchange(x, counts, experts_mlp, exchange, degrees, [w1, w2], tracer=tracer)
        y.backward(torch.ones_like(y))
        return time.perf_counter() - begin

    # online check: the model's two best choices against r=1, on real steps
    tuner = OnlineTuner(world.comm, [*plan.ranked(2), UNPIPELINED], trials=2)
    while tuner.chosen is None:
        tuner.observe(step(tuner.current.degrees, tuner.current.hierarchical))
    auto = tuner.chosen
    configs = {
        "flat_r1": (PipelineDegrees(1, 1), False),
        "hier_r1": (PipelineDegrees(1, 1), True),
        "model": (plan.degrees, plan.hierarchical),
        "auto": (auto.degrees, auto.hierarchical),
    }
    times: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(args.repeats):
        for name, cfg in configs.items():
            times[name].append(step(*cfg))

    # lower bound: the chosen exchange's communication alone (same chunks, the experts
    # replaced by the identity; chunked transfers cross the shaped link faster than one large
    # one, so unchunked timings would not bound it) and the experts' compute alone
    world.comm.barrier()
    begin = time.perf_counter()
    xb = rows.clone().requires_grad_()
    exchange = hier if auto.hierarchical else world.comm
    y = pipelined_exchange(xb, counts, lambda x, c: x * 1.0, exchange, auto.degrees)
    y.backward(torch.ones_like(y))
    comm_s = time.perf_counter() - begin
    xe = rows.clone().requires_grad_()
    begin = time.perf_counter()
    experts_mlp(xe, balanced(TOKENS * TOP_K)).sum().backward()
    compute_s = time.perf_counter() - begin
    bound = torch.tensor([comm_s, compute_s], dtype=torch.float64)
    bound = torch.stack(world.comm.all_gather(bound)).max(0).values  # type: ignore[arg-type]

    if args.trace:
        tracer = Tracer()
        step(auto.degrees, auto.hierarchical, tracer)
        spans = gather(world.comm, tracer)
        if spans is not None:
            write_chrome_trace(args.trace.replace("RATE", args.rate), spans)

    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    if world.rank == 0:
        lower = float(bound.max())
        predicted = plan.forward_s + plan.backward_s
        print(
            json.dumps(
                {
                    "rate": args.rate,
                    "step_s": {k: round(v, 3) for k, v in med.items()},
                    "model_choice": {
                        "r_fwd": plan.degrees.forward,
                        "r_bwd": plan.degrees.backward,
                        "hierarchical": plan.hierarchical,
                    },
                    "auto_choice": {
                        "r_fwd": auto.degrees.forward,
                        "r_bwd": auto.degrees.backward,
                        "hierarchical": auto.hierarchical,
                    },
                    "predicted_model_s": round(predicted, 3),
                    "prediction_error": round(predicted / med["model"] - 1, 3),
                    "predicted_flat_r1_s": round(flat1.forward_s + flat1.backward_s, 3),
                    "a2a_world_fit": {
                        "alpha_ms": round(profile.fits["all_to_all/world"].alpha * 1e3, 2),
                        "MB_per_s": round(1e-6 / max(profile.fits["all_to_all/world"].beta, 1e-15), 1),
                    },
                    "lower_bound_s": round(lower, 3),
                    "comm_s": round(float(bound[0]), 3),
                    "compute_s": round(float(bound[1]), 3),
                    "speedup_vs_flat_r1": round(med["flat_r1"] / med["auto"], 3),
                    "auto_over_bound": round(med["auto"] / lower, 3),
                    "fit_rel_error": {k: round(f.rel_error, 3) for k, f in profile.fits.items()},
                }
            ),
            flush=True,
        )
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
