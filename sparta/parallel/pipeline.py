"""Pipeline stages: which layers each stage holds, how a stage module is cut from the model,
and the schedule's action list, all as data that can be inspected before anything runs.

The schedules are torch.distributed.pipelining's, by name. A rank holds one stage under
GPipe and 1F1B, ``stages_per_rank`` of them under the others: looped (stage ``r + k * pp``)
for Interleaved1F1B, LoopedBFS and InterleavedZeroBubble, a "V" (stages ``r`` and
``2 * pp - 1 - r``) for ZBVZeroBubble and DualPipeV.

A stage module is a deep copy of the whole model with the other stages' layers deleted and
the first/last stage's extras set to None (torchtitan's split; nothing is traced), so its
parameter names are the full model's. The model must follow the convention of
`sparta.parallel.Decoder` (see there): a ``layers`` ModuleDict, the children registered
before it run on the first stage, those after it on the last; children without parameters
(a rotary-embedding cache) stay on every stage.

Stage shapes: torch's PipelineStage infers the shapes it sends once, at the first step, so
`ParallelModel` pads every batch to one sequence length (see parallelize.py).
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.distributed.pipelining.schedules as torch_schedules
from torch import nn

from sparta.errors import ConfigError

# name -> how stages map to ranks ("loop" or "v"); one stage per rank when "single"
SCHEDULES: dict[str, str] = {
    "GPipe": "single",
    "1F1B": "single",
    "Interleaved1F1B": "loop",
    "LoopedBFS": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}
# schedules that compute weight gradients with autograd.grad: AccumulateGrad hooks do not fire
ZERO_BUBBLE = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"})


def check_schedule(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> None:
    """ConfigError unless ``schedule`` can run ``pp`` ranks x ``stages_per_rank`` stages with
    ``microbatches`` micro-batches. Pure: no collective."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule={schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"microbatches={microbatches!r} must be a positive integer")
    style = SCHEDULES[schedule]
    if style == "single" and stages_per_rank != 1:
        raise ConfigError(
            f"schedule={schedule!r} runs one stage per rank, but stages_per_rank={stages_per_rank}: pass "
            "stages_per_rank=1, or an interleaved schedule (Interleaved1F1B) for virtual stages"
        )
    if style == "v" and stages_per_rank != 2:
        raise ConfigError(f"schedule={schedule!r} places two stages on each rank (a V): pass stages_per_rank=2")
    if style == "loop" and stages_per_rank < 1:
        raise ConfigError(f"stages_per_rank={stages_per_rank} must be >= 1")
    if style != "single" and microbatches < pp:
        raise ConfigError(
            f"schedule={schedule!r} needs at least as many micro-batches as pipeline ranks: microbatches="
            f"{microbatches} < pp={pp}; raise microbatches (or the batch) to {pp} or more"
        )
    try:
        action_table(schedule, pp, microbatches, stages_per_rank)
    except (ValueError, AssertionError, RuntimeError) as exc:  # torch's own check of the combination
        raise ConfigError(
            f"schedule={schedule!r} cannot run pp={pp}, stages_per_rank={stages_per_rank}, "
            f"microbatches={microbatches}: {exc}"
        ) from exc


def stage_ids(schedule: str, pp: int, pp_rank: int, stages_per_rank: int) -> list[int]:
    """Global indices of the stages pipeline rank ``pp_rank`` holds, in its order."""
    n = pp * stages_per_rank
    if SCHEDULES[schedule] == "v":
        return [pp_rank, n - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def stage_owner(schedule: str, pp: int, stage: int, stages_per_rank: int) -> int:
    """The pipeline rank that holds global stage ``stage`` (the inverse of `stage_ids`)."""
    n = pp * stages_per_rank
    if not 0 <= stage < n:
        raise ConfigError(f"stage {stage} is not one of the {n} stages (0..{n - 1})")
    if SCHEDULES[schedule] == "v":
        return stage if stage < pp else n - 1 - stage
    return stage % pp


class _StageShape:
    """What a schedule's constructor reads from a stage to lay out its actions."""

    def __init__(self, index: int, num_stages: int, pp: int, pp_rank: int) -> None:
        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = pp, pp_rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = nn.Module()


def schedule_actions(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> dict[int, list[str]]:
    """The action list of every pipeline rank, without running anything (no process group).

    Actions read as torch writes them: ``<stage><F|B|I|W><micro-batch>`` (I and W: the input
    and weight halves of a zero-bubble backward), e.g. ``{0: ["0F0", "0F1", "0B0", ...]}``.
    """
    return {rank: list(actions) for rank, actions in action_table(schedule, pp, microbatches, stages_per_rank).items()}


@functools.lru_cache(maxsize=1024)
def action_table(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> Mapping[int, tuple[str, ...]]:
    """`schedule_actions`, read-only and built once per shape: torch builds the table anew at
    each call, which took half of a plan search's time (the search asks for each shape
    thousands of times; a zero-bubble table's send, receive and unshard passes are the dear
    part, and at 64 ranks x 512 micro-batches one table takes torch 10-20 s)."""
    cls = torch_schedules.get_schedule_class(schedule)
    n = pp * stages_per_rank
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        order = cls(_StageShape(0, n, pp, 0), microbatches).pipeline_order  # type: ignore[arg-type]
        assert order is not None
        table = {
            rank: tuple(_forwards_in_order([str(a) for a in acts if a is not None]))
            for rank, acts in sorted(order.items())
        }
    else:
        shapes = [_StageShape(i, n, pp, 0) for i in stage_ids(schedule, pp, 0, stages_per_rank)]
        order = cls(shapes, microbatches).pipeline_order  # type: ignore[arg-type]
        assert order is not None
        table = {rank: tuple(str(a) for a in actions if a is not None) for rank, actions in sorted(order.items())}
    return MappingProxyType(table)


def _forwards_in_order(actions: list[str]) -> list[str]:
    """A one-stage rank runs its forwards in micro-batch order, as torch's step does; torch
    2.13's 1F1B table numbers the last rank's forwards from 1 ("1F1 1B0 ... 1F4" for 4
    micro-batches), so they are renumbered 0, 1, ... here."""
    forwards = iter(range(len(actions)))
    return [f"{a[: a.index('F')]}F{next(forwards)}" if "F" in a else a for a in actions]


def format_actions(actions: dict[int, list[str]]) -> str:
    """One line per rank: ``rank 0: 0F0 0F1 0B0 ...``."""
    return "\n".join(f"rank {rank}: {' '.join(acts)}" for rank, acts in actions.items())


@dataclass(frozen=True)
class ModelParts:
    """How a convention-following model divides: children before ``layers`` (first stage),
    the layer names in order, children after (last stage), parameter-free children (every stage)."""

    first: tuple[str, ...]
    layers: tuple[str, ...]
    last: tuple[str, ...]
    shared: tuple[str, ...]

    @classmethod
    def of(cls, model: nn.Module) -> ModelParts:
        """``model``'s children before ``layers``, its layers, and those after; ConfigError when it has no
        ``layers`` ModuleDict."""
        children = dict(model.named_children())
        layers = children.get("layers")
        if not isinstance(layers, nn.ModuleDict) or not len(layers):
            raise ConfigError(
                f"{type(model).__name__} has no `layers` nn.ModuleDict: parallelize cuts models laid out as "
                "sparta.parallel.Decoder (or a sparta.parallel.hf adapter) into pipeline stages"
            )
        names = list(children)
        at = names.index("layers")
        # parameter-free children before the layers (rotary tables, dropout) run on every
        # stage; after the layers everything is the last stage's (a final norm without
        # weights included, which every stage would otherwise apply)
        shared = tuple(n for n in names[:at] if not any(True for _ in children[n].parameters()))
        first = tuple(n for n in names[:at] if n not in shared)
        last = tuple(names[at + 1 :])
        return cls(first, tuple(f"layers.{k}" for k in layers), last, shared)


def tied_across_parts(model: nn.Module, parts: ModelParts) -> tuple[str, str] | None:
    """Two parameter names of ``model`` that share one tensor across its parts (a child before
    or after the layers, or a layer), or None. Pipeline stages hold deep copies of their
    parts, so such a tie would come apart into two parameters that train apart. Pure."""
    named = [*parts.first, *parts.layers, *parts.last]
    seen: dict[int, tuple[str, str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        part = next((p for p in named if name.startswith(p + ".")), name.split(".")[0])
        other = seen.setdefault(id(param), (part, name))
        if other[0] != part:
            return other[1], name
    return None


def split_by_points(parts: ModelParts, num_stages: int, split_points: Sequence[str]) -> list[list[str]]:
    """Layers of each stage, cut where ``split_points`` (layer names, e.g. "layers.2") begin."""
    unknown = [p for p in split_points if p not in parts.layers]
    if unknown:
        raise ConfigError(f"split_points {unknown} name no layer; the layers are {', '.join(parts.layers)}")
    starts = [parts.layers.index(p) for p in split_points]
    if len(starts) != num_stages - 1 or starts != sorted(set(starts)) or (starts and starts[0] == 0):
        raise ConfigError(
            f"split_points {list(split_points)} must name {num_stages - 1} distinct layers in increasing order, "
            f"after the first ({parts.layers[0]}), to cut {num_stages} stages each holding at least one layer"
        )
    bounds = [0, *starts, len(parts.layers)]
    return [list(parts.layers[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


def split_by_cost(parts: ModelParts, num_stages: int, costs: dict[str, float]) -> list[list[str]]:
    """Contiguous layers per stage minimising the slowest stage, counting the first stage's
    extras (embeddings) and the last's (norm, head): ``costs`` maps layer and child names to
    seconds. Exact dynamic programme over cut positions (layers x stages is small)."""
    layers = parts.layers
    if num_stages > len(layers):
        raise ConfigError(
            f"{num_stages} pipeline stages (pp x stages_per_rank) but the model has {len(layers)} layers: every "
            "stage needs one; lower pp or stages_per_rank"
        )
    head = sum(costs[n] for n in parts.first)
    tail = sum(costs[n] for n in parts.last)
    prefix = [0.0]
    for name in layers:
        prefix.append(prefix[-1] + costs[name])

    def stage_cost(a: int, b: int, index: int) -> float:
        return prefix[b] - prefix[a] + (head if index == 0 else 0.0) + (tail if index == num_stages - 1 else 0.0)

    n = len(layers)
    # best[s][b]: the slowest stage when layers[:b] form stages 0..s-1
    best = [[float("inf")] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for b in range(s, n - (num_stages - s) + 1):
            for a in range(s - 1, b):
                value = max(best[s - 1][a], stage_cost(a, b, s - 1))
                if value < best[s][b]:
                    best[s][b], cut[s][b] = value, a
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return [list(layers[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


def measure_costs(model: nn.Module, sample: torch.Tensor, repeats: int = 3) -> dict[str, float]:
    """Seconds of forward + backward of the first stage's extras (all charged to the first of
    them), each layer, and each last-stage child of ``model`` on ``sample`` ids [B, T]: the
    median of ``repeats``, on this process alone. A proxy: MLPs not yet MoE, no communication."""
    parts = ModelParts.of(model)
    costs = dict.fromkeys(parts.first, 0.0)

    def timed(fn: nn.Module, x: torch.Tensor) -> tuple[float, torch.Tensor]:
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            y = fn(x)
            y.float().square().mean().backward()
            runs.append(time.perf_counter() - start)
        return sorted(runs)[len(runs) // 2], y.detach()

    h = sample
    if parts.first:
        costs[parts.first[0]], h = timed(stage_module(model, parts, [], first=True, last=False), sample)
    for name in parts.layers:
        # through the model's own forward: a layer may need what it computes (rotary angles)
        costs[name], h = timed(stage_module(model, parts, [name], first=False, last=False), h)
    for name in parts.last:
        costs[name], h = timed(model.get_submodule(name), h)
    model.zero_grad(set_to_none=True)
    return costs


def stage_module(model: nn.Module, parts: ModelParts, layers: Sequence[str], first: bool, last: bool) -> nn.Module:
    """A deep copy of ``model`` holding only ``layers`` (and the first/last stage's extras)."""
    module = copy.deepcopy(model)
    for name in parts.layers:
        if name not in layers:
            _drop(module, name)
    for name in () if first else parts.first:
        _drop(module, name)
    for name in () if last else parts.last:
        _drop(module, name)
    return module


def _drop(module: nn.Module, name: str) -> None:
    parent, _, attr = name.rpartition(".")
    owner = module.get_submodule(parent)
    if isinstance(owner, nn.ModuleDict):
        del owner[attr]
    else:
        setattr(owner, attr, None)
