"""The training loop behind `sparta train`: a `RunConfig` in, a trained model and a metrics file out.

`run(config)` validates the run against the launch (before any engine starts), starts the
world and calls `train(config, world)`, which:

1. builds the layout (`build_layout`) and the model (`Decoder`, seeded alike on every rank),
   and hands both to `parallelize` with the run's `ParallelConfig`;
2. makes AdamW (betas 0.9, 0.95; weight decay on matrices only) and sets the learning rate of
   every step itself: linear warm-up, then a cosine down to ``lr * min_lr_ratio`` (a pure
   function of the step, so a resumed run needs no scheduler state);
3. loads the tokens (`sparta.parallel.data`); the batch of step s is a function of (seed, s),
   each dp rank taking its slice, tp and pp ranks of one dp rank the same one;
4. resumes from the newest checkpoint of ``checkpoint.dir`` when there is one, and writes one
   every ``checkpoint.every`` steps and at the end;
5. steps: ``loss = pm.step(ids, targets)`` (the mean loss over the global batch, from the last
   pipeline stage: `ParallelModel.step` broadcasts it, nothing here estimates it), clip the
   global gradient norm, steps fused AdamW (one per kind of tensor: `_optimizers`);
   evaluates every ``train.eval_every`` steps.

Rank 0 shows a tqdm bar (loss, tokens/s, MFU, peak memory, expert load) and writes one JSON
record per step to ``output.metrics``: ``step`` (from 1), ``loss`` (the global batch's, from
`ParallelModel.step`), ``lr``, ``grad_norm`` (global, before clipping), ``step_s``, ``tokens``
(per step), ``val_loss`` (on evaluation steps only), and

- ``tokens_per_s``: global-batch tokens of the step over its wall time (data included);
- ``mfu``: ``6 * N * tokens_per_s / (output.peak_tflops * 1e12)`` with N the parameters one
  token passes through, embeddings excluded (attention, norms, the router, top_k experts'
  MLPs, the output head; `active_parameters`); attention's T^2 term is left out, as in
  Kaplan et al.'s 6N. None unless ``output.peak_tflops`` states the hardware's peak;
- ``peak_mem_mb``: rank 0's peak: ``torch.cuda.max_memory_allocated`` on CUDA, the process's
  resident-set high-water mark (``getrusage(RUSAGE_SELF).ru_maxrss``) on CPU;
- ``expert_load``: max/mean tokens per expert of the most unbalanced MoE layer on rank 0's
  pipeline stage, from ``MoELayer.last_stats`` (its last micro-batch, summed over the layer's
  stats group); None for a dense model.

``output.trace`` (``--trace``) records ``output.trace_steps`` steps from ``output.trace_start``
(counted from 1; each step a region "step <n>") with ``torch.profiler`` and writes its Chrome
trace (chrome://tracing, ui.perfetto.dev): rank 0 to that path, rank r to the same name with
``.rank<r>`` before the suffix.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import torch

import sparta
from sparta.comm import detect
from sparta.errors import BackendUnavailableError, ConfigError, SpartaError
from sparta.scheduling.varlen import LengthCost

from .checkpoint import Checkpointer, CheckpointError
from .config import RunConfig
from .data import TokenBatches, random_tokens, stdlib_tokens
from .decoder import Decoder, DecoderConfig
from .dims import Layout, build_layout
from .documents import DocumentBatches
from .model import ParallelModel
from .parallel_config import ParallelConfig
from .parallelize import parallelize
from .train_report import MetricsFile, StepTracer, expert_load, peak_memory_mb, postfix, progress_bar, say_above_bar

log = logging.getLogger("sparta.parallel.train")


def learning_rate(config: RunConfig, step: int) -> float:
    """The learning rate of 0-based ``step``: linear warm-up over ``warmup_steps``, then a
    cosine from ``lr`` down to ``lr * min_lr_ratio`` at the last step."""
    t = config.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - 1 - t.warmup_steps)
    floor = t.lr * t.min_lr_ratio
    return floor + (t.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def active_parameters(model: DecoderConfig, parallel: ParallelConfig) -> int:
    """Parameters one token passes through, embeddings excluded (the N of the 6N MFU rule):
    per layer two LayerNorms, attention's four d x d projections, the MLP (top_k of them and
    the router's d x num_experts in each MoE layer); then the final norm and the output head."""
    d, f = model.d_model, model.d_ff
    norms = 2 * 2 * d
    attention = 4 * (d * d + d)
    mlp = d * f + f + f * d + d
    moe = parallel.moe
    layers = model.n_layers * (norms + attention + mlp)
    if moe is not None:  # an MoE layer's token passes top_k experts and the router instead of one MLP
        layers += sum(moe.is_moe(i) for i in range(model.n_layers)) * ((moe.top_k - 1) * mlp + d * moe.num_experts)
    return layers + 2 * d + d * model.vocab_size


def _optimizers(pm: ParallelModel, config: RunConfig) -> list[torch.optim.AdamW]:
    """Fused AdamW, one per kind of tensor (`ParallelModel.param_groups`: a fused kernel takes
    one kind per call), each with the same two groups, matrices (decayed) and the rest
    (either may be empty): so the groups a checkpoint restores are the same on every rank
    and layout, whatever kinds a stage holds."""
    optimizers = []
    for group in pm.param_groups():
        params = [p for p in group["params"] if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.train.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizers.append(torch.optim.AdamW(groups, lr=config.train.lr, betas=(0.9, 0.95), fused=True))
    return optimizers


def _tokens(config: RunConfig, world: sparta.World, say: Callable[[str], object]) -> torch.Tensor:
    data = config.data
    if data.source == "random":
        return random_tokens(data.random_tokens, config.model.vocab_size, config.train.seed)
    cache = Path(data.cache_dir).expanduser() if data.cache_dir else None
    return stdlib_tokens(world.comm, data.corpus_mb, config.model.vocab_size, cache, say)


def _batches(config: RunConfig, tokens: torch.Tensor) -> TokenBatches | DocumentBatches:
    t, model, dims, parallel = config.train, config.model, config.dims, config.parallel
    if config.data.samples == "windows":
        return TokenBatches(tokens, model.seq_len, t.seed)
    cost = LengthCost.of_flops(active_parameters(model, parallel), model.n_layers, model.d_model)
    return DocumentBatches(
        tokens, model.seq_len, t.seed, parallel.lengths, t.global_batch, dims.dp, parallel.microbatches, dims.pp, cost
    )


def _step_tokens(batches: TokenBatches | DocumentBatches, config: RunConfig, step: int) -> int:
    """Input tokens of optimizer step ``step`` over the global batch, padding excluded."""
    if isinstance(batches, DocumentBatches):
        return batches.tokens_of(step)
    return config.train.global_batch * config.model.seq_len


def evaluate(pm: ParallelModel, batches: TokenBatches | DocumentBatches, config: RunConfig, layout: Layout) -> float:
    """Mean validation loss over ``train.eval_batches`` fixed global batches (the same value
    on every rank)."""
    losses = []
    pm.train(False)
    for index in range(config.train.eval_batches):
        ids, targets = batches.val_batch(
            index, config.train.eval_batches, config.train.global_batch, layout.dp_rank, layout.dims.dp
        )
        losses.append(pm.evaluate(ids.to(layout.device), targets.to(layout.device)))
    pm.train(True)
    return sum(losses) / len(losses)


def train(config: RunConfig, world: sparta.World) -> dict[str, Any]:
    """Train ``config`` on ``world``; returns the summary rank 0 prints (the same keys on
    every rank; the losses are the global batch's, equal everywhere)."""
    started = time.perf_counter()
    t = config.train
    config.check(world.size)
    say: Callable[[str], object] = say_above_bar if world.rank == 0 else (lambda _: None)
    layout = build_layout(config.dims, world, device=t.device)
    tokens = _tokens(config, world, say)
    batches = _batches(config, tokens)
    windows = batches if isinstance(batches, TokenBatches) else TokenBatches(tokens, config.model.seq_len, t.seed)
    torch.manual_seed(t.seed)  # same seed on every rank: one full model, then cut
    # one micro-batch of full windows, for balancing the stages by measured time when no split
    # points are given
    sample = windows.train_batch(0, t.global_batch, 0, config.dims.dp * config.parallel.microbatches)[0]
    pm = parallelize(Decoder(config.model), layout, config.parallel, sample=sample)
    with ExitStack() as cleanup:  # whatever fails from here, hooks, file, bar and profiler are let go
        cleanup.callback(pm.close)
        if world.rank == 0:
            log.info("plan:\n%s", pm.plan)
        optimizers = _optimizers(pm, config)
        layers = pm.moe_layers()
        n_active = active_parameters(config.model, config.parallel)
        peak_flops = config.output.peak_tflops * 1e12 if config.output.peak_tflops else None
        d = config.dims
        say(
            f"{world.size} ranks ({world.backend}): pp{d.pp} x dp{d.dp} x tp{d.tp}, ep{d.ep}, "
            f"{config.parallel.schedule} x {config.parallel.microbatches} micro-batches; "
            f"{n_active / 1e6:.2f}M parameters per token; "
            + (
                f"{len(batches.train):,} training tokens, {t.global_batch * config.model.seq_len:,} per step"
                if isinstance(batches, TokenBatches)
                else f"{len(batches.train[0]):,} training documents' pieces of {batches.mean_piece:.0f} tokens on "
                f"average, up to {batches.max_tokens:,} tokens a micro-batch"
            )
        )

        ckpt = config.checkpoint
        checkpointer = Checkpointer(ckpt.dir, keep=ckpt.keep) if ckpt.dir is not None else None
        start_step = 0
        # the data position beside the step (a step's batch is a function of these and the step)
        position = {"seed": t.seed, "global_batch": t.global_batch, "samples": config.data.samples}
        if checkpointer is not None:
            extra = checkpointer.load(pm.parts, optimizers)
            if extra is not None:
                start_step = int(extra["step"])
                say(f"resumed from step {start_step} of {ckpt.dir}")
                if any(
                    extra.get(key, "windows" if key == "samples" else None) != value for key, value in position.items()
                ):
                    say(f"warning: the checkpoint was trained with {extra}; this run's batches differ from its")
        problem = None
        try:  # rank 0 alone opens it: its failure must reach the others before any collective
            metrics = cleanup.enter_context(closing(MetricsFile(config.output.metrics, world.rank, start_step)))
        except OSError as exc:
            problem = ConfigError(f"output.metrics={config.output.metrics!r} cannot be written ({exc}): fix the path")
        world.comm.agree(problem, "opening output.metrics")
        tracer = cleanup.enter_context(closing(StepTracer(config, world.rank, layout.device)))
        bar = cleanup.enter_context(closing(progress_bar(world.rank == 0, t.steps, start_step)))
        losses: list[float] = []
        initial_val = val_loss = None if start_step else evaluate(pm, batches, config, layout)
        if initial_val is not None:
            say(f"step 0: val loss {initial_val:.3f}")
        train_seconds, trained_tokens = 0.0, 0
        for step in range(start_step, t.steps):
            tracer.before(step)
            begin = time.perf_counter()
            with tracer.region(step):
                lr = learning_rate(config, step)
                for optimizer in optimizers:
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                ids, targets = batches.train_batch(step, t.global_batch, layout.dp_rank, d.dp)
                tuning = pm.auto is not None and pm.auto.pending
                loss = pm.step(ids.to(layout.device), targets.to(layout.device))
                if tuning:  # this step tuned the co-scheduler (pipeline_degree = "auto"): say what it chose
                    say(pm.auto.describe())  # type: ignore[union-attr]
                grad_norm = pm.clip_grad_norm_(t.grad_clip if t.grad_clip > 0 else math.inf)
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - begin
            tracer.after(step, step + 1 == t.steps)
            tokens_per_step = _step_tokens(batches, config, step)
            train_seconds += elapsed
            trained_tokens += tokens_per_step
            losses.append(loss)
            record: dict[str, Any] = {
                "step": step + 1,
                "loss": loss,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "step_s": elapsed,
                "tokens": tokens_per_step,
                "tokens_per_s": tokens_per_step / elapsed,
                "mfu": 6 * n_active * tokens_per_step / elapsed / peak_flops if peak_flops else None,
                "peak_mem_mb": peak_memory_mb(layout.device),
                "expert_load": None,
            }
            balance, spark = expert_load(layers)
            record["expert_load"] = balance
            last = step + 1 == t.steps
            if (t.eval_every and (step + 1) % t.eval_every == 0) or last:
                val_loss = evaluate(pm, batches, config, layout)
                record["val_loss"] = val_loss
                say(f"step {step + 1}: train loss {loss:.3f}, val loss {val_loss:.3f}")
            if checkpointer is not None and ((ckpt.every and (step + 1) % ckpt.every == 0) or last):
                # the data position is the step: batches are a function of (seed, step)
                checkpointer.save(step + 1, pm.parts, optimizers, position)
            metrics.write(record)
            bar.set_postfix_str(postfix(record, spark), refresh=False)
            bar.update(1)
    tail = losses[-min(10, len(losses)) :] if losses else []

    def rounded(value: float | None, digits: int) -> float | None:
        return None if value is None else round(value, digits)

    return {
        "steps": t.steps,
        "ranks": world.size,
        "backend": world.backend,
        "initial_loss": rounded(losses[0] if losses else None, 4),
        "initial_val_loss": rounded(initial_val, 4),
        "final_loss": rounded(sum(tail) / len(tail) if tail else None, 4),  # the last 10 steps' mean
        "val_loss": rounded(val_loss, 4),
        "tokens_per_s": rounded(trained_tokens / train_seconds if train_seconds else None, 1),
        "wall_s": rounded(time.perf_counter() - started, 1),
    }


def cpu_threads(local_size: int) -> int:
    """Torch threads per rank on CPU when ``local_size`` ranks share this host: its cores
    over the ranks (more threads each than their share only contend). `sparta plan
    --measure` times the parts with the same count."""
    return max(1, (os.cpu_count() or 1) // max(1, local_size))


def run(config: RunConfig, backend: str = "auto") -> int:
    """`sparta train`: check ``config`` against the launch, start the world, train, print the
    summary (rank 0, last line, JSON). Returns the exit code."""
    launch = detect()
    try:
        config.check(launch.size)  # before any engine starts: every rank fails alike
        if importlib.util.find_spec("tqdm") is None:
            raise BackendUnavailableError("sparta train's progress bar needs tqdm: pip install 'sparta[demo]'")
    except SpartaError as e:
        print(f"sparta train: {e}", file=sys.stderr, flush=True)
        return 2
    if config.train.device == "cpu":
        torch.set_num_threads(cpu_threads(launch.local_size))
    # Launchers pipe stdout: flush each line, so that the log keeps pace with the bar.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    world = sparta.init(backend=backend)
    try:
        summary = train(config, world)
    except (ConfigError, CheckpointError) as e:
        # found after the start (a corpus too small for seq_len, a checkpoint of another
        # model): every rank raises it alike (the checkpointer agrees on its errors)
        print(f"sparta train: {e}", file=sys.stderr, flush=True)
        world.shutdown()
        return 2
    if world.rank == 0:
        print(json.dumps(summary), flush=True)
    world.shutdown()
    return 0
