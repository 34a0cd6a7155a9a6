"""Suites `moe-layer`, `pipeline` and `dispatch`: the MoE layer and its parts, checked and timed.

moe-layer  benchmarks/moe_layer.py's candidates (moe_candidates.py: dense floor, naive loop,
           DeepSpeed-MoE dropless and capacity 1.25, Sparta dropless, capacity 1.25 and
           tuned-pipelined) on the launched ranks: one process, or experts spread over every
           rank (T tokens split over them). Each step is forward + backward. Before timing
           and after it, each dropless candidate's forward output is compared with the one-
           process dropless Sparta layer on the whole input (same seeded weights), within
           --atol/--rtol (defaults by dtype); the dense floor (another function) and the
           capacity candidates (drops depend on each rank's tokens) are recorded unchecked,
           saying why. Fields: ratio_to_dense (median over the dense floor's), imbalance (rows
           of the busiest rank over the mean: the floor routing sets for any dropless layer).
           Tutel is not on PyPI: a `skipped` record says so.
pipeline   the co-scheduler's plans on the same layer: pipeline degrees given by --degrees
           (`1`, `2`, `4,8`, `8,8,2`, and `auto`: sparta.moe.tune_schedule's choice, tuned
           before timing), each checked against the same reference. Expert parallel only.
           benchmarks/moe_pipeline.py stays the driver for an emulated cluster (root).
dispatch   route + dispatch + experts + combine with no communication and no GEMMs, by
           routing skew: the router's logits get a Zipf bias of exponent s (--skews) over a
           seeded order of the experts, so that hot experts take more rows; expert e scales its
           rows by e + 1, so the oracle, x * sum_k w_k (e_k + 1), catches a row sent to the
           wrong expert. Variants: sparta (plan_dispatch / dispatch / combine) and the naive
           per-expert mask loop.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass, replace
from typing import Any

import torch

from sparta.errors import ConfigError
from sparta_tools.bench.moe_candidates import (
    AUX_LOSS_COEF,
    CANDIDATES,
    CONFIGS,
    EP_CANDIDATES,
    GPU_CONFIGS,
    TOLERANCE,
    UNCHECKED,
    BenchConfig,
    Place,
    all_configs,
    build,
    busiest_rank_load,
    make_input,
    reference_output,
    wrong_values,
)
from sparta_tools.bench.options import BenchOptions, SuiteFlags, comma_names, comma_numbers, human_size
from sparta_tools.bench.rank import BenchContext

SUITE_CONFIGS = {**CONFIGS, **GPU_CONFIGS, "tiny": BenchConfig("tiny", tokens=256, d_model=64, d_ff=128, num_experts=4)}
DISPATCH_VARIANTS = ("sparta", "naive")


def add_layer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="small", help=f"{', '.join(SUITE_CONFIGS)} or all (tiny: for tests)")
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated (dense is always timed)")
    parser.add_argument("--zero-grad", action="store_true", help="drop parameter gradients before each step")
    parser.add_argument("--atol", type=float, default=0.0, help="output check's absolute tolerance (0: by dtype)")
    parser.add_argument("--rtol", type=float, default=0.0, help="output check's relative tolerance (0: by dtype)")


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="small", help=f"{', '.join(SUITE_CONFIGS)} or all")
    parser.add_argument("--degrees", default="1;2;4;8,8,2;auto", help="';'-separated pipeline degrees, or auto")
    parser.add_argument("--atol", type=float, default=0.0)
    parser.add_argument("--rtol", type=float, default=0.0)


def add_dispatch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skews", default="0,1.1,2", help="Zipf exponents of the routing bias (0: none)")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=256, help="row width; tokens = size / (d_model * dtype)")
    parser.add_argument("--variants", default="sparta,naive")


@dataclass(frozen=True)
class MoEFlags(SuiteFlags):
    """What `moe-layer` and `pipeline` share: the layer's --config (a name of SUITE_CONFIGS, or
    all) and the output check's tolerances (0: by dtype)."""

    config: str
    atol: float
    rtol: float

    def __post_init__(self) -> None:
        if self.config != "all" and self.config not in SUITE_CONFIGS:
            raise ConfigError(f"--config {self.config!r}: use one of {', '.join(SUITE_CONFIGS)} or all")


@dataclass(frozen=True)
class MoELayerFlags(MoEFlags):
    """`moe-layer`: the candidates to time beside the dense floor, and --zero-grad."""

    candidates: tuple[str, ...]
    zero_grad: bool

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [c for c in self.candidates if c not in CANDIDATES]
        if unknown:
            raise ConfigError(f"--candidates: unknown {unknown}; known: {', '.join(CANDIDATES)}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MoELayerFlags:
        return cls(config=args.config, atol=args.atol, rtol=args.rtol, candidates=tuple(args.candidates.split(",")),
                   zero_grad=args.zero_grad)  # fmt: skip


@dataclass(frozen=True)
class PipelineFlags(MoEFlags):
    """`pipeline`: the pipeline degrees to time, each as `sparta profile` takes one (an int, a
    (forward, backward[, taper]) tuple, or "auto")."""

    degrees: tuple[int | tuple[int, ...] | str, ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.degrees:
            raise ConfigError("--degrees is empty; e.g. --degrees '1;4;auto'")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PipelineFlags:
        from sparta_tools.profile import parse_degree

        parts = [part.strip() for part in args.degrees.split(";")]
        degrees = tuple(parse_degree(part, "--degrees") for part in parts if part)
        return cls(config=args.config, atol=args.atol, rtol=args.rtol, degrees=degrees)


def _skews_error(text: str) -> ConfigError:
    return ConfigError(f"--skews {text!r}: comma-separated Zipf exponents >= 0, e.g. 0,1.1,2")


@dataclass(frozen=True)
class DispatchFlags(SuiteFlags):
    """`dispatch`: the Zipf exponents of the routing bias (--skews, 0: none), the router's
    experts and top-k, the row width, and the variants (of DISPATCH_VARIANTS)."""

    skews: tuple[float, ...]
    experts: int
    top_k: int
    d_model: int
    variants: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.skews or any(s < 0 for s in self.skews):
            raise _skews_error(",".join(f"{s:g}" for s in self.skews))
        if not 1 <= self.top_k <= self.experts:
            raise ConfigError(f"--top-k {self.top_k} with --experts {self.experts}: need 1 <= top_k <= experts")
        if self.d_model < 1:
            raise ConfigError(f"--d-model {self.d_model}: give a row width >= 1")
        bad = [v for v in self.variants if v not in DISPATCH_VARIANTS]
        if bad or not self.variants:
            raise ConfigError(f"--variants {bad}: use sparta and/or naive")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DispatchFlags:
        return cls(skews=comma_numbers(args.skews, float, _skews_error), experts=args.experts, top_k=args.top_k,
                   d_model=args.d_model, variants=comma_names(args.variants))  # fmt: skip


def _configs(opts: BenchOptions, zero_grad: bool = False) -> list[BenchConfig]:
    name = opts.flags_as(MoEFlags).config
    chosen = all_configs(opts.device) if name == "all" else [SUITE_CONFIGS[name]]
    return [replace(c, zero_grad=zero_grad, device=opts.device, dtype=opts.dtype) for c in chosen]


def check_dtype(opts: BenchOptions) -> None:
    """The MoE layer suites' check of the whole run: a dtype the output check has tolerances for."""
    if opts.dtype not in TOLERANCE:
        raise ConfigError(f"-d {opts.dtype}: the MoE suites take {' or '.join(TOLERANCE)}")


def check_dispatch(opts: BenchOptions) -> None:
    """`dispatch`'s check of the whole run: a floating dtype."""
    if not opts.torch_dtype.is_floating_point:
        raise ConfigError(f"-d {opts.dtype}: dispatch moves activations; use a floating dtype")


# ------------------------------------------------------------------------------ layer suites
def _tolerance(ctx: BenchContext) -> tuple[float, float]:
    atol, rtol = TOLERANCE[ctx.opts.dtype]
    flags = ctx.opts.flags_as(MoEFlags)
    return flags.atol or atol, flags.rtol or rtol


def _output_check(ctx: BenchContext, steps: dict[str, Any], reference: torch.Tensor) -> Any:
    atol, rtol = _tolerance(ctx)

    def check(name: str, _result: Any) -> int:
        with torch.no_grad():
            y = steps[name].forward().detach()
        return wrong_values(y, ctx.plant(reference), atol, rtol)

    return check


def _ratio_to_dense(load: float | None) -> Any:
    def annotate(points: list[dict[str, Any]]) -> None:
        dense = next((p["median_us"] for p in points if p["variant"] == "dense"), None)
        for p in points:
            p["ratio_to_dense"] = round(p["median_us"] / dense, 4) if dense else None
            if load is not None:
                p["imbalance"] = round(load, 4)

    return annotate


def _layer_base(cfg: BenchConfig, n: int) -> dict[str, Any]:
    return {"op": "moe_layer", "config": cfg.name, "tokens": cfg.tokens, "tokens_per_rank": cfg.tokens // n,
            "d_model": cfg.d_model, "d_ff": cfg.d_ff, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
            "dtype": cfg.dtype}  # fmt: skip


def _fits(ctx: BenchContext, cfg: BenchConfig) -> bool:
    n = ctx.size
    if cfg.num_experts % n or cfg.tokens % n:
        ctx.skip(f"{n} ranks must divide {cfg.num_experts} experts and {cfg.tokens} tokens", config=cfg.name)
        return False
    return True


def run_layer(ctx: BenchContext) -> None:
    n, rank = ctx.size, ctx.rank
    flags = ctx.opts.flags_as(MoELayerFlags)
    wanted = ["dense", *(c for c in flags.candidates if c != "dense")]
    ctx.skip("Tutel is not on PyPI (github.com/microsoft/tutel); not installed here", candidate="tutel")
    for cfg in _configs(ctx.opts, flags.zero_grad):
        if not _fits(ctx, cfg):
            continue
        place = Place(ctx.comm if n > 1 else None)
        x = make_input(cfg, rank, n)
        steps: dict[str, Any] = {}
        for name in wanted:
            if n > 1 and name not in EP_CANDIDATES:
                ctx.skip("holds every expert: one process only", candidate=name, config=cfg.name)
                continue
            if name.startswith("deepspeed") and n > 1 and ctx.engine != "torch":
                ctx.skip("DeepSpeed runs on torch.distributed: use --engines torch", candidate=name, config=cfg.name)
                continue
            built = build(name, cfg, x, place)
            if isinstance(built, str):
                ctx.skip(built, candidate=name, config=cfg.name)
                continue
            steps[name] = built
        reference = reference_output(cfg, rank, n)
        load = busiest_rank_load(cfg, n) if n > 1 else None
        ctx.time_points(
            _layer_base(cfg, n),
            steps,
            _output_check(ctx, steps, reference),
            lambda _s: {},
            unchecked={k: v for k, v in UNCHECKED.items() if k in steps},
            annotate=_ratio_to_dense(load),
        )


def _layer_step(layer: Any, x: torch.Tensor) -> Any:
    """Forward + backward of `layer` on `x` (a step of moe_candidates' kind: `.forward()` too)."""
    grad = torch.randn_like(x)

    def step() -> None:
        x.grad = None
        layer(x).backward(grad)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)

    step.forward = lambda: layer(x)  # type: ignore[attr-defined]
    return step


def run_pipeline(ctx: BenchContext) -> None:
    from sparta.moe import MoELayer, tune_schedule

    n, rank = ctx.size, ctx.rank
    if n < 2:
        ctx.skip("expert parallel only: one rank has no exchange to pipeline (use --nprocs 2 or more)", op="pipeline")
        return
    for cfg in _configs(ctx.opts):
        if not _fits(ctx, cfg):
            continue
        x = make_input(cfg, rank, n)
        steps: dict[str, Any] = {"dense": build("dense", cfg, x, Place(ctx.comm))}
        for degree in ctx.opts.flags_as(PipelineFlags).degrees:
            torch.manual_seed(0)  # the weights of moe_candidates' layers: the reference's
            layer = MoELayer(cfg.d_model, cfg.d_ff, cfg.num_experts, top_k=cfg.top_k, ep_size=n, comm=ctx.comm,
                             aux_loss_coef=AUX_LOSS_COEF,
                             pipeline_degree=1 if degree == "auto" else degree)  # fmt: skip
            layer = cfg.place(layer)
            if degree == "auto":
                layer.apply_schedule(tune_schedule(layer, x))  # tuned before anything is timed
            chosen = layer.degrees
            name = f"r={degree}" if degree != "auto" else f"auto ({chosen.forward},{chosen.backward},{chosen.taper})"
            steps[name] = _layer_step(layer, x)
        ctx.time_points(
            {**_layer_base(cfg, n), "op": "pipeline"},
            steps,
            _output_check(ctx, steps, reference_output(cfg, rank, n)),
            lambda _s: {},
            unchecked={"dense": UNCHECKED["dense"]},
            annotate=_ratio_to_dense(busiest_rank_load(cfg, n)),
        )


# ------------------------------------------------------------------------------ dispatch
def zipf_bias(experts: int, s: float, seed: int) -> torch.Tensor:
    """log of Zipf weights over a seeded order of the experts: added to the router's logits."""
    order = list(range(experts))
    random.Random(seed).shuffle(order)
    return torch.tensor([-s * math.log(order[e] + 1) for e in range(experts)])


def run_dispatch(ctx: BenchContext) -> None:
    from sparta.moe import combine, dispatch

    opts = ctx.opts
    flags = opts.flags_as(DispatchFlags)
    experts, k, d = flags.experts, flags.top_k, flags.d_model
    elem = torch.empty((), dtype=opts.torch_dtype).element_size()
    gen = torch.Generator().manual_seed(opts.seed)
    gate = torch.randn(experts, d, generator=gen).to(ctx.device) / math.sqrt(d)
    scale = torch.arange(1, experts + 1, device=ctx.device, dtype=torch.float32)
    for s in flags.skews:
        bias = zipf_bias(experts, s, opts.seed).to(ctx.device)
        for size in opts.sizes():
            tokens = max(1, size // (d * elem))
            x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(opts.seed * 31 + ctx.rank))
            x = x.to(device=ctx.device, dtype=opts.torch_dtype)

            def route(x: torch.Tensor = x, bias: torch.Tensor = bias) -> tuple[torch.Tensor, torch.Tensor]:
                probs = torch.softmax(x.float() @ gate.t() + bias, dim=-1)
                w, ids = torch.topk(probs, k, dim=-1)
                return ids, w / w.sum(-1, keepdim=True)

            def sparta_path(x: torch.Tensor = x, route: Any = route) -> torch.Tensor:
                ids, w = route()
                t = x.shape[0]
                token_idx = torch.arange(t, device=x.device).repeat_interleave(k)
                routed = dispatch(x, token_idx, ids.reshape(-1), w.reshape(-1), experts)
                row_scale = torch.repeat_interleave(scale, routed.counts).to(x.dtype)  # expert e: x (e + 1)
                return combine(routed.rows * row_scale.unsqueeze(1), routed, t)

            def naive_path(x: torch.Tensor = x, route: Any = route) -> torch.Tensor:
                ids, w = route()
                y = torch.zeros_like(x)
                for e in range(experts):
                    chosen = ids == e
                    rows = chosen.any(-1)
                    we = (w * chosen).sum(-1)[rows].unsqueeze(1).to(x.dtype)
                    y = y.index_put((rows,), we * x[rows] * (e + 1), accumulate=True)
                return y

            ids, w = route()
            want = (x.float() * (w * (ids + 1)).sum(-1, keepdim=True)).to(x.dtype)
            routed_per_expert = torch.bincount(ids.reshape(-1), minlength=experts).float()
            load = float(routed_per_expert.max() / routed_per_expert.mean())
            tol = 1e-5 if opts.torch_dtype in (torch.float32, torch.float64) else 2e-2
            paths = {"sparta": sparta_path, "naive": naive_path}

            def check(_name: str, y: torch.Tensor, want: torch.Tensor = want, tol: float = tol) -> int:
                want = ctx.plant(want)
                off = (y.float() - want.float()).abs()
                return int((~(off <= tol * (1 + want.float().abs()))).sum().item())  # NaN counts as wrong

            nbytes = tokens * d * elem
            ctx.time_points(
                {
                    "op": "dispatch",
                    "pattern": f"zipf-s{s:g}",
                    "bytes": nbytes,
                    "size": human_size(nbytes),
                    "tokens": tokens,
                    "experts": experts,
                    "top_k": k,
                    "dtype": opts.dtype,
                },  # fmt: skip
                {v: paths[v] for v in flags.variants},
                check,
                lambda _s, load=load: {"imbalance": round(load, 4)},
            )
