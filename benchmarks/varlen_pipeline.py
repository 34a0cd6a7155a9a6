"""Variable-length samples through the trainer's pipeline: bucketed steps (DynaPipe's programme
on the pipeline's shapes) against padding and packing, one launch, the ways alternating.

    torchrun --nproc-per-node 2 benchmarks/varlen_pipeline.py             # pp=2, 1F1B
    torchrun --nproc-per-node 2 benchmarks/varlen_pipeline.py --repeats 3 # quicker

The reference Decoder (``--d-model``, ``--layers``, ``--seq-len``) over ``pp`` = world size
pipeline ranks (1F1B, ``--microbatches``, stages cut evenly), the same long-tailed lengths as
benchmarks/varlen.py. Each way processes every sample once, as `ParallelModel.step` calls of
``--microbatches`` micro-batches of one shape, each at most ``--max-tokens`` tokens:

- ``padded``: the samples in order, ``max_tokens // seq_len`` rows a micro-batch, every one
  padded to seq_len (``ParallelConfig.seq_len``, the trainer's way without ``lengths``);
- ``packed``: rows of seq_len packed first-fit decreasing, dealt into steps of the same
  shape (timed only: under a plain causal mask a sample attends to the ones packed before it);
- ``bucketed``: `sparta.scheduling.bucketed_steps` over ``--buckets``, run with
  ``ParallelConfig.lengths`` (a schedule per shape), on a `LengthCost` fitted (``--fit``) to
  ``pipeline``: whole `ParallelModel.step` calls of the bucketed way's own pipeline, shapes of
  1, 2 and 4 rows a micro-batch at each bucket, each step's time (the slowest rank's, median
  of 3 after one) over ``(microbatches + pp - 1) / pp``, so that a step's own overhead (hops,
  gradient sync) is in the fit; or ``process``: forward + backward of a few shapes on rank 0
  alone (benchmarks/varlen.py's fit).

A pass of a way is all its steps (forward and backward, gradients zeroed, no optimizer, so
every pass sees the same weights) from a barrier; the slowest rank's time counts, the median
of ``--repeats`` passes after one untimed pass. The oracle: every step's loss (each way's
first pass) equals one process's on the same micro-batches (mean of their mean
cross-entropies), within 1e-5 relative. Prints JSON lines ``varlen_pipeline_way`` (steps,
tokens with padding, predicted and measured seconds) and ``varlen_pipeline_summary``
(bucketed's speed-up over padding and packing); exits 1 if the oracle fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch
from torch import nn
from varlen import fit_cost, workload, workload_args  # benchmarks/varlen.py: the same workload

import sparta
from sparta.parallel import Decoder, ParallelConfig, ParallelDims, ParallelModel, build_layout, parallelize
from sparta.scheduling import (
    IGNORE_INDEX,
    LengthCost,
    MicroBatch,
    bucketed_steps,
    collate,
    pack_batches,
    pipeline_seconds,
)

Step = tuple[torch.Tensor, torch.Tensor]


def _dealt(count: int, steps: int, microbatches: int) -> list[list[list[int]]]:
    """Rows 0..count-1 (samples, or packed rows) dealt round-robin into ``steps`` x
    ``microbatches`` micro-batches, so that every micro-batch has one at least."""
    slots: list[list[int]] = [[] for _ in range(steps * microbatches)]
    for k in range(count):
        slots[k % len(slots)].append(k)
    if not all(slots):
        raise SystemExit(f"{count} rows do not fill {steps} x {microbatches} micro-batches: pass more samples")
    return [slots[s * microbatches : (s + 1) * microbatches] for s in range(steps)]


def _padded_steps(samples: list[torch.Tensor], seq_len: int, rows: int, m: int) -> list[Step]:
    steps = -(-len(samples) // (m * rows))
    out = []
    for step in _dealt(len(samples), steps, m):
        parts = [collate(samples, MicroBatch(tuple(mb), rows, seq_len)) for mb in step]
        out.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    return out


def _packed_steps(samples: list[torch.Tensor], lengths: list[int], seq_len: int, rows: int, m: int) -> list[Step]:
    packed = pack_batches(lengths, seq_len, seq_len)  # one row each
    steps = -(-len(packed) // (m * rows))
    out = []
    for step in _dealt(len(packed), steps, m):
        ids = torch.zeros(m * rows, seq_len, dtype=torch.long)
        targets = torch.full((m * rows, seq_len), IGNORE_INDEX, dtype=torch.long)
        for k, mb in enumerate(step):
            for r, row in enumerate(mb):
                col = 0
                for i in packed[row].samples:
                    n = samples[i].numel() - 1
                    ids[k * rows + r, col : col + n] = samples[i][:-1]
                    targets[k * rows + r, col : col + n] = samples[i][1:]
                    col += n
        out.append((ids, targets))
    return out


def _fit_on_pipeline(
    pm: ParallelModel, world: sparta.World, a: argparse.Namespace, buckets: tuple[int, ...]
) -> LengthCost:
    """`LengthCost.fit` to whole steps of ``pm`` (see the module docstring), the same on every
    rank (it fits the slowest rank's times, which every rank gathers)."""
    m, pp = a.microbatches, world.size
    shapes = [(r, n) for r in (1, 2, 4) for n in buckets if r * n <= a.max_tokens]
    g = torch.Generator().manual_seed(a.seed + 1)
    seconds = []
    for r, n in shapes:
        ids = torch.randint(0, a.vocab, (m * r, n), generator=g)
        times = []
        for _ in range(4):
            world.comm.all_reduce(torch.zeros(1))  # a barrier on every engine
            began = time.perf_counter()
            pm.step(ids, ids)
            times.append(float(max(world.comm.all_gather(torch.tensor([time.perf_counter() - began])))))
            for q in pm.parameters():
                q.grad = None
        seconds.append(statistics.median(times[1:]) / ((m + pp - 1) / pp))
    return LengthCost.fit(shapes, seconds)


@torch.no_grad()
def _reference(model: Decoder, ids: torch.Tensor, targets: torch.Tensor, m: int) -> float:
    losses = [
        float(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX))
        for x, y in zip(ids.chunk(m), targets.chunk(m), strict=True)
    ]
    return sum(losses) / m


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_args(p, 4, "micro-batches per step (the schedule's)")
    p.add_argument("--buckets", default="64,128,256,512", help="the bucketed way's padded lengths")
    p.add_argument("--fit", choices=("pipeline", "process"), default="pipeline", help="where the cost is timed")
    a = p.parse_args()
    torch.set_num_threads(1)
    world = sparta.init()
    pp, m = world.size, a.microbatches
    layout = build_layout(ParallelDims(pp=pp), world)
    cfg, lengths, samples = workload(a)
    buckets = tuple(int(b) for b in a.buckets.split(","))
    torch.manual_seed(a.seed)
    reference = Decoder(cfg)
    rows = a.max_tokens // a.seq_len
    configs = {
        "padded": ParallelConfig(microbatches=m, seq_len=a.seq_len),
        "packed": ParallelConfig(microbatches=m),
        "bucketed": ParallelConfig(microbatches=m, lengths=buckets),
    }
    per = a.layers // pp
    split = tuple(f"layers.{per * s}" for s in range(1, pp))
    models = {}
    for name, config in configs.items():
        torch.manual_seed(a.seed)
        models[name] = parallelize(Decoder(cfg), layout, dataclasses.replace(config, split_points=split))
    if a.fit == "pipeline":
        cost = _fit_on_pipeline(models["bucketed"], world, a, buckets)
    else:
        local = fit_cost(reference, a)[0] if world.rank == 0 else LengthCost(0.0, 0.0)
        agreed = world.comm.broadcast(torch.tensor([local.alpha, local.per_token, local.per_token_len]), src=0)
        cost = LengthCost(*(float(v) for v in agreed))  # type: ignore[union-attr]
    if world.rank == 0:
        fit = {"record": "varlen_pipeline_fit", "fit": a.fit, "alpha_s": cost.alpha, "per_token_s": cost.per_token}
        print(json.dumps({**fit, "per_token_len_s": cost.per_token_len}), flush=True)

    plan = bucketed_steps(lengths, cost, buckets, a.max_tokens, m, stages=pp)
    bucketed = []
    for step in plan:
        parts = [collate(samples, mb) for mb in step]
        bucketed.append((torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])))
    ways: dict[str, list[Step]] = {
        "padded": _padded_steps(samples, a.seq_len, rows, m),
        "packed": _packed_steps(samples, lengths, a.seq_len, rows, m),
        "bucketed": bucketed,
    }

    def run_pass(name: str) -> tuple[float, list[float]]:
        pm, losses = models[name], []
        world.comm.all_reduce(torch.zeros(1))  # a barrier on every engine
        began = time.perf_counter()
        for ids, targets in ways[name]:
            losses.append(pm.step(ids, targets))
            for q in pm.parameters():
                q.grad = None
        took = max(world.comm.all_gather(torch.tensor([time.perf_counter() - began])))  # the slowest rank
        return float(took), losses

    wrong = 0
    for name, steps in ways.items():  # the untimed pass, checked against one process
        _, losses = run_pass(name)
        if world.rank == 0:
            want = [_reference(reference, ids, targets, m) for ids, targets in steps]
            gaps = [abs(x - y) / abs(y) for x, y in zip(losses, want, strict=True)]
            wrong += max(gaps) > 1e-5
            print(json.dumps({"record": "varlen_pipeline_oracle", "way": name, "max_rel_gap": max(gaps)}), flush=True)
    times: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for r in range(a.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(run_pass(name)[0])
    for pm in models.values():
        pm.close()
    if world.rank == 0:
        measured = {name: statistics.median(t) for name, t in times.items()}
        for name, steps in ways.items():
            shapes = sorted({tuple(ids.shape) for ids, _ in steps})
            mbs = [MicroBatch((), ids.shape[0] // m, ids.shape[1]) for ids, _ in steps]
            predicted = sum(pipeline_seconds([mb] * m, cost, pp) for mb in mbs)
            record = {
                "record": "varlen_pipeline_way", "way": name, "pp": pp, "microbatches": m, "steps": len(steps),
                "shapes": shapes, "tokens_with_padding": sum(ids.numel() for ids, _ in steps),
                "real_tokens": sum(lengths), "predicted_s": round(predicted, 4),
                "measured_s": round(measured[name], 4), "min_s": round(min(times[name]), 4),
                "max_s": round(max(times[name]), 4), "error": round(predicted / measured[name] - 1, 4),
            }  # fmt: skip
            print(json.dumps(record), flush=True)
        summary = {
            "record": "varlen_pipeline_summary",
            "command": " ".join(sys.argv),
            "bucketed_vs_padded": round(measured["padded"] / measured["bucketed"], 3),
            "bucketed_vs_packed": round(measured["packed"] / measured["bucketed"], 3),
            "fit": a.fit,
            "wrong": int(wrong),
        }
        print(json.dumps(summary), flush=True)
    flag = world.comm.broadcast(torch.tensor([float(wrong)]), src=0)
    world.exit()
    return 1 if float(flag[0]) else 0  # type: ignore[index]


if __name__ == "__main__":
    sys.exit(main())
