"""Suite `embedding`: a training step of a model with a large embedding table, by how its
gradients travel (benchmarks/embedding.py's variants, on the launched ranks).

Model per rank: an embedding [vocab, dim] + a dense block (--block mlp: dim -> dim -> dim, GELU;
--block transformer: one encoder layer, attention + MLP), loss =
mean square of its output, SGD (lr 0.1); each step looks up --batch x --seq ids drawn from a
Zipf distribution (--zipf-s) seeded by (seed, rank, step). Variants, alternating:
    ddp                 nn.Embedding under torch DDP (the table's dense gradient all-reduced)   [torch]
    hvd_sparse          nn.Embedding(sparse=True) under hvd.DistributedOptimizer (allgather;    [horovod]
                        the gathered gradient coalesced before the step: see Variant.step)
    hvd_dense           the same, sparse_as_dense=True (dense all-reduce)                        [horovod]
    sparta_row, sparta_column   SparseEmbedding (swap_embeddings over the layout's dp group)
                        under sparta.parallel.DataParallel with the engine's strategy
    sparta_row_sparse, sparta_column_sparse   from nn.Embedding(sparse=True): sparse shard gradients
    sparta_row_queue    DataParallel("sparta"): dense buckets through the PriorityQueue     [torch, mpi]
    sparta_row_noqueue  DataParallel("sparta", queue=False)                                     [torch, mpi]
    dense_block_alone   the dense block's step on [batch, seq, dim] activations, no table (a floor)
Check: before timing and after it, every variant's forward (the block's output on a seeded
probe batch) is compared with a one-process model that replays the same steps on every
rank's batches (the mean loss over ranks is what data parallelism trains): a table or a
dense weight that any step updated wrongly shows. Fields: bytes_sent_per_step (rank 0's:
ring all-reduce 2(w-1)/w of a gradient, allgather (w-1) x the looked-up rows, all-to-all the
rows and ids to other ranks), table_bytes_per_rank (the embedding's parameter + gradient),
state_bytes_per_rank (every parameter and its gradient as the optimizer sees it, the largest
over the steps, warm-up included: sparse gradients count their values and indices, Horovod's gathered
one before it is coalesced, hvd_dense the dense table gradient it all-reduces before it turns
it back into a sparse one; activations, the same in every variant, are not counted).
On an emulated cluster (`--rate 1gbit --nprocs 2 --ranks-per-node 1`, root) the torch
variants run across shaped links, and the horovod ones too, started as horovodrun --gloo
starts them: the setting of issue 24's embedding race.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sparta.errors import ConfigError
from sparta_tools.bench.options import BenchOptions, SuiteFlags, comma_names, comma_numbers
from sparta_tools.bench.rank import BenchContext

VARIANTS = {
    "torch": ("ddp", "sparta_row", "sparta_column", "sparta_row_sparse", "sparta_column_sparse",
              "sparta_row_queue", "sparta_row_noqueue", "dense_block_alone"),
    "horovod": ("hvd_sparse", "hvd_dense", "sparta_row", "sparta_column", "sparta_row_sparse",
                "sparta_column_sparse", "dense_block_alone"),
    "mpi": ("sparta_row", "sparta_column", "sparta_row_sparse", "sparta_column_sparse", "sparta_row_queue",
            "sparta_row_noqueue", "dense_block_alone"),
}  # fmt: skip
ALL_VARIANTS = sorted({v for vs in VARIANTS.values() for v in vs})
BLOCKS = ("mlp", "transformer")
QUEUE_CHUNK_BYTES = 256 << 10
# The check's absolute term, a fraction of the probe output's largest magnitude: float32
# summation order leaves an absolute error at the scale of the output, not of each element,
# so near-zero outputs fail any rtol alone (a fixed 1e-6 flagged 15 of 2 x 2M outputs of
# sparta_*_sparse at vocab 250,000, dim 512, transformer, 5 steps). Measured against a float64
# replay (2 ranks, 8 x 512 Zipf ids), those 15 were the float32 reference's own rounding: the
# sparse variants had none beyond rtol 1e-4, the reference 15. Every variant and the reference
# stayed within 5.2e-7 of the scale over 26 steps (vocab 250,000, dim 128; 4.1e-7 over 5 at
# dim 512), a variant within 6.2e-7 of the reference; hvd_sparse stepping on its uncoalesced
# gradient (a real error, see Variant.step) was 6e-6 to 1e-5 off (vocab 100, 2 x 1024 ids).
# 2e-6 sits 3x from either side.
NOISE_FLOOR = 2e-6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocabs", default="50000", help="comma-separated vocabulary sizes (e.g. 50000,250000)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent of the ids")
    parser.add_argument("--block", default="mlp", choices=BLOCKS, help="the dense block on top")
    parser.add_argument("--variants", default="", help=f"comma-separated subset of {','.join(ALL_VARIANTS)}")
    rule = f"|got - want| <= rtol |want| + {NOISE_FLOOR:g} max|want|"
    parser.add_argument("--rtol", type=float, default=1e-4, help=f"check against the replayed model: {rule}")


def _vocabs_error(text: str) -> ConfigError:
    return ConfigError(f"--vocabs {text!r}: comma-separated table sizes >= 2, e.g. 50000,250000")


@dataclass(frozen=True)
class EmbeddingFlags(SuiteFlags):
    """`embedding`: the table sizes to run (--vocabs), the model's width, batch and sequence,
    the ids' Zipf exponent, the dense block (of BLOCKS), the variants (empty: every one of
    the engine's) and the check's rtol."""

    vocabs: tuple[int, ...]
    dim: int
    batch: int
    seq: int
    zipf_s: float
    block: str
    variants: tuple[str, ...]
    rtol: float

    def __post_init__(self) -> None:
        if not self.vocabs or min(self.vocabs) < 2:
            raise _vocabs_error(",".join(map(str, self.vocabs)))
        bad = [v for v in self.variants if v not in ALL_VARIANTS]
        if bad:
            raise ConfigError(f"--variants {bad}: unknown; known: {', '.join(ALL_VARIANTS)}")
        for name, value in (("dim", self.dim), ("batch", self.batch), ("seq", self.seq)):
            if value < 1:
                raise ConfigError(f"--{name} {value}: must be >= 1")
        if self.block not in BLOCKS:
            raise ConfigError(f"--block {self.block!r}: use one of {', '.join(BLOCKS)}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EmbeddingFlags:
        return cls(vocabs=comma_numbers(args.vocabs, int, _vocabs_error), dim=args.dim, batch=args.batch,
                   seq=args.seq, zipf_s=args.zipf_s, block=args.block, variants=comma_names(args.variants),
                   rtol=args.rtol)  # fmt: skip


def check(opts: BenchOptions) -> None:
    """The embedding suite's check of the whole run: float32 on CPU."""
    if opts.dtype != "float32" or opts.device != "cpu":
        raise ConfigError("the embedding suite trains in float32 on CPU (-d float32, --device cpu)")


class Model(nn.Module):
    """The table [vocab, dim] and a block on top: "mlp" (dim -> dim -> dim, GELU), or
    "transformer" (one pre-norm encoder layer: 8-head attention + a 4 dim MLP, no dropout)."""

    def __init__(self, vocab: int, dim: int, sparse: bool = False, block: str = "mlp") -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, sparse=sparse)
        self.block: nn.Module
        if block == "transformer":
            heads = 8 if dim % 8 == 0 else 1
            self.block = nn.TransformerEncoderLayer(
                dim, heads, dim_feedforward=4 * dim, dropout=0.0, batch_first=True, norm_first=True
            )
        else:
            self.block = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.emb(ids))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hidden(ids).square().mean()


class Batches:
    """Zipf ids [batch, seq] for (rank, step), the same wherever they are drawn."""

    def __init__(self, vocab: int, batch: int, seq: int, s: float, seed: int) -> None:
        self.probs = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-s)
        self.shape, self.seed = (batch, seq), seed

    def __call__(self, rank: int, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + rank * 10_007 + step)
        n = self.shape[0] * self.shape[1]
        return torch.multinomial(self.probs, n, replacement=True, generator=gen).view(self.shape)

    def probe(self, rank: int) -> torch.Tensor:
        return self(rank, -1 - rank)


class Reference:
    """One process replaying the data-parallel steps: SGD on the mean loss over every rank's batch."""

    def __init__(self, vocab: int, dim: int, ranks: int, batches: Batches, block: str) -> None:
        torch.manual_seed(0)
        self.model = Model(vocab, dim, block=block)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.ranks, self.batches, self.steps = ranks, batches, 0

    def after(self, steps: int) -> Model:
        while self.steps < steps:
            loss = sum(self.model(self.batches(r, self.steps)) for r in range(self.ranks)) / self.ranks
            loss.backward()  # type: ignore[union-attr]
            self.opt.step()
            self.opt.zero_grad()
            self.steps += 1
        return self.model


class Variant:
    """One variant's model, optimizer and step counter; `step()` is the timed call."""

    def __init__(
        self, name: str, ctx: BenchContext, layout: Any, vocab: int, dim: int, batches: Batches, block: str
    ) -> None:
        from sparta.comm import QueueConfig
        from sparta.embedding import swap_embeddings
        from sparta.parallel import DataParallel

        self.name, self.ctx, self.batches, self.steps, self.dp = name, ctx, batches, 0, None
        self.state_bytes = 0
        torch.manual_seed(0)
        sparse = name.startswith("hvd") or name.endswith("_sparse")
        self.model = Model(vocab, dim, sparse=sparse, block=block)
        params = list(self.model.parameters())
        self.net: Any = self.model
        if name == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.net = DDP(self.model, process_group=ctx.comm.pg)
        elif name.startswith("sparta"):
            _, sharding, *queue = name.removesuffix("_sparse").split("_")
            swap_embeddings(self.model, layout.dp, sharding)
            if not queue:
                strategy = {"torch": "ddp", "horovod": "horovod"}.get(ctx.engine, "sparta")
                self.dp = DataParallel(layout, strategy, 1, False)
            elif queue[0] == "noqueue":
                self.dp = DataParallel(layout, "sparta", 1, False, queue=False)
            else:
                self.dp = DataParallel(layout, "sparta", 1, False, queue_config=QueueConfig(QUEUE_CHUNK_BYTES))
            self.net = self.dp.wrap(self.model)
            params = list(self.net.parameters())
        elif name == "dense_block_alone":
            params = list(self.model.block.parameters())
            self.hidden = torch.randn(*batches.shape, dim)
        self.params = params
        self.opt: Any = torch.optim.SGD(params, lr=0.1)
        if name.startswith("hvd"):
            import horovod.torch as hvd

            self.opt = hvd.DistributedOptimizer(self.opt, named_parameters=self.model.named_parameters(),
                                                sparse_as_dense=name == "hvd_dense")  # fmt: skip

    def step(self) -> None:
        ids = self.batches(self.ctx.rank, self.steps)
        self.steps += 1
        if self.name == "dense_block_alone":
            self.model.block(self.hidden).square().mean().backward()
        elif self.dp is None:
            self.net(ids).backward()
        else:
            self.dp.start()
            self.net(ids).backward()
            self.dp.finish()
        if self.name.startswith("hvd"):
            self.opt.synchronize()
            self._count_state()
            if self.name == "hvd_sparse":
                # Horovod's allgather leaves one gradient row per id looked up on any rank, and
                # torch's SGD adds duplicate rows to the weight one at a time, each rounded
                # against the O(1) weight: at 2 x 2048 Zipf ids the hottest row (770 copies)
                # moved 4% short of its update (4.1e-5 off in float32 against a float64 step,
                # the dense step 1.5e-7), so the baseline sums the duplicates first, as DDP's
                # dense gradient and Sparta do.
                weight = self.model.emb.weight
                weight.grad = weight.grad.coalesce()
            with self.opt.skip_synchronize():
                self.opt.step()
        else:
            self._count_state()
            self.opt.step()
        self.opt.zero_grad()

    def _count_state(self) -> None:
        weight = self.model.emb.weight
        total = weight.numel() * weight.element_size() if self.name == "hvd_dense" else 0
        for p in self.params:
            g = p.grad
            total += p.numel() * p.element_size()
            if g is not None and g.is_sparse:
                total += g._values().numel() * g.element_size() + g._indices().numel() * 8
            elif g is not None:
                total += g.numel() * g.element_size()
        self.state_bytes = max(self.state_bytes, total)

    def probe(self) -> torch.Tensor:
        with torch.no_grad():
            return self.model.hidden(self.batches.probe(self.ctx.rank))

    def close(self) -> None:
        if self.dp is not None:
            self.dp.close()

    def sent_bytes(self, vocab: int, dim: int) -> int:
        """Bytes this rank sends per step (see the module docstring)."""
        w, numel = self.ctx.size, sum(p.numel() for p in self.model.block.parameters())
        ring = lambda n: 2 * (w - 1) * n * 4 // w  # noqa: E731
        ids = self.batches.shape[0] * self.batches.shape[1]
        if self.name in ("ddp", "hvd_dense"):
            return ring(vocab * dim + numel)
        if self.name == "hvd_sparse":
            return (w - 1) * ids * (8 + dim * 4) + ring(numel)
        if self.name == "dense_block_alone":
            return 0
        emb = self.model.emb
        route, me = emb.last_route, self.ctx.rank
        others_send = sum(c for r, c in enumerate(route.send) if r != me)
        others_recv = sum(c for r, c in enumerate(route.recv) if r != me)
        row = emb.layout.shard_dim * 4
        return others_send * 8 + others_recv * row + others_send * row + ring(numel)


def run(ctx: BenchContext) -> None:
    from sparta.parallel import ParallelDims, build_layout

    opts = ctx.opts
    flags = opts.flags_as(EmbeddingFlags)
    dim, batch, seq, block, rtol = flags.dim, flags.batch, flags.seq, flags.block, flags.rtol
    wanted = flags.variants or VARIANTS[ctx.engine]
    layout = build_layout(ParallelDims(dp=ctx.size), ctx.world)
    for vocab in flags.vocabs:
        batches = Batches(vocab, batch, seq, flags.zipf_s, opts.seed)
        reference = Reference(vocab, dim, ctx.size, batches, block)
        variants: dict[str, Variant] = {}
        for name in wanted:
            if name not in VARIANTS[ctx.engine]:
                ctx.skip(f"not a variant of the {ctx.engine} engine ({', '.join(VARIANTS[ctx.engine])})",
                         variant=name, vocab=vocab)  # fmt: skip
                continue
            variants[name] = Variant(name, ctx, layout, vocab, dim, batches, block)

        def check_one(name: str, _result: Any, variants: dict[str, Variant] = variants,
                      reference: Reference = reference, batches: Batches = batches) -> int:  # fmt: skip
            got = variants[name].probe()
            model = reference.after(variants[name].steps)
            with torch.no_grad():
                want = ctx.plant(model.hidden(batches.probe(ctx.rank)))
            floor = NOISE_FLOOR * want.abs().max()
            return int((~((got - want).abs() <= floor + rtol * want.abs())).sum().item())  # NaN counts as wrong

        def annotate(points: list[dict[str, Any]], variants: dict[str, Variant] = variants, vocab: int = vocab) -> None:
            for p in points:
                v = variants[p["variant"]]
                p["bytes_sent_per_step"] = v.sent_bytes(vocab, dim)
                table = 0 if v.name == "dense_block_alone" else v.model.emb.weight.numel() * 4
                p["table_bytes_per_rank"] = 2 * table
                p["state_bytes_per_rank"] = v.state_bytes

        ctx.time_points(
            {
                "op": "embedding_step",
                "vocab": vocab,
                "dim": dim,
                "ids_per_rank": batch * seq,
                "block": block,
                "zipf_s": flags.zipf_s,
            },  # fmt: skip
            {name: v.step for name, v in variants.items()},
            check_one,
            lambda _s: {},
            unchecked={"dense_block_alone": "no embedding: the dense block's step alone, a floor"},
            annotate=annotate,
        )
        for v in variants.values():
            v.close()
        del variants
    gc.collect()  # DDP's reducers must go before the process group, or the exit aborts
