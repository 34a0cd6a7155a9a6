"""`sparta bench trainer`: the 3D trainer's candidates (trainer.py) on the ranks of one launch.

    sparta bench trainer --nprocs 2 --layouts dp2,tp2,pp2_1f1b --models dense -n 7 -w 2 -J run.jsonl

runs each named layout whose world size is the launch's (others are recorded as skipped,
with the --nprocs they need): its candidates alternating (-w untimed steps each, then -n
rounds in a rotated order, a barrier before each step). Each point's ``wrong`` compares the
variant's first-step loss (the mean over the global batch) with one process's forward of the
same model on the same batch (1e-5); later steps train on, so only the first is checked.
``--device cuda``: every candidate on its rank's GPU (one GPU per rank).
torchtitan is benchmarks/trainer.py's alone (its CPU patches stay out of Sparta's processes).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sparta.errors import ConfigError
from sparta_tools.bench.options import SuiteFlags, check_subset, comma_names
from sparta_tools.bench.rank import BenchContext
from sparta_tools.bench.trainer import (
    LAYOUTS,
    SIZES,
    TOL,
    LayoutSpec,
    ModelShape,
    SpartaRun,
    Step,
    build_step,
    local_batch,
    oracle,
    plan_candidates,
)

SUITE_CANDIDATES = ("eager", "ddp", "sparta", "sparta_ep", "sparta_experts_whole", "sparta_head_whole", "sparta_ddp")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated: {', '.join(LAYOUTS)}")
    parser.add_argument("--size", default="debug", help=f"model sizes: {', '.join(SIZES)} (tiny: for tests)")
    default = "eager,ddp,sparta,sparta_ep,sparta_experts_whole,sparta_head_whole"
    parser.add_argument("--candidates", default=default, help=f"of {', '.join(SUITE_CANDIDATES)}")


@dataclass(frozen=True)
class TrainerFlags(SuiteFlags):
    """`trainer`: the models (of the --size's), the layouts (of LAYOUTS), the model size (of
    SIZES) and the candidates (of SUITE_CANDIDATES)."""

    models: tuple[str, ...]
    layouts: tuple[str, ...]
    size: str
    candidates: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ConfigError(f"--size {self.size!r}: choose one of {', '.join(SIZES)}")
        check_subset(self.models, tuple(SIZES[self.size]), "--models")
        check_subset(self.layouts, tuple(LAYOUTS), "--layouts")
        check_subset(self.candidates, SUITE_CANDIDATES, "--candidates")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainerFlags:
        return cls(models=comma_names(args.models), layouts=comma_names(args.layouts), size=args.size,
                   candidates=comma_names(args.candidates))  # fmt: skip


class _Stepper:
    """One candidate as the suite calls it: each call trains on the next batch and returns
    that step's loss; ``steps`` counts the calls (the first is the one the oracle checks)."""

    def __init__(self, step: Step, shape: ModelShape, dp: int, dp_rank: int, device: torch.device) -> None:
        self.step, self.shape, self.dp, self.dp_rank, self.steps = step, shape, dp, dp_rank, 0
        self.device = device

    def __call__(self) -> float:
        ids, targets = local_batch(self.shape, self.dp, self.dp_rank, self.steps)
        # float(loss) inside the step waits for the device, so the wall clock times its work
        loss = self.step(ids.to(self.device), targets.to(self.device))
        self.steps += 1
        return loss


def run(ctx: BenchContext) -> None:
    """Every rank: each asked-for layout of ctx.size ranks, each model, its candidates timed together."""
    from sparta.parallel import ParallelDims, build_layout

    torch.set_num_threads(1)
    flags = ctx.opts.flags_as(TrainerFlags)
    ctx.skip("benchmarks/trainer.py times it: its CPU patches run in processes of their own", candidate="torchtitan")
    for layout_name in flags.layouts:
        spec = LAYOUTS[layout_name]
        if spec.world_size != ctx.size:
            ctx.skip(f"needs {spec.world_size} ranks: --nprocs {spec.world_size}", layout=layout_name)
            continue
        layouts: dict[int, Any] = {}

        def layout_for(ep: int, spec: LayoutSpec = spec, layouts: dict[int, Any] = layouts) -> Any:
            if ep not in layouts:
                dims = ParallelDims(pp=spec.pp, dp=spec.dp, tp=spec.tp, ep=ep)
                layouts[ep] = build_layout(dims, ctx.world, ctx.opts.device)
            return layouts[ep]

        for model in flags.models:
            _time_model(ctx, SIZES[flags.size][model], spec, list(flags.candidates), layout_for)


def _time_model(
    ctx: Any, shape: ModelShape, spec: LayoutSpec, wanted: list[str], layout_for: Callable[[int], Any]
) -> None:
    names, _ = plan_candidates(shape, spec, wanted)
    dp_rank, device = layout_for(1).dp_rank, layout_for(1).device
    built = {name: build_step(name, shape, spec, layout_for, device) for name in names}
    calls = {name: _Stepper(step, shape, spec.dp, dp_rank, device) for name, step in built.items()}
    want, params = oracle(shape, spec.dp)

    def check_loss(name: str, loss: float) -> int:
        # only the first step has a one-process oracle: later ones have trained on
        if calls[name].steps != 1:
            return 0
        expected = float(ctx.plant(torch.tensor([want], dtype=torch.float64))[0])  # --_plant-wrong proves it fails
        return int(not abs(loss - expected) <= TOL)  # NaN counts as wrong

    tokens = spec.dp * shape.batch * shape.seq_len
    base = {
        "model": shape.name,
        "layout": spec.name,
        "params": params,
        "oracle_loss": round(want, 6),
        "pp": spec.pp,
        "dp": spec.dp,
        "tp": spec.tp,
        "tokens_per_step": tokens,
    }
    ctx.time_points(
        base,
        calls,
        check_loss,
        lambda seconds: {
            "tokens_per_s": round(tokens / seconds, 1),
            "tokens_per_s_per_rank": round(tokens / seconds / ctx.size, 1),
        },
    )
    for step in built.values():
        if isinstance(step, SpartaRun):
            step.pm.close()
