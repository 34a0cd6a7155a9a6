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
module adds the sections a file has beyond them and the rules that span sections
(`RunConfig.__post_init__`, `RunConfig.check`). Reading a file into a RunConfig is
`config_file.py`'s. Nothing here touches a process group, so every rank raises the same error
before any collective.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from sparta.errors import ConfigError

from .decoder import DecoderConfig
from .dims import ParallelDims
from .parallel_config import ParallelConfig
from .pipeline import ModelParts, split_by_points

DATA_SOURCES = ("stdlib", "random")
DATA_SAMPLES = ("windows", "documents")
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
    samples: "windows" (windows of model.seq_len tokens at random starts in the stream, across
    documents, never padded; data.py) or "documents" (each document, or a piece of at most
    seq_len, padded to one of parallel.lengths, grouped into pipeline steps by DynaPipe's
    dynamic programme; documents.py).
    """

    source: str = "stdlib"
    samples: str = "windows"
    corpus_mb: float = 4.0
    cache_dir: str | None = None
    random_tokens: int = 1_000_000

    def __post_init__(self) -> None:
        if self.source not in DATA_SOURCES:
            raise ConfigError(f"data.source={self.source!r} is unknown: choose one of {', '.join(DATA_SOURCES)}")
        if self.samples not in DATA_SAMPLES:
            raise ConfigError(f"data.samples={self.samples!r} is unknown: choose one of {', '.join(DATA_SAMPLES)}")
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
            split_by_points(parts, self.parallel.body_stages(self.dims.pp), self.parallel.split_points)
        per_dp = self.dims.dp * self.parallel.microbatches
        if self.train.global_batch % per_dp:
            raise ConfigError(
                f"train.global_batch={self.train.global_batch} must be divisible by parallel.dp x "
                f"parallel.microbatches = {self.dims.dp} x {self.parallel.microbatches} = {per_dp} (each dp rank "
                f"cuts its share into micro-batches): pick a multiple of {per_dp}"
            )
        lengths, seq_len = self.parallel.lengths, self.model.seq_len
        if self.data.samples == "documents" and not lengths:
            raise ConfigError(
                "data.samples = 'documents' pads each step to one of parallel.lengths, which is empty: set it, e.g. "
                f"parallel.lengths = [{max(1, seq_len // 4)}, {max(1, seq_len // 2)}, {seq_len}]"
            )
        if lengths and lengths[-1] < seq_len:
            raise ConfigError(
                f"parallel.lengths={list(lengths)}: the longest must hold model.seq_len={seq_len}; add {seq_len}"
            )
        past = [n for n in lengths if n > seq_len]
        if past:  # the Decoder has seq_len positions: parallelize would refuse them once the ranks are up
            raise ConfigError(
                f"parallel.lengths={list(lengths)}: {past} exceed model.seq_len={seq_len}, the model's positions "
                f"(no batch is longer); end the list at {seq_len}"
            )
        if self.parallel.vocab_stages and self.parallel.data_parallel == "fsdp" and self.checkpoint.dir is not None:
            raise ConfigError(
                "parallel.vocab_stages with data_parallel = 'fsdp' and a checkpoint.dir: FSDP2 shards a head stage's "
                "vocabulary rows over dp, and the checkpoint saves each stage's rows as one chunk of the head; use "
                "data_parallel = 'sparta' (or 'horovod'), or no checkpoints"
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
