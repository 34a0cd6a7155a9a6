"""Train a small GPT-style MoE language model on Python's standard library, experts sharded over ranks.

    torchrun --nproc-per-node 4 examples/train_moe_lm.py
    mpirun --oversubscribe -np 4 python examples/train_moe_lm.py
    horovodrun -np 4 -H localhost:4 python examples/train_moe_lm.py
    python examples/train_moe_lm.py                     # one process, all experts local

Every rank trains on its own batches. The dense weights (attention, norms, embeddings, routers)
are replicated and their gradients averaged; the experts of every MoE layer are split over all
ranks (expert parallelism), tokens travelling to them by all-to-all. Rank 0 shows a progress
bar, evaluates every --eval-every steps, and prints a JSON summary as its last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch
from moe_lm.data import Batches, load_tokens
from moe_lm.model import ModelConfig, MoEGPT
from moe_lm.train import TrainConfig, train

import sparta
from sparta.moe import ROUTERS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--batch", type=int, default=TrainConfig.batch, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--d-model", type=int, default=ModelConfig.d_model)
    p.add_argument("--d-ff", type=int, default=None, help="hidden width of each expert (default: 2 * d-model)")
    p.add_argument("--layers", type=int, default=ModelConfig.n_layers)
    p.add_argument("--heads", type=int, default=ModelConfig.n_heads)
    p.add_argument("--experts", type=int, default=ModelConfig.num_experts)
    p.add_argument("--top-k", type=int, default=ModelConfig.top_k)
    p.add_argument(
        "--router",
        choices=ROUTERS,
        default=ModelConfig.router,
        help="expert_choice and soft mix the positions of a sequence, so they are not causal: their loss flatters",
    )
    p.add_argument("--capacity-factor", type=float, default=None, help="default: dropless")
    p.add_argument("--seq-len", type=int, default=ModelConfig.seq_len)
    p.add_argument("--vocab", type=int, default=ModelConfig.vocab_size, help="BPE vocabulary size")
    p.add_argument("--corpus-mb", type=float, default=TrainConfig.corpus_mb, help="MB of stdlib source to train on")
    p.add_argument("--backend", choices=("auto", "torch", "mpi", "horovod"), default="auto")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Validate before starting any engine: a bad flag fails on every rank alike, with no hang.
    train_cfg = TrainConfig(
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        eval_every=args.eval_every,
        corpus_mb=args.corpus_mb,
        seed=args.seed,
    )
    model_cfg = ModelConfig(
        vocab_size=args.vocab,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        num_experts=args.experts,
        top_k=args.top_k,
        d_ff=args.d_ff or 2 * args.d_model,
        router=args.router,
        capacity_factor=args.capacity_factor,
    )
    # Several ranks share a node's cores: more than one thread each would only contend.
    torch.set_num_threads(1)
    # Launchers pipe stdout: flush each line so that the log keeps pace with the progress bar.
    sys.stdout.reconfigure(line_buffering=True)
    start = time.perf_counter()
    world = sparta.init(backend=args.backend)
    model_cfg = dataclasses.replace(model_cfg, ep_size=world.size)  # re-validates: experts % ranks
    say = print if world.rank == 0 else lambda *_: None

    tokens = load_tokens(world, train_cfg.corpus_mb, args.vocab, log=say)
    batches = Batches(tokens, model_cfg.seq_len, world.rank, world.size, train_cfg.seed)
    torch.manual_seed(train_cfg.seed)  # same seed on every rank: identical dense weights
    model = MoEGPT(model_cfg, world.comm)
    dense = sum(p.numel() for p in model.dense_parameters())
    experts = sum(p.numel() for p in model.expert_parameters()) * world.size
    say(
        f"{world.size} rank(s) on {world.backend}, {len(batches.train):,} tokens to train on; "
        f"{dense / 1e6:.2f}M dense + {experts / 1e6:.2f}M expert parameters, "
        f"{model_cfg.num_experts} experts top-{model_cfg.top_k} ({model_cfg.num_experts // world.size} per rank)"
    )
    result = train(world, model, batches, train_cfg)
    summary = {
        "steps": train_cfg.steps,
        "ranks": world.size,
        "backend": world.backend,
        **{k: round(v, 4) for k, v in result.items()},
        "wall_s": round(time.perf_counter() - start, 1),
    }
    say(
        f"{train_cfg.steps} steps: train loss {summary['initial_loss']:.3f} -> {summary['final_loss']:.3f} "
        f"(mean of the last 10 steps), val loss {summary['initial_val_loss']:.3f} -> {summary['val_loss']:.3f}, "
        f"{summary['tokens_per_s']:,.0f} tokens/s over {world.size} ranks, {summary['wall_s']} s"
    )
    say(json.dumps(summary))
    world.exit()


if __name__ == "__main__":
    main()
