"""Vocabulary parallelism over the pipeline ranks against the naive and the balanced split,
one launch, the variants alternating.

    torchrun --nproc-per-node 2 benchmarks/vocab_stages.py                       # pp=2
    torchrun --nproc-per-node 2 benchmarks/vocab_stages.py --vocabs 2048 --repeats 2   # smoke

The reference Decoder (``--d-model``, ``--layers``, ``--seq-len``) over ``pp`` = world size
pipeline ranks, ``--microbatches`` micro-batches, at each of ``--vocabs``, five ways:

- ``naive_1f1b``: 1F1B, one stage per rank, the layers cut evenly, the token embedding on
  the first stage and the norm and the whole head on the last (the plain pipeline);
- ``naive``: the same under Interleaved1F1B with two stages per rank (as the next three);
- ``balanced``: the layers cut by measured time counting the head (`split_by_cost`, the
  trainer's default without split points): the last stage gets fewer layers, but never less
  than the head;
- ``vocab``: ``ParallelConfig.vocab_stages``: the layers cut evenly over ``pp`` stages, the
  head split by vocabulary into ``pp`` stages of its own, one per rank (Vocabulary
  Parallelism, arXiv 2411.05288);
- ``vocab_both``: that and ``embedding_stages`` (the token embedding as ``pp`` stages in
  front), three stages per rank.

Each step is `ParallelModel.step`, global-norm clipping and AdamW, from a barrier; the
slowest rank's time counts; the median (min, max) of ``--repeats`` steps after one untimed
step, the ways alternating. The oracle: each way's first loss equals one process's (the whole
model on the same micro-batches, rank 0), within 1e-5 relative; the run exits 1 otherwise.

Memory, then, each way alone (built, one step, its peak measured over two more): per rank,
``state_mib`` (parameters, gradients and AdamW's two moments: exact) and ``activation_mib``
(the growth of the resident set over those steps on CPU, from its value after the warm-up
step: /proc's VmHWM, reset through clear_refs; ``torch.cuda.max_memory_allocated`` less the
memory allocated before them on CUDA). ``peak_mib`` is their sum, ``spread_mib`` the largest
rank's less the smallest's.

Prints JSON lines ``vocab_stages`` (per vocabulary and way) and ``vocab_stages_summary`` (per
vocabulary: each vocab way's speed-up over each naive one and balanced, and the memory
spreads).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import sparta
from sparta.parallel import (
    Decoder,
    DecoderConfig,
    ParallelConfig,
    ParallelDims,
    ParallelModel,
    build_layout,
    parallelize,
)

WAYS = ("naive_1f1b", "naive", "balanced", "vocab", "vocab_both")
BASELINES, OURS = ("naive_1f1b", "naive", "balanced"), ("vocab", "vocab_both")


def _config(way: str, pp: int, layers: int, microbatches: int) -> ParallelConfig:
    per_rank = {"naive_1f1b": 1, "vocab_both": 3}.get(way, 2)
    stages = pp if way in OURS or way == "naive_1f1b" else 2 * pp  # the layers' stages
    even = tuple(f"layers.{layers * s // stages}" for s in range(1, stages))
    return ParallelConfig(
        schedule="1F1B" if way == "naive_1f1b" else "Interleaved1F1B",
        microbatches=microbatches,
        stages_per_rank=per_rank,
        split_points=None if way == "balanced" else even,
        vocab_stages=way in OURS,
        embedding_stages=way == "vocab_both",
        tensor_parallel=False,
    )


def _batch(cfg: DecoderConfig, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _build(way: str, cfg: DecoderConfig, layout: object, args: argparse.Namespace) -> tuple[ParallelModel, object]:
    torch.manual_seed(0)
    model = Decoder(cfg)
    sample = _batch(cfg, args.batch // args.microbatches, 99)[0]
    pm = parallelize(model, layout, _config(way, args.pp, cfg.n_layers, args.microbatches), sample=sample)  # type: ignore[arg-type]
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-3)


def _train_step(pm: ParallelModel, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    loss = pm.step(*batch)
    pm.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _slowest(world: sparta.World, seconds: float) -> float:
    got = world.comm.all_gather(torch.tensor([seconds], dtype=torch.float64))
    return max(float(t) for t in got)  # type: ignore[union-attr, arg-type]


def _reference(cfg: DecoderConfig, batch: tuple[torch.Tensor, torch.Tensor], microbatches: int) -> float:
    torch.manual_seed(0)
    model = Decoder(cfg)
    with torch.no_grad():
        losses = [
            float(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
            for x, y in zip(batch[0].tensor_split(microbatches), batch[1].tensor_split(microbatches), strict=True)
        ]
    return sum(losses) / len(losses)


def _status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _state_mib(pm: ParallelModel, opt: torch.optim.Optimizer) -> float:
    total = 0
    for p in pm.parameters():
        total += p.numel() * p.element_size() * (2 if p.grad is not None else 1)
        total += sum(t.numel() * t.element_size() for t in opt.state.get(p, {}).values() if isinstance(t, torch.Tensor))
    return total / 2**20


def _memory(
    way: str, cfg: DecoderConfig, layout: object, world: sparta.World, args: argparse.Namespace
) -> list[list[float]]:
    """[state MiB, activation MiB] of every rank for ``way`` built alone."""
    gc.collect()
    cuda = args.device == "cuda"
    if not cuda:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed arenas back to the OS before the baseline
    pm, opt = _build(way, cfg, layout, args)
    try:
        batch = _batch(cfg, args.batch, 1)
        _train_step(pm, opt, batch)  # the warm-up: optimizer state and gradients exist from here on
        opt.zero_grad(set_to_none=False)  # gradients stay allocated, as they do between real steps
        gc.collect()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() / 2**20
        else:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the resident set now
            base = _status_mib("VmRSS")
        for seed in (2, 3):
            _train_step(pm, opt, _batch(cfg, args.batch, seed))
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _status_mib("VmHWM")
        state = _state_mib(pm, opt)
    finally:
        pm.close()
    got = world.comm.all_gather(torch.tensor([state, peak - base], dtype=torch.float64))
    return [[float(v) for v in t] for t in got]  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", default="32000,256000", help="comma-separated vocabulary sizes")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--d-ff", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = sparta.init()
    args.pp = world.size
    layout = build_layout(ParallelDims(pp=world.size), world, device=args.device)
    failed = False
    for vocab in (int(v) for v in args.vocabs.split(",")):
        cfg = DecoderConfig(vocab_size=vocab, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                            n_heads=args.heads, d_ff=args.d_ff)  # fmt: skip
        batch = _batch(cfg, args.batch, 1)
        want = _reference(cfg, batch, args.microbatches) if world.rank == 0 else 0.0
        built = {way: _build(way, cfg, layout, args) for way in WAYS}
        first = {way: _train_step(*built[way], batch) for way in WAYS}  # untimed; the oracle
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for repeat in range(args.repeats):
            for way in WAYS:
                step = _batch(cfg, args.batch, 10 + repeat)
                world.comm.barrier()
                start = time.perf_counter()
                _train_step(*built[way], step)
                times[way].append(_slowest(world, time.perf_counter() - start))
        stages = {way: [line for line in str(built[way][0].plan).splitlines() if line.startswith("stage ")]
                  for way in WAYS}  # fmt: skip
        for pm, _ in built.values():
            pm.close()
        del built
        memory = {way: _memory(way, cfg, layout, world, args) for way in WAYS}
        if world.rank != 0:
            continue
        summary: dict[str, object] = {"bench": "vocab_stages_summary", "vocab": vocab, "pp": args.pp}
        for way in WAYS:
            wrong = abs(first[way] - want) > 1e-5 * abs(want)
            failed |= wrong
            peaks = [state + act for state, act in memory[way]]
            record = {
                "bench": "vocab_stages", "vocab": vocab, "way": way, "pp": args.pp, "d_model": args.d_model,
                "layers": args.layers, "seq_len": args.seq_len, "batch": args.batch,
                "microbatches": args.microbatches, "device": args.device,
                "median_s": statistics.median(times[way]), "min_s": min(times[way]), "max_s": max(times[way]),
                "tokens_per_s": args.batch * args.seq_len / statistics.median(times[way]),
                "first_loss": first[way], "one_process_loss": want, "wrong": wrong,
                "state_mib": [round(m[0], 1) for m in memory[way]],
                "activation_mib": [round(m[1], 1) for m in memory[way]],
                "peak_mib": [round(p, 1) for p in peaks], "spread_mib": round(max(peaks) - min(peaks), 1),
                "stages": stages[way],
            }  # fmt: skip
            print(json.dumps(record), flush=True)
            summary[f"{way}_spread_mib"] = record["spread_mib"]
            summary[f"{way}_max_peak_mib"] = round(max(peaks), 1)
        for ours in OURS:
            for base in BASELINES:
                ratio = statistics.median(times[base]) / statistics.median(times[ours])
                summary[f"{ours}_over_{base}"] = round(ratio, 3)
        print(json.dumps(summary), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
