"""The suites folded in from the scripts under benchmarks/, and the hook for `trainer`.

trainer   the 3D trainer's step (benchmarks/trainer.py, being written). A module
          `sparta_tools.bench.trainer` with `add_arguments(parser)`, `check(extra)` and
          `run(ctx)` (as every suite here) is picked up by `folded()`; until it exists,
          `sparta bench trainer` records why it skipped.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from sparta_tools.bench.runner import BenchContext, Suite


def _no_flags(_: argparse.ArgumentParser) -> None:
    return None


def _no_check(_: dict[str, Any]) -> None:
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
    return [trainer_suite()]
