"""Sparse embeddings vs the data-parallel baselines, on 4 ranks.

    python benchmarks/embedding.py                  # launches torchrun and horovodrun, prints JSON lines
    python benchmarks/embedding.py --vocabs 50000 --steps 8
    torchrun --nproc-per-node 4 benchmarks/embedding.py --worker       # one launch, by hand

Model per rank: an embedding [vocab, 512] + a small dense block (512 -> 512 -> 512, GELU),
loss = mean square of its output, SGD; each step looks up 8 x 512 ids drawn from a Zipf
distribution (s = 1.1). Variants, run in one launch per engine:
  ddp            nn.Embedding under torch DDP (the table's dense gradient is all-reduced)
  hvd_sparse     nn.Embedding(sparse=True) under hvd.DistributedOptimizer (allgather of rows)
  hvd_dense      the same with sparse_as_dense=True (dense all-reduce)
  sparta_row / sparta_column   SparseEmbedding (sparta.embedding.swap_embeddings over the
                 layout's dp group) under sparta.parallel.DataParallel with the engine's own
                 strategy: the dense block on DDP under torchrun, on Horovod under horovodrun
  sparta_row_sparse / sparta_column_sparse   the same from nn.Embedding(sparse=True): the
                 shard's gradient is sparse, so SGD updates the touched rows only
  sparta_row_queue     DataParallel("sparta"): dense buckets through the PriorityQueue,
                 chunks issued while backward computes, the table's all-to-all a task of the
                 same queue that overtakes the dense chunks not yet issued
  sparta_row_noqueue   DataParallel("sparta", queue=False): the same buckets sent straight to
                 the engine in backward order, the rows exchanged inside backward
  sparta_row_keyorder  the queue issuing strictly in key order (chunks_per_ready=0): the
                 table's task comes first, so nothing travels until backward is done
  dense_block_alone    the dense block's forward+backward+step on one rank's [8, 512, 512]
                 activations, no embedding and no communication (what the step cannot beat)
Each line: median step time of the slowest rank (barrier before and after each step; the
DataParallel variants also report finish_s, the median time in DataParallel.finish(): the
communication left when backward ends), bytes this rank sends per step (ring all-reduce:
2 (w-1)/w of the gradient; ring allgather: w-1 times the local rows; all-to-all: what goes to
other ranks), and memory per rank: the embedding's parameter + gradient bytes, and the
process's peak RSS.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

DIM, BATCH, SEQ, ZIPF_S = 512, 8, 512, 1.1


class Model(nn.Module):
    def __init__(self, vocab: int, sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, DIM, sparse=sparse)
        self.block = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.emb(ids)).square().mean()


def zipf_batches(vocab: int, rank: int, steps: int) -> list[torch.Tensor]:
    probs = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-ZIPF_S)
    gen = torch.Generator().manual_seed(1234 + rank)
    return [
        torch.multinomial(probs, BATCH * SEQ, replacement=True, generator=gen).view(BATCH, SEQ) for _ in range(steps)
    ]


def ring_allreduce_bytes(numel: int, world: int) -> int:
    return 2 * (world - 1) * numel * 4 // world


def sparta_bytes(emb: nn.Module, world: int, rank: int) -> int:
    """Ids out, rows back, gradients out, counts, to ranks other than this one."""
    route, layout = emb.last_route, emb.layout
    others_send = sum(c for r, c in enumerate(route.send) if r != rank)
    others_recv = sum(c for r, c in enumerate(route.recv) if r != rank)
    row = layout.shard_dim * 4
    return others_send * 8 + others_recv * row + others_send * row + (world - 1) * 4 * 8


QUEUES = {"queue": 2, "keyorder": 0}  # chunks_per_ready of the queue variants
QUEUE_CHUNK_BYTES = 256 << 10  # 4 chunks per dense weight matrix


def run_variant(name: str, vocab: int, world, layout, steps: int, warmup: int) -> dict:
    from sparta.comm import QueueConfig
    from sparta.embedding import swap_embeddings
    from sparta.parallel import DataParallel

    comm = world.comm
    dp = None
    torch.manual_seed(0)
    sparse_grad = name.endswith("_sparse")
    base_name = name.removesuffix("_sparse")
    model = Model(vocab, sparse=name.startswith("hvd") or sparse_grad)
    dense_numel = sum(p.numel() for p in model.block.parameters())
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        net, opt = DDP(model, process_group=comm.pg), sgd(model.parameters())
        sent = ring_allreduce_bytes(vocab * DIM + dense_numel, comm.size)
    elif name.startswith("hvd"):
        import horovod.torch as hvd

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(
            sgd(model.parameters()), named_parameters=model.named_parameters(), sparse_as_dense=name == "hvd_dense"
        )
        net = model
        if name == "hvd_dense":
            sent = ring_allreduce_bytes(vocab * DIM + dense_numel, comm.size)
        else:  # indices (int64) and rows of every looked-up id, undeduplicated, around the ring
            sent = (comm.size - 1) * BATCH * SEQ * (8 + DIM * 4) + ring_allreduce_bytes(dense_numel, comm.size)
    elif name == "dense_block_alone":
        hidden = torch.randn(BATCH, SEQ, DIM)
        net, opt, sent = (lambda ids: model.block(hidden).square().mean()), sgd(model.block.parameters()), 0
    else:
        _, sharding, *queue = base_name.split("_")
        swap_embeddings(model, layout.dp, sharding)
        if not queue:
            dp = DataParallel(layout, {"torch": "ddp", "horovod": "horovod"}.get(comm.backend, "sparta"), 1, False)
        elif queue[0] == "noqueue":
            dp = DataParallel(layout, "sparta", 1, False, queue=False)
        else:
            config = QueueConfig(QUEUE_CHUNK_BYTES, chunks_per_ready=QUEUES[queue[0]])
            dp = DataParallel(layout, "sparta", 1, False, queue_config=config)
        net = dp.wrap(model)
        opt = sgd(net.parameters())
    batches = zipf_batches(vocab, comm.rank, steps + warmup)
    finish_s: list[float] = []

    def step(ids: torch.Tensor) -> None:
        if dp is None:
            net(ids).backward()
        else:
            dp.start()
            net(ids).backward()
            begin = time.perf_counter()
            dp.finish()
            finish_s.append(time.perf_counter() - begin)
        opt.step()
        opt.zero_grad()

    times, sparta_sent = [], []
    for i, ids in enumerate(batches):
        comm.barrier()
        start = time.perf_counter()
        step(ids)
        comm.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            if name.startswith("sparta"):
                sparta_sent.append(
                    sparta_bytes(model.emb, comm.size, comm.rank) + ring_allreduce_bytes(dense_numel, comm.size)
                )
    if sparta_sent:
        sent = int(statistics.mean(sparta_sent))
    exposed = {"finish_s": round(statistics.median(finish_s[warmup:]), 5)} if finish_s else {}
    if dp is not None:
        dp.close()
    emb_param = model.emb.weight
    grad_bytes = emb_param.numel() * 4
    if sparse_grad and name.startswith("sparta"):  # the rows this rank's shard received gradients for
        grad_bytes = sum(model.emb.last_route.recv) * model.emb.layout.shard_dim * 4
    return {
        "variant": name,
        "engine": comm.backend,
        "vocab": vocab,
        "dim": DIM,
        "ranks": comm.size,
        "ids_per_rank": BATCH * SEQ,
        "median_step_s": round(statistics.median(times), 5),
        "bytes_sent_per_rank_per_step": sent,
        "embedding_param_grad_bytes_per_rank": 0 if name == "dense_block_alone" else emb_param.numel() * 4 + grad_bytes,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        **exposed,
    }


def worker(args: argparse.Namespace) -> None:
    import sparta

    torch.set_num_threads(1)
    from sparta.parallel import ParallelDims, build_layout

    world = sparta.init()
    layout = build_layout(ParallelDims(dp=world.size), world)
    if world.backend == "torch":
        variants = ["ddp", "sparta_row", "sparta_column", "sparta_row_queue", "sparta_row_noqueue"]
        variants += ["sparta_row_keyorder", "sparta_row_sparse", "sparta_column_sparse"]
    else:
        variants = ["hvd_sparse", "hvd_dense", "sparta_row", "sparta_column"]
        variants += ["sparta_row_sparse", "sparta_column_sparse"]
    if args.dense_alone and world.backend == "torch":
        variants.append("dense_block_alone")
    for vocab in args.vocabs:
        for name in variants:
            result = run_variant(name, vocab, world, layout, args.steps, args.warmup)
            # the slowest rank's median is the step time everyone sees
            worst = world.comm.all_gather(torch.tensor([result["median_step_s"], result["peak_rss_mib"]]))
            result["median_step_s"] = round(max(float(w[0]) for w in worst), 5)
            result["peak_rss_mib_max_rank"] = int(max(float(w[1]) for w in worst))
            if world.rank == 0:
                print(json.dumps(result), flush=True)
    gc.collect()  # DDP's reducers must go before the process group, or the exit aborts
    world.shutdown()


def launch(args: argparse.Namespace) -> None:
    py, me, n = sys.executable, str(Path(__file__).resolve()), str(args.ranks)
    extra = ["--worker", "--steps", str(args.steps), "--warmup", str(args.warmup), "--vocabs", *map(str, args.vocabs)]
    extra += ["--dense-alone" if args.dense_alone else "--no-dense-alone"]
    commands = {
        "torch": [py, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "--master-port=29631", me],
        "horovod": [str(Path(py).parent / "horovodrun"), "--gloo", "-np", n, "-H", f"localhost:{n}", py, me],
    }
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for engine in args.engines:
        proc = subprocess.run(commands[engine] + extra, capture_output=True, text=True, env=env, timeout=3600)
        lines = [ln[ln.index("{") :] for ln in proc.stdout.splitlines() if '"variant"' in ln]
        for line in lines:
            print(line, flush=True)
        if proc.returncode != 0:
            sys.exit(f"{engine} launch failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help="run as one rank of an already launched job")
    parser.add_argument("--vocabs", type=int, nargs="+", default=[50_000, 250_000])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--dense-alone", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--engines", nargs="+", default=["torch", "horovod"], choices=["torch", "horovod"])
    args = parser.parse_args()
    worker(args) if args.worker else launch(args)


if __name__ == "__main__":
    main()
