"""Data-parallel dense weights + expert-parallel experts: the training loop of the demo."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

import sparta
from sparta.comm import Communicator
from sparta.errors import ConfigError
from sparta.moe import sync_gradients

from .data import Batches
from .model import MoEGPT

SPARK = "▁▂▃▄▅▆▇█"


@dataclass
class TrainConfig:
    steps: int = 200
    batch: int = 8  # sequences per rank per step
    lr: float = 3e-3
    warmup_fraction: float = 0.1  # of the steps, with the learning rate rising linearly
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 2  # validation batches of `batch` sequences per rank
    corpus_mb: float = 4.0  # MB of stdlib source: tokens for the train and validation splits
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "eval_every", "eval_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if not self.corpus_mb > 0:
            raise ConfigError(f"corpus_mb={self.corpus_mb} must be > 0")
        if not self.lr > 0 or self.grad_clip <= 0 or self.weight_decay < 0 or not 0 <= self.warmup_fraction < 1:
            raise ConfigError(
                f"lr={self.lr}, grad_clip={self.grad_clip} must be > 0, weight_decay={self.weight_decay} >= 0 "
                f"and warmup_fraction={self.warmup_fraction} in [0, 1)"
            )


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    warmup = int(cfg.warmup_fraction * cfg.steps)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: MoEGPT, batches: Batches, cfg: TrainConfig, comm: Communicator) -> float:
    """Mean validation loss over every rank's share of the fixed validation windows."""
    model.eval()
    ids, targets = batches.val_batch(cfg.batch * cfg.eval_batches)
    losses = [
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        for x, y in zip(ids.split(cfg.batch), targets.split(cfg.batch), strict=True)
    ]
    model.train()
    return float(comm.all_reduce(torch.stack(losses).mean(), op="avg"))


def expert_load(model: MoEGPT) -> tuple[float, str]:
    """The most unbalanced layer's max/mean tokens per expert, and its counts as a sparkline."""
    counts = max((moe.last_stats.tokens_per_expert for moe in model.moe_layers), key=lambda c: max(c) / max(1, sum(c)))
    peak, mean = max(counts), sum(counts) / len(counts)
    spark = "".join(SPARK[min(len(SPARK) - 1, int(c / max(1, peak) * len(SPARK)))] for c in counts)
    return peak / max(mean, 1e-9), spark


def train(world: sparta.World, model: MoEGPT, batches: Batches, cfg: TrainConfig) -> dict[str, float]:
    """Run ``cfg.steps`` steps; returns the numbers of the summary line."""
    comm = world.comm
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    log = tqdm.write if world.rank == 0 else lambda _: None
    initial_val = evaluate(model, batches, cfg, comm)
    log(f"step 0: val loss {initial_val:.3f}")
    tokens_per_step = world.size * cfg.batch * model.cfg.seq_len
    losses: list[float] = []
    train_seconds = 0.0
    val_loss = initial_val
    bar = tqdm(range(cfg.steps), disable=world.rank != 0, mininterval=0.5, unit="step", dynamic_ncols=True)
    for step in bar:
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        ids, targets = batches.train_batch(cfg.batch)
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        # Dense weights averaged over ranks, experts (one shard per rank) scaled: the gradient
        # of the mean loss over the global batch (checked by tests/test_demo.py).
        global_loss, grad_norm = sync_gradients(model, comm, loss=loss)
        nn.utils.clip_grads_with_norm_(model.parameters(), cfg.grad_clip, grad_norm)
        optimizer.step()
        elapsed = time.perf_counter() - start
        train_seconds += elapsed
        losses.append(global_loss)
        balance, spark = expert_load(model)
        bar.set_postfix_str(
            f"loss {global_loss:.3f} | {tokens_per_step / elapsed:,.0f} tok/s | load max/mean {balance:.2f} {spark}",
            refresh=False,
        )
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            val_loss = evaluate(model, batches, cfg, comm)
            log(f"step {step + 1}: train loss {global_loss:.3f}, val loss {val_loss:.3f}")
    bar.close()
    tail = losses[-min(10, len(losses)) :]
    return {
        "initial_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
        "initial_val_loss": initial_val,
        "val_loss": val_loss,
        "tokens_per_s": tokens_per_step * cfg.steps / train_seconds,
    }
