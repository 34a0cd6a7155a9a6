"""The output head split by vocabulary over tp against whole on every tp rank, one launch.

    torchrun --nproc-per-node 2 benchmarks/vocab_head.py --vocabs 2048,32768

The reference decoder (d 256, 6 layers, 16 heads, MLP 768, seq 512, 2 sequences) on tp
ranks, built twice per vocabulary from the same seed: ``split`` (ParallelConfig's default,
``vocab_parallel_head=True``: the head's columns over tp, the loss on the shards) and
``whole`` (``vocab_parallel_head=False``). Each step is forward, backward, clip and AdamW,
starting at a barrier; the variants alternate, the first two steps of each are not timed.
Prints one JSON line per (vocabulary, variant): median, min and max seconds per step (the
slowest rank's), and ``wrong``: whether the first step's loss differs from the other
variant's by more than 1e-5 (they start from the same weights).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import sparta
from sparta.parallel import Decoder, DecoderConfig, ParallelConfig, ParallelDims, build_layout, parallelize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", default="2048,32768", help="comma-separated vocabulary sizes")
    parser.add_argument("--steps", type=int, default=14, help="steps per variant, the first two untimed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = sparta.init()
    layout = build_layout(ParallelDims(tp=world.size), world)
    for vocab in (int(v) for v in args.vocabs.split(",")):
        cfg = DecoderConfig(vocab_size=vocab, seq_len=512, d_model=256, n_layers=6, n_heads=16, d_ff=768)
        runs = {}
        for name in ("split", "whole"):
            torch.manual_seed(0)
            pm = parallelize(Decoder(cfg), layout, ParallelConfig(split_points=(), vocab_parallel_head=name == "split"))
            runs[name] = (pm, torch.optim.AdamW(pm.parameters(), lr=3e-4))
        ids = torch.randint(0, vocab, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
        times: dict[str, list[float]] = {name: [] for name in runs}
        first: dict[str, float] = {}
        for step in range(args.steps):
            for name in ("split", "whole") if step % 2 else ("whole", "split"):
                pm, opt = runs[name]
                world.comm.all_reduce(torch.zeros(1))  # a barrier on every engine
                began = time.perf_counter()
                loss = pm.step(ids[:, :-1], ids[:, 1:])
                pm.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
                took = max(world.comm.all_gather(torch.tensor([time.perf_counter() - began])))  # the slowest rank
                first.setdefault(name, loss)
                if step >= 2:
                    times[name].append(float(took))
        for name, (pm, _) in runs.items():
            pm.close()
            if world.rank == 0:
                ts = times[name]
                record = {"bench": "vocab_head", "vocab": vocab, "tp": world.size, "variant": name,
                          "median_s": round(statistics.median(ts), 5), "min_s": round(min(ts), 5),
                          "max_s": round(max(ts), 5), "steps": len(ts), "first_loss": round(first[name], 6),
                          "wrong": abs(first["split"] - first["whole"]) > 1e-5}  # fmt: skip
                print(json.dumps(record), flush=True)
    world.exit()


if __name__ == "__main__":
    main()
