"""The suites folded in from the scripts under benchmarks/ (moe.py: moe-layer from
benchmarks/moe_layer.py, pipeline from benchmarks/moe_pipeline.py's plans on the launched ranks,
dispatch; embedding.py: embedding from benchmarks/embedding.py), and the hook for `trainer`.

trainer   the 3D trainer's step (benchmarks/trainer.py, being written). A module
          `sparta_tools.bench.trainer` with `add_arguments(parser)`, `check(extra)` and
          `run(ctx)` (as every suite here) is picked up by `folded()`; until it exists,
          `sparta bench trainer` records why it skipped.
"""

from __future__ import annotations

import argparse
import importlib

from sparta_tools.bench.options import BenchOptions
from sparta_tools.bench.runner import BenchContext, Suite


def _no_flags(_: argparse.ArgumentParser) -> None:
    return None


def _no_check(_: BenchOptions) -> None:
    return None


def _trainer_missing(ctx: BenchContext) -> None:
    ctx.skip("not written yet: sparta_tools/bench/trainer.py (add_arguments, check, run) is the hook",
             candidate="trainer")  # fmt: skip


def trainer_suite() -> Suite:
    help_ = "the 3D trainer's step: pipeline x data x tensor (+ expert) parallel"
    try:
        module = importlib.import_module("sparta_tools.bench.trainer")
    except ModuleNotFoundError:
        return Suite("trainer", help_, _no_flags, _no_check, _trainer_missing, engines=("torch",))
    return Suite("trainer", help_, module.add_arguments, module.check, module.run, engines=("torch",))


def folded() -> list[Suite]:
    from sparta_tools.bench import embedding, moe

    return [
        Suite("moe-layer", "one MoE layer forward+backward: Sparta, DeepSpeed-MoE, a naive loop, the dense floor",
              moe.add_layer_arguments, moe.check_layer, moe.run_layer, engines=("torch",)),
        Suite("pipeline", "the co-scheduler's plans: pipeline degrees of the expert-parallel exchange, and auto",
              moe.add_pipeline_arguments, moe.check_pipeline, moe.run_pipeline, engines=("torch",)),
        Suite("dispatch", "route + dispatch + combine alone, by routing skew (Zipf bias on the router)",
              moe.add_dispatch_arguments, moe.check_dispatch, moe.run_dispatch, engines=("torch",)),
        Suite("embedding", "a step of a large-table model: DDP, Horovod sparse/dense, Sparta row/column sharding",
              embedding.add_arguments, embedding.check, embedding.run, engines=("torch", "horovod")),
        trainer_suite(),
    ]  # fmt: skip
