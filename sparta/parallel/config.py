"""`RunConfig`: everything `sparta train` needs, as a tree of typed dataclasses loaded from TOML or YAML.

A run file has one table per section::

    [model]       DecoderConfig's fields (vocab_size, seq_len, d_model, n_layers, n_heads, d_ff)
    [parallel]    ParallelDims' fields (pp, dp, tp, ep) and ParallelConfig's (schedule,
                  microbatches, ...), side by side
    [parallel.moe]  MoESpec's fields (num_experts, top_k, ...); leave it out for a dense model
    [train]       TrainConfig: steps, global_batch, lr, warmup, weight decay, clipping, seed, eval
    [data]        DataConfig: source "stdlib" or "random"
    [checkpoint]  CheckpointConfig: dir, every, keep
    [output]      OutputConfig: metrics JSONL, Chrome trace, the peak FLOP/s behind the MFU

The leaves of [model] and [parallel] are the core's own dataclasses (`DecoderConfig`,
`ParallelDims`, `ParallelConfig`, `MoESpec`), which validate their values themselves; this
module checks only what a file adds: that every key names a field (an unknown one raises
`ConfigError` naming it and listing the known ones), that values have the field's type, and the
rules that span sections (`RunConfig.check`). Nothing here touches a process group, so every
rank raises the same error before any collective.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sparta.errors import ConfigError

from .decoder import DecoderConfig
from .dims import ParallelDims
from .parallelize import ParallelConfig
from .pipeline import ModelParts, split_by_points

DATA_SOURCES = ("stdlib", "random")
DEVICES = ("cpu", "cuda")


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{owner}.{name}={value!r} must be an integer >= {minimum}")


def _check_float(
    owner: str, name: str, value: object, low: float, high: float = math.inf, open_low: bool = False
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low) and value <= high  # type: ignore[operator]
    if not ok:
        bound = f"> {low}" if open_low else f">= {low}"
        raise ConfigError(
            f"{owner}.{name}={value!r} must be a finite number {bound}" + (f" and <= {high}" if high < math.inf else "")
        )


def _check_path(owner: str, name: str, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{owner}.{name}={value!r} must be a non-empty path string (or left out)")


@dataclass
class TrainConfig:
    """The optimisation.

    steps: optimizer steps. global_batch: sequences per step over all data-parallel ranks
    (each dp rank takes global_batch / dp of them, cut into parallel.microbatches
    micro-batches). lr: the peak learning rate of AdamW (betas 0.9, 0.95), reached by a linear
    warm-up over warmup_steps and then decayed along a cosine to lr * min_lr_ratio at the last
    step. weight_decay: AdamW's, on matrices only (biases, norms and embeddings' 1-D
    parameters take none). grad_clip: the global gradient norm is clipped to this (0: never).
    seed: the weights' and the batches' seed. eval_every: steps between validation losses (0:
    only at the end); eval_batches: validation batches of global_batch sequences each.
    device: "cpu" or "cuda" (each rank takes the GPU of its local rank).
    """

    steps: int = 100
    global_batch: int = 16
    lr: float = 3e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 2
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name, minimum in (("steps", 1), ("global_batch", 1), ("warmup_steps", 0), ("seed", 0)):
            _check_int("train", name, getattr(self, name), minimum)
        for name, minimum in (("eval_every", 0), ("eval_batches", 1)):
            _check_int("train", name, getattr(self, name), minimum)
        _check_float("train", "lr", self.lr, 0.0, open_low=True)
        _check_float("train", "min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _check_float("train", "weight_decay", self.weight_decay, 0.0)
        _check_float("train", "grad_clip", self.grad_clip, 0.0)
        if self.device not in DEVICES:
            raise ConfigError(f"train.device={self.device!r} is unknown: choose one of {', '.join(DEVICES)}")


@dataclass
class DataConfig:
    """Where the tokens come from (see sparta/parallel/data.py).

    source: "stdlib" (Python's standard library, byte-level BPE of model.vocab_size tokens
    trained on its first corpus_mb MB, cached in cache_dir, default ~/.cache/sparta/demo) or
    "random" (random_tokens uniform random ids; throughput runs only, the loss stays near
    ln(vocab_size)).
    """

    source: str = "stdlib"
    corpus_mb: float = 4.0
    cache_dir: str | None = None
    random_tokens: int = 1_000_000

    def __post_init__(self) -> None:
        if self.source not in DATA_SOURCES:
            raise ConfigError(f"data.source={self.source!r} is unknown: choose one of {', '.join(DATA_SOURCES)}")
        _check_float("data", "corpus_mb", self.corpus_mb, 0.0, open_low=True)
        _check_path("data", "cache_dir", self.cache_dir)
        _check_int("data", "random_tokens", self.random_tokens, 1)


@dataclass
class CheckpointConfig:
    """dir: the folder of the run's checkpoints (left out: none are written or read); a run
    whose dir holds one resumes from the newest. every: steps between checkpoints (0: only at
    the end). keep: how many of the newest to keep."""

    dir: str | None = None
    every: int = 0
    keep: int = 2

    def __post_init__(self) -> None:
        _check_path("checkpoint", "dir", self.dir)
        _check_int("checkpoint", "every", self.every, 0)
        _check_int("checkpoint", "keep", self.keep, 1)


@dataclass
class OutputConfig:
    """metrics: a JSONL file, one record per step, written by rank 0 (left out: none).
    trace: a Chrome trace (torch.profiler) of trace_steps steps starting at step trace_start
    (counted from 1, as in the metrics; each step is a region named "step <n>"); rank 0
    writes this path, rank r > 0 the same name with ``.rank<r>`` before the suffix (`--trace`
    on the command line sets it). peak_tflops: the peak dense FLOP/s of all the devices the
    job runs on together, in TFLOP/s, for the MFU estimate (left out: no MFU)."""

    metrics: str | None = None
    trace: str | None = None
    trace_start: int = 3
    trace_steps: int = 2
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        _check_path("output", "metrics", self.metrics)
        _check_path("output", "trace", self.trace)
        _check_int("output", "trace_start", self.trace_start, 1)
        _check_int("output", "trace_steps", self.trace_steps, 1)
        if self.peak_tflops is not None:
            _check_float("output", "peak_tflops", self.peak_tflops, 0.0, open_low=True)


# file section -> the RunConfig fields it fills, in the order its keys are looked up
SECTIONS: dict[str, tuple[str, ...]] = {
    "model": ("model",),
    "parallel": ("dims", "parallel"),
    "train": ("train",),
    "data": ("data",),
    "checkpoint": ("checkpoint",),
    "output": ("output",),
}


@dataclass
class RunConfig:
    """One training run. Build it with `load_config` (a file plus `--set` overrides) or directly.

    Construction checks the rules that need no world size; `check(world_size)` adds the ones
    that do. Both raise `ConfigError` and touch no process group.
    """

    model: DecoderConfig = field(default_factory=DecoderConfig)
    dims: ParallelDims = field(default_factory=ParallelDims)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def __post_init__(self) -> None:
        # the schedule against pp, ep against the experts, stages against layers: the core's check
        self.parallel.check(self.dims, self.model.n_layers)
        if self.parallel.split_points is not None:  # the Decoder's layer names, checked as parallelize will
            layers = tuple(f"layers.{i}" for i in range(self.model.n_layers))
            parts = ModelParts(first=("tok_emb", "pos_emb"), layers=layers, last=("norm", "output"), shared=())
            split_by_points(parts, self.dims.pp * self.parallel.stages_per_rank, self.parallel.split_points)
        per_dp = self.dims.dp * self.parallel.microbatches
        if self.train.global_batch % per_dp:
            raise ConfigError(
                f"train.global_batch={self.train.global_batch} must be divisible by parallel.dp x "
                f"parallel.microbatches = {self.dims.dp} x {self.parallel.microbatches} = {per_dp} (each dp rank "
                f"cuts its share into micro-batches): pick a multiple of {per_dp}"
            )
        if self.output.trace is not None and self.output.trace_start > self.train.steps:
            raise ConfigError(
                f"output.trace_start={self.output.trace_start} is after the last step (train.steps="
                f"{self.train.steps}): nothing would be traced; lower it"
            )
        if self.data.source == "stdlib" and self.model.vocab_size < 257:
            raise ConfigError(
                f"model.vocab_size={self.model.vocab_size} must exceed the 256 byte tokens of the stdlib source's "
                "byte-level BPE: raise it or use data.source = 'random'"
            )

    def check(self, world_size: int) -> None:
        """The rules that need the world size: the degrees' product must equal it."""
        self.dims.check(world_size)

    def to_dict(self) -> dict[str, Any]:
        """The run as the file would write it (sections as in SECTIONS), for logs and metrics."""
        tree = {
            name: dataclasses.asdict(getattr(self, name)) for name in ("model", "train", "data", "checkpoint", "output")
        }
        tree["parallel"] = {**dataclasses.asdict(self.dims), **dataclasses.asdict(self.parallel)}
        return tree


# ------------------------------------------------------------------------------- loading


def _known(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _type_name(tp: object) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, where: str) -> Any:
    """``value`` as the annotation ``tp`` wants it; ConfigError naming ``where`` if it cannot be."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}={value!r} fits none of {_type_name(tp)}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(
                f"{where}={value!r} is unknown: choose one of {', '.join(map(repr, typing.get_args(tp)))}"
            )
        return value
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}={value!r} must be a list")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        items = [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a table of {tp.__name__}'s fields ({', '.join(_known(tp))})")
        return _build(tp, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={value!r} must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r} must be a string")
        return value
    return value  # Any, or a type a file cannot spell: the dataclass checks it


def _build(cls: type, table: Mapping[str, Any], where: str) -> Any:
    """``cls(**table)`` with each key checked against cls's fields and each value against its
    annotation; the dataclass's own __post_init__ checks the values."""
    known = _known(cls)
    unknown = [key for key in table if key not in known]
    if unknown:
        raise ConfigError(
            f"unknown field {where}.{unknown[0]}"
            + (f" (and {', '.join(unknown[1:])})" if unknown[1:] else "")
            + f": the known fields of [{where}] are {', '.join(known)}"
        )
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - annotations a module cannot resolve: leave the types to __post_init__
        hints = {}
    kwargs = {key: _convert(hints.get(key, Any), value, f"{where}.{key}") for key, value in table.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field left out
        raise ConfigError(f"[{where}] {e}: the fields of [{where}] are {', '.join(known)}") from None


def from_dict(tree: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from a file's tree of tables (see the module docstring); validated."""
    if not isinstance(tree, Mapping):
        raise ConfigError(f"a run file must hold tables ({', '.join(SECTIONS)}), not {type(tree).__name__}")
    unknown = [key for key in tree if key not in SECTIONS]
    if unknown:
        raise ConfigError(f"unknown section [{unknown[0]}]: the known sections are {', '.join(SECTIONS)}")
    hints = typing.get_type_hints(RunConfig)
    kwargs: dict[str, Any] = {}
    for section, targets in SECTIONS.items():
        table = tree.get(section, {})
        if not isinstance(table, Mapping):
            raise ConfigError(f"[{section}] must be a table of fields, not {table!r}")
        if len(targets) == 1:
            kwargs[targets[0]] = _build(hints[targets[0]], table, section)
            continue
        # [parallel]: each key goes to the first leaf that has a field of that name
        owners = {name: hints[name] for name in targets}
        parts: dict[str, dict[str, Any]] = {name: {} for name in targets}
        for key, value in table.items():
            owner = next((name for name, cls in owners.items() if key in _known(cls)), None)
            if owner is None:
                known = [k for cls in owners.values() for k in _known(cls)]
                raise ConfigError(
                    f"unknown field {section}.{key}: the known fields of [{section}] are {', '.join(known)}"
                )
            parts[owner][key] = value
        for name, cls in owners.items():
            kwargs[name] = _build(cls, parts[name], section)
    return RunConfig(**kwargs)


def parse_value(text: str) -> Any:
    """A `--set` value: a TOML value (3, 1e-3, true, "x", [1, 2]) or, failing that, the bare string."""
    try:
        return _toml().loads(f"v = {text}")["v"]
    except Exception:  # noqa: BLE001 - anything that is not a TOML value is a string: 1F1B, /tmp/run
        return text


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Apply one ``section.field=value`` (or ``parallel.moe.top_k=2``) to the raw tree."""
    key, sep, text = assignment.partition("=")
    path = key.strip().split(".")
    if not sep or len(path) < 2 or not all(path):
        raise ConfigError(f"--set {assignment!r} must read section.field=value, e.g. train.steps=20")
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {assignment!r}: {part} is a value, not a table")
        node = child
    node[path[-1]] = parse_value(text.strip())


def _toml() -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError as e:
            raise ConfigError(
                "reading TOML needs Python 3.11+ (tomllib) or the tomli package: pip install tomli"
            ) from e
    return tomllib


def read_file(path: str | Path) -> dict[str, Any]:
    """The raw tree of a .toml, .yaml or .yml run file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            return _toml().loads(path.read_text())
        except ConfigError:
            raise
        except Exception as e:  # tomllib.TOMLDecodeError, without importing it twice
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
    if suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as e:
            raise ConfigError(f"{path}: YAML run files need PyYAML (pip install pyyaml); or write it as TOML") from e
        try:
            tree = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        return {} if tree is None else tree
    raise ConfigError(f"config file {str(path)!r} must end in .toml, .yaml or .yml")


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """The run of file ``path`` (None: all defaults) with ``overrides`` ("section.field=value")
    applied on top; every value validated, the overrides as strictly as the file."""
    tree = read_file(path) if path is not None else {}
    for assignment in overrides:
        apply_override(tree, assignment)
    try:
        return from_dict(tree)
    except ConfigError as e:
        where = f"{path}" if path is not None else "the defaults"
        raise ConfigError(f"{where}{' with --set' if overrides else ''}: {e}") from None
