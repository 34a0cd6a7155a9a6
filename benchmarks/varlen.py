"""Variable-length micro-batching measured: DynaPipe's dynamic programme against padding and
packing, on a long-tailed length distribution, one process (one thread).

    OMP_NUM_THREADS=1 python benchmarks/varlen.py                   # defaults below
    OMP_NUM_THREADS=1 python benchmarks/varlen.py --samples 32 --repeats 3   # quicker

The model is the reference Decoder (``--d-model``, ``--layers``, ``--seq-len``); samples'
lengths are ``min(seq_len, pareto(--alpha) * --scale)`` tokens (most short, a few at the
maximum). Steps:
1. `LengthCost.fit` to forward + backward times of [rows, length] shapes (median of 3 each);
2. the global batch cut three ways: ``padded`` (the trainer's way: ``--microbatches`` groups
   in order, each padded to seq_len), ``packed`` (rows of seq_len, first-fit decreasing),
   ``dynamic`` (`dynamic_batches` for one stage), each at most ``--max-tokens`` per micro-batch;
3. each way's step (every micro-batch's forward + backward, gradients accumulated) timed
   ``--repeats`` times, the ways alternating; the median counts;
4. the oracle: ``dynamic`` and ``padded`` give the same loss (sum over real tokens) within
   1e-5 relative; ``packed`` is timed only (its causal mask lets a sample see the ones packed
   before it, so its loss differs).
Prints JSON lines: ``varlen_header``, ``varlen_fit``, one ``varlen_way`` per way (micro-batches,
tokens with padding, predicted and measured seconds, the error, predicted steps over 2 and 4
pipeline stages where the programme is rerun for them), ``varlen_summary`` (dynamic's speed-up
over padding and packing, measured). Exits 1 if the oracle fails.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time

import torch

import sparta
from sparta.parallel import Decoder, DecoderConfig
from sparta.scheduling import (
    IGNORE_INDEX,
    LengthCost,
    MicroBatch,
    collate,
    dynamic_batches,
    pack_batches,
    pad_batches,
    pipeline_seconds,
    summed_loss,
)


def _step(model: Decoder, batches: list[tuple[torch.Tensor, torch.Tensor]], real_tokens: int) -> float:
    model.zero_grad(set_to_none=False)
    total = 0.0
    for ids, targets in batches:
        loss = summed_loss(model(ids), targets) / real_tokens
        loss.backward()
        total += loss.item()
    return total


def _packed(samples: list[torch.Tensor], mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of concatenated samples (first-fit order), padded with ignored targets."""
    ids = torch.zeros(mb.rows, mb.length, dtype=torch.long)
    targets = torch.full((mb.rows, mb.length), IGNORE_INDEX, dtype=torch.long)
    row, col = 0, 0
    for i in mb.samples:
        n = samples[i].numel() - 1
        if col + n > mb.length:
            row, col = row + 1, 0
        ids[row, col : col + n] = samples[i][:-1]
        targets[row, col : col + n] = samples[i][1:]
        col += n
    return ids, targets


def workload_args(p: argparse.ArgumentParser, microbatches: int, microbatches_help: str) -> None:
    """The model, the length distribution and the timing: what this benchmark and
    varlen_pipeline.py share."""
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--alpha", type=float, default=1.1, help="Pareto shape of the lengths (smaller: longer tail)")
    p.add_argument("--scale", type=float, default=48.0, help="Pareto scale of the lengths, tokens")
    p.add_argument("--microbatches", type=int, default=microbatches, help=microbatches_help)
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per micro-batch, padding included")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)


def workload(a: argparse.Namespace) -> tuple[DecoderConfig, list[int], list[torch.Tensor]]:
    """The model's config, the samples' lengths (long-tailed) and their tokens (plus one)."""
    cfg = DecoderConfig(
        vocab_size=a.vocab, seq_len=a.seq_len, d_model=a.d_model, n_layers=a.layers, n_heads=4, d_ff=4 * a.d_model
    )
    rng = random.Random(a.seed)
    lengths = [max(1, min(a.seq_len, int(rng.paretovariate(a.alpha) * a.scale))) for _ in range(a.samples)]
    g = torch.Generator().manual_seed(a.seed)
    return cfg, lengths, [torch.randint(0, a.vocab, (n + 1,), generator=g) for n in lengths]


def fit_cost(model: Decoder, a: argparse.Namespace) -> tuple[LengthCost, list[float]]:
    """`LengthCost.fit` to this process's forward + backward of a few shapes (median of 3
    each, after one); the fit's relative error at each."""
    shapes = [(r, n) for r in (1, 2, 4) for n in (a.seq_len // 8, a.seq_len // 4, a.seq_len // 2, a.seq_len)]
    shapes = [(r, n) for r, n in shapes if r * n <= a.max_tokens]
    seconds = []
    for r, n in shapes:
        ids = torch.randint(0, a.vocab, (r, n))
        times = []
        for _ in range(4):
            began = time.perf_counter()
            model(ids).float().sum().backward()
            times.append(time.perf_counter() - began)
        seconds.append(statistics.median(times[1:]))
    model.zero_grad(set_to_none=True)
    cost = LengthCost.fit(shapes, seconds)
    return cost, [cost(r, n) / t - 1 for (r, n), t in zip(shapes, seconds, strict=True)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_args(p, 16, "the padded way's micro-batch count")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    cfg, lengths, samples = workload(a)
    model = Decoder(cfg)
    real = sum(lengths)
    print(
        json.dumps(
            {
                "record": "varlen_header",
                "sparta": sparta.__version__,
                "torch": torch.__version__,
                "cpu": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(),
                "command": " ".join(sys.argv),
                "model": {"d_model": a.d_model, "layers": a.layers, "seq_len": a.seq_len, "vocab": a.vocab},
                "samples": a.samples,
                "lengths": {
                    "mean": round(statistics.mean(lengths), 1),
                    "median": statistics.median(lengths),
                    "max": max(lengths),
                    "at_seq_len": sum(n == a.seq_len for n in lengths),
                },
            }
        ),
        flush=True,
    )
    cost, errors = fit_cost(model, a)
    print(
        json.dumps(
            {
                "record": "varlen_fit",
                "alpha_s": cost.alpha,
                "per_token_s": cost.per_token,
                "per_token_len_s": cost.per_token_len,
                "max_abs_fit_error": round(max(abs(e) for e in errors), 4),
            }
        ),
        flush=True,
    )

    ways = {
        "padded": pad_batches(lengths, a.microbatches, pad_to=a.seq_len),
        "packed": pack_batches(lengths, a.seq_len, a.max_tokens),
        "dynamic": dynamic_batches(lengths, cost, a.max_tokens),
    }
    tensors = {
        name: [(_packed if name == "packed" else collate)(samples, mb) for mb in batches]
        for name, batches in ways.items()
    }
    for batches in tensors.values():  # warm-up: every shape once
        _step(model, batches, real)
    times: dict[str, list[float]] = {name: [] for name in ways}
    losses: dict[str, float] = {}
    for r in range(a.repeats):
        names = list(ways)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            began = time.perf_counter()
            losses[name] = _step(model, tensors[name], real)
            times[name].append(time.perf_counter() - began)
    measured = {name: statistics.median(t) for name, t in times.items()}
    for name, batches in ways.items():
        predicted = pipeline_seconds(batches, cost)
        over_stages = {
            str(s): round(
                pipeline_seconds(
                    dynamic_batches(lengths, cost, a.max_tokens, s) if name == "dynamic" else batches, cost, s
                ),
                4,
            )
            for s in (2, 4)
        }
        print(
            json.dumps(
                {
                    "record": "varlen_way",
                    "way": name,
                    "microbatches": len(batches),
                    "tokens_with_padding": sum(mb.tokens for mb in batches),
                    "real_tokens": real,
                    "predicted_s": round(predicted, 4),
                    "measured_s": round(measured[name], 4),
                    "min_s": round(min(times[name]), 4),
                    "max_s": round(max(times[name]), 4),
                    "error": round(predicted / measured[name] - 1, 4),
                    "predicted_pipeline_s": over_stages,
                    "loss": losses[name],
                }
            ),
            flush=True,
        )
    wrong = abs(losses["dynamic"] - losses["padded"]) > 1e-5 * abs(losses["padded"])
    print(
        json.dumps(
            {
                "record": "varlen_summary",
                "dynamic_vs_padded": round(measured["padded"] / measured["dynamic"], 3),
                "dynamic_vs_packed": round(measured["packed"] / measured["dynamic"], 3),
                "loss_gap_dynamic_padded": abs(losses["dynamic"] - losses["padded"]),
                "wrong": int(wrong),
            }
        ),
        flush=True,
    )
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
