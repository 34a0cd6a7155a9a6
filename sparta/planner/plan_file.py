"""The plan file `sparta plan` writes and `sparta train --plan` applies.

It is TOML: ``[plan]`` records the model it was made for and the prediction, ``[parallel]``
holds the fields `sparta train` applies on top of the run file (an MoE plan's block fields
as ``moe.overlap`` and ``moe.dedup`` under it).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from sparta.errors import ConfigError

from .costs import ModelCosts, model_fingerprint
from .search import GIB, Ranked
from .simulate import Workload


def _toml_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


PLAN_FIELDS = (
    "pp", "dp", "tp", "ep", "schedule", "microbatches", "stages_per_rank", "split_points", "data_parallel", "recompute",
    "vocab_stages", "embedding_stages", "embedding",
)  # fmt: skip
# written by later versions only: a plan file without them still reads (as their default)
_LATER_FIELDS = frozenset({"vocab_stages", "embedding_stages", "embedding"})
# an MoE plan's [parallel.moe] fields (written after the rest, as ``moe.overlap = 2``)
PLAN_MOE_FIELDS = ("overlap", "dedup")


def write_plan(path: str | Path, ranked: Ranked, work: Workload, world: int, costs: ModelCosts) -> None:
    """The plan file: what `sparta train --plan` applies, and what it was made for."""
    plan, pred = ranked.plan, ranked.prediction
    fields = {**dataclasses.asdict(plan.dims), **dataclasses.asdict(plan.config)}
    lines = [
        "# written by `sparta plan`; `sparta train --config RUN --plan THIS` applies [parallel] on top of RUN",
        "[plan]",
        f"world = {world}",
        f"global_batch = {work.global_batch}",
        f"predicted_step_s = {pred.step_s!r}",
        f"predicted_peak_gib = {pred.max_peak_bytes / GIB!r}",
        f"hardware = {_toml_value(json.dumps(costs.hardware, sort_keys=True))}",
        "",
        "[plan.model]",
        *(f"{k} = {_toml_value(v)}" for k, v in model_fingerprint(work.model, work.moe).items()),
        "",
        "[parallel]",
        *(f"{k} = {_toml_value(fields[k])}" for k in PLAN_FIELDS),
        *(f"moe.{k} = {_toml_value(getattr(plan.config.moe, k))}" for k in PLAN_MOE_FIELDS if plan.config.moe),
    ]
    Path(path).write_text("\n".join(lines) + "\n")


def plan_overrides(path: str | Path, work: Workload) -> list[str]:
    """The ``--set`` assignments a plan file stands for, after checking it was made for this
    model; ConfigError naming the mismatch otherwise. (A plan for another world size fails
    the trainer's own check: pp x dp x tp must equal the ranks running.)"""
    from sparta.parallel.config_file import read_file

    tree = read_file(path)
    meta, parallel = tree.get("plan"), tree.get("parallel")
    parallel = dict(parallel) if isinstance(parallel, dict) else None
    moe = parallel.pop("moe", {}) if parallel is not None else {}
    missing = set(PLAN_FIELDS) - set(parallel) if parallel is not None else set()
    if (
        not isinstance(meta, dict)
        or parallel is None
        or set(parallel) - set(PLAN_FIELDS)
        or missing - _LATER_FIELDS
        or not isinstance(moe, dict)
        or set(moe) - set(PLAN_MOE_FIELDS)
    ):
        raise ConfigError(f"{path} is not a plan file written by `sparta plan` (sections [plan] and [parallel])")
    want = model_fingerprint(work.model, work.moe)
    if meta.get("model") != want:
        diff = {k: (meta.get("model", {}).get(k), v) for k, v in want.items() if meta.get("model", {}).get(k) != v}
        raise ConfigError(f"{path} was made for another model: {diff} (plan, run); run `sparta plan` for this one")
    return [f"parallel.{k}={_toml_value(v)}" for k, v in parallel.items()] + [
        f"parallel.moe.{k}={_toml_value(v)}" for k, v in moe.items()
    ]
