"""Suites `collectives` (every op, every engine) and `alltoallv` (uneven traffic).

Variants of each point, timed alternately in one launch:
    raw            the engine's own call as its users write it: torch.distributed
                   (all_reduce, all_gather_single, reduce_scatter_single, all_to_all_single,
                   broadcast), Horovod (allreduce, allgather, reducescatter, alltoall,
                   broadcast), mpi4py (Allreduce, Allgather, Reduce_scatter_block, Alltoall(v),
                   Bcast on numpy views). In-place all-reduces refill their buffer from the
                   input first (that copy is timed: Sparta's returns a new tensor too).
    sparta         sparta's Communicator with its input checks off (what tuned code runs);
                   all_gather is given the sizes, alltoallv the receive splits
    sparta+check   the Communicator as it comes: agreed input checks; alltoallv exchanges
                   the receive splits itself, as an MoE layer's forward does
Before timing, each variant's result is compared with the seeded oracle (oracle.py), and
so is its last timed call's; reductions are sums, broadcast's root is rank 0.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sparta.errors import ConfigError
from sparta_tools.bench import records, traffic
from sparta_tools.bench.options import BenchOptions, SuiteFlags, check_subset, comma_names, human_size
from sparta_tools.bench.oracle import Oracle
from sparta_tools.bench.rank import BenchContext

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
VARIANTS = ("raw", "sparta", "sparta+check")
REDUCING = ("all_reduce", "reduce_scatter")


def add_collectives_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")


def add_alltoallv_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--patterns", default="uniform,zipf,moe", help=f"comma-separated subset of {','.join(traffic.PATTERNS)}"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent of the receivers' skew")
    parser.add_argument("--matrix", default="", help="JSON n x n bytes matrix (pattern 'file')")
    parser.add_argument("--moe-experts", type=int, default=0, help="experts of the routed layer (default 4 per rank)")
    parser.add_argument("--moe-top-k", type=int, default=2)
    parser.add_argument("--moe-tokens", type=int, default=1024, help="tokens each rank routes")
    parser.add_argument("--moe-d-model", type=int, default=64, help="the router's input width")
    parser.add_argument("--moe-counts", default="", help="JSON rows per global expert recorded on each rank")


@dataclass(frozen=True)
class CollectivesFlags(SuiteFlags):
    """`collectives`: the ops to time (--ops) and the variants of each (--variants)."""

    ops: tuple[str, ...]
    variants: tuple[str, ...]

    def __post_init__(self) -> None:
        check_subset(self.ops, OPS, "--ops")
        check_subset(self.variants, VARIANTS, "--variants")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CollectivesFlags:
        return cls(ops=comma_names(args.ops), variants=comma_names(args.variants))


@dataclass(frozen=True)
class AlltoallvFlags(SuiteFlags):
    """`alltoallv`: the traffic patterns (--patterns; --matrix adds `file`), the variants, the
    Zipf exponent, the matrix file, and the routed layer of pattern `moe` (--moe-*:
    moe_experts 0 is 4 per rank; moe_counts: a file of recorded counts instead)."""

    patterns: tuple[str, ...]
    variants: tuple[str, ...]
    zipf_s: float
    matrix: str
    moe_experts: int
    moe_top_k: int
    moe_tokens: int
    moe_d_model: int
    moe_counts: str

    def __post_init__(self) -> None:
        check_subset(self.patterns, traffic.PATTERNS, "--patterns")
        check_subset(self.variants, VARIANTS, "--variants")
        if "file" in self.patterns and not self.matrix:
            raise ConfigError("--patterns file needs --matrix FILE (JSON n x n bytes)")
        if self.matrix and "file" not in self.patterns:  # a matrix given is a matrix to run
            object.__setattr__(self, "patterns", (*self.patterns, "file"))
        if self.zipf_s <= 0:
            raise ConfigError(f"--zipf-s {self.zipf_s}: give an exponent > 0 (about 1.1 for token ids)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AlltoallvFlags:
        return cls(
            patterns=comma_names(args.patterns),
            variants=comma_names(args.variants),
            zipf_s=args.zipf_s,
            matrix=args.matrix,
            moe_experts=args.moe_experts,
            moe_top_k=args.moe_top_k,
            moe_tokens=args.moe_tokens,
            moe_d_model=args.moe_d_model,
            moe_counts=args.moe_counts,
        )


def check_alltoallv_options(opts: BenchOptions) -> None:
    """What the flags need of the whole run: a matrix file of --nprocs ranks, experts that spread over them."""
    flags = opts.flags_as(AlltoallvFlags)
    if flags.matrix:  # read here, before any rank starts: a bad file is one message, exit 2
        try:
            traffic.matrix_file(flags.matrix, opts.nprocs, opts.torch_dtype.itemsize)  # as the ranks read it
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"--matrix {flags.matrix}: cannot read it ({exc}); give a JSON n x n matrix of bytes"
            ) from None
    experts = flags.moe_experts
    if experts and experts % opts.nprocs:
        raise ConfigError(f"--moe-experts {experts} cannot be spread over {opts.nprocs} ranks; use a multiple of it")


# ------------------------------------------------------------------------------ raw calls
def raw_unsupported(engine: str, op: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the engine's own call cannot run this point here (a `skipped` record), or None."""
    if engine == "horovod" and dtype == torch.bfloat16 and op in REDUCING:
        return "Horovod sums no bfloat16 (Sparta sums it in float32)"
    if engine == "mpi":
        if device.type == "cuda":
            return "raw MPI on CUDA tensors needs a CUDA-aware MPI; Sparta stages them through host memory"
        if op in REDUCING and dtype in (torch.bfloat16, torch.float16):
            return f"MPI has no {dtype} sum on numpy buffers (Sparta sums it in float32)"
    return None


def _mpi_view(t: torch.Tensor) -> Any:
    """A numpy view MPI can move (bfloat16 as int16 bits: moved, never summed)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def raw_call(ctx: BenchContext, op: str, x: torch.Tensor, send: list[int] | None = None,
             recv: list[int] | None = None) -> Callable[[], torch.Tensor]:  # fmt: skip
    """The engine's own `op` on this rank's input `x`; returns a call giving the output."""
    n = ctx.size
    if ctx.engine == "torch":
        import torch.distributed as dist

        g = ctx.comm.pg
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        if op == "all_reduce":
            buf = x.clone()
            return lambda: (buf.copy_(x), dist.all_reduce(buf, group=g))[0]
        if op == "all_gather":
            out = x.new_empty(x.numel() * n)
            return lambda: (gather(out, x, group=g), out)[1]
        if op == "reduce_scatter":
            out = x.new_empty(x.numel() // n)
            return lambda: (scatter(out, x, group=g), out)[1]
        if op == "all_to_all":
            out = torch.empty_like(x)
            return lambda: (dist.all_to_all_single(out, x, group=g), out)[1]
        if op == "broadcast":  # refilled each call, as all_reduce's: a call that moved nothing shows
            buf = x.clone()
            return lambda: (buf.copy_(x), dist.broadcast(buf, group_src=0, group=g), buf)[2]
        assert send is not None and recv is not None
        outv = x.new_empty(sum(recv))
        return lambda: (dist.all_to_all_single(outv, x, recv, send, group=g), outv)[1]
    if ctx.engine == "horovod":
        import horovod.torch as hvd

        if x.dtype == torch.bfloat16 and op not in REDUCING:  # moved as its int16 bits, as Horovod has no bf16
            bits = raw_call(ctx, op, x.view(torch.int16), send, recv)
            return lambda: bits().view(torch.bfloat16)

        if op == "all_reduce":
            return lambda: hvd.allreduce(x, op=hvd.Sum)
        if op == "all_gather":
            return lambda: hvd.allgather(x)
        if op == "reduce_scatter":
            return lambda: hvd.reducescatter(x, op=hvd.Sum)
        if op == "all_to_all":
            return lambda: hvd.alltoall(x)
        if op == "broadcast":
            return lambda: hvd.broadcast(x, root_rank=0)
        splits = torch.tensor(send, dtype=torch.int32)
        return lambda: hvd.alltoall(x, splits=splits)[0]
    from mpi4py import MPI

    c = ctx.comm.mpi
    src = _mpi_view(x)
    if op == "all_reduce":
        out = torch.empty_like(x)
        return lambda: (c.Allreduce(src, out.numpy(), op=MPI.SUM), out)[1]
    if op == "all_gather":
        out = x.new_empty(x.numel() * n)
        return lambda: (c.Allgather(src, _mpi_view(out)), out)[1]
    if op == "reduce_scatter":
        out = x.new_empty(x.numel() // n)
        return lambda: (c.Reduce_scatter_block(src, out.numpy(), op=MPI.SUM), out)[1]
    if op == "all_to_all":
        out = torch.empty_like(x)
        return lambda: (c.Alltoall(src, _mpi_view(out)), out)[1]
    if op == "broadcast":  # refilled each call, as above
        buf = x.clone()
        return lambda: (buf.copy_(x), c.Bcast(_mpi_view(buf), root=0), buf)[2]
    assert send is not None and recv is not None
    outv = x.new_empty(sum(recv))
    sdispl = [sum(send[:i]) for i in range(n)]
    rdispl = [sum(recv[:i]) for i in range(n)]
    return lambda: (c.Alltoallv([src, (send, sdispl)], [_mpi_view(outv), (recv, rdispl)]), outv)[1]


def sparta_call(comm: Any, op: str, x: torch.Tensor, send: list[int] | None = None,
                recv: list[int] | None = None) -> Callable[[], Any]:  # fmt: skip
    """Sparta's Communicator call for ``op`` on ``x``: what a user's code issues."""
    if op == "all_reduce":
        return lambda: comm.all_reduce(x)
    if op == "all_gather":  # checks off: the sizes given, as tuned code that knows them does
        sizes = None if comm.config.check_inputs else [x.shape[0]] * comm.size
        return lambda: comm.all_gather(x, sizes=sizes)
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(x)
    if op == "all_to_all":
        return lambda: comm.all_to_all(x)
    if op == "broadcast":
        return lambda: comm.broadcast(x, src=0)
    if comm.config.check_inputs:  # the receive splits exchanged (and checked) by the call, as in an MoE layer
        return lambda: comm.all_to_all(x, send)
    return lambda: comm.all_to_all(x, send, recv)


def flat(result: Any) -> torch.Tensor:
    """One tensor from an op's result (Sparta's all_gather gives a list per rank)."""
    if isinstance(result, (list, tuple)):
        return torch.cat([t.reshape(-1) for t in result])
    return result.reshape(-1)


def build_calls(ctx: BenchContext, op: str, x: torch.Tensor, variants: tuple[str, ...],
                send: list[int] | None = None,
                recv: list[int] | None = None) -> dict[str, Callable[[], Any]]:  # fmt: skip
    """The call of each variant (raw: the engine's own; sparta: the Communicator's) on input ``x``; a variant the
    engine cannot run records a skip instead."""
    calls: dict[str, Callable[[], Any]] = {}
    for variant in variants:
        if variant == "raw":
            why = raw_unsupported(ctx.engine, op, x.dtype, ctx.device)
            if why:
                ctx.skip(why, op=op, variant="raw", dtype=ctx.opts.dtype)
                continue
            calls[variant] = raw_call(ctx, op, x, send, recv)
        else:
            calls[variant] = sparta_call(ctx.fast if variant == "sparta" else ctx.comm, op, x, send, recv)
    return calls


# ------------------------------------------------------------------------------ suites
def shapes(op: str, size: int, elem: int, n: int) -> tuple[int, int]:
    """(elements in this rank's input, nccl-tests' size in bytes) for `op` at `size`."""
    count = max(1, size // elem)
    if op in ("all_reduce", "broadcast"):
        return count, count * elem
    if op == "all_gather":  # size is the gathered output
        chunk = max(1, count // n)
        return chunk, chunk * n * elem
    total = max(n, count // n * n)  # reduce_scatter input / all_to_all send buffer, whole blocks
    return total, total * elem


def expected(oracle: Oracle, op: str, count: int, rank: int, n: int) -> torch.Tensor:
    """What ``op`` must give on ``rank`` of ``n`` for the oracle's inputs of ``count`` elements."""
    if op == "all_reduce":
        return oracle.summed(0, count)
    if op == "broadcast":
        return oracle.buffer(0, count)
    if op == "all_gather":
        return oracle.gathered([(r, 0, count) for r in range(n)])
    block = count // n
    if op == "reduce_scatter":
        return oracle.summed(rank * block, block)
    return oracle.gathered([(r, rank * block, block) for r in range(n)])  # all_to_all


def run_collectives(ctx: BenchContext) -> None:
    opts, n = ctx.opts, ctx.size
    flags = opts.flags_as(CollectivesFlags)
    oracle = Oracle(opts.seed, n, opts.torch_dtype, ctx.device)
    elem = torch.empty((), dtype=opts.torch_dtype).element_size()
    for size in opts.sizes():
        for op in flags.ops:
            count, nbytes = shapes(op, size, elem, n)
            x = oracle.buffer(ctx.rank, count)
            calls = build_calls(ctx, op, x, flags.variants)
            if not calls:
                continue
            want = expected(oracle, op, count, ctx.rank, n)
            matrix = records.collective_matrix(op, nbytes, n)
            ctx.time_points(
                {"op": op, "bytes": nbytes, "count": count, "dtype": opts.dtype, "size": human_size(nbytes)},
                calls,
                lambda _v, result, want=want: ctx.count_wrong(flat(result), want),
                lambda seconds, op=op, nbytes=nbytes, matrix=matrix: records.bandwidth(
                    op, nbytes, matrix, ctx.node_of, seconds, opts.peak_gbps
                ),
            )


def pattern_matrix(ctx: BenchContext, pattern: str, count: int, elem: int) -> list[list[int]]:
    """Elements M[i][j] rank i sends rank j for `pattern`, with about `count` per rank."""
    flags, n = ctx.opts.flags_as(AlltoallvFlags), ctx.size
    if pattern == "uniform":
        return traffic.uniform(n, count)
    if pattern == "zipf":
        return traffic.zipf(n, count, flags.zipf_s, ctx.opts.seed)
    if pattern == "file":
        return traffic.matrix_file(flags.matrix, n, elem)
    if flags.moe_counts:
        rows = traffic.counts_file(flags.moe_counts, n)
    else:
        rows = traffic.moe_rows(n, flags.moe_experts or 4 * n, flags.moe_top_k, flags.moe_tokens,
                                flags.moe_d_model, ctx.opts.seed)  # fmt: skip
    return traffic.scaled_rows(rows, count)


def run_alltoallv(ctx: BenchContext) -> None:
    opts, n, me = ctx.opts, ctx.size, ctx.rank
    flags = opts.flags_as(AlltoallvFlags)
    oracle = Oracle(opts.seed, n, opts.torch_dtype, ctx.device)
    elem = torch.empty((), dtype=opts.torch_dtype).element_size()
    for pattern in flags.patterns:
        for size in [0] if pattern == "file" else opts.sizes():
            m = pattern_matrix(ctx, pattern, max(1, size // elem), elem)
            send = m[me]
            recv = [m[i][me] for i in range(n)]
            x = oracle.buffer(me, sum(send))
            calls = build_calls(ctx, "alltoallv", x, flags.variants, send, recv)
            if not calls:
                continue
            want = oracle.gathered([(i, sum(m[i][:me]), m[i][me]) for i in range(n)])
            mbytes = [[v * elem for v in row] for row in m]
            nbytes = round(sum(map(sum, mbytes)) / n)
            base: dict[str, Any] = {"op": "alltoallv", "pattern": pattern, "bytes": nbytes, "dtype": opts.dtype,
                                    "size": human_size(nbytes)}  # fmt: skip
            if n <= 16:
                base["matrix_bytes"] = mbytes
            ctx.time_points(
                base,
                calls,
                lambda _v, result, want=want: ctx.count_wrong(flat(result), want),
                lambda seconds, mbytes=mbytes, nbytes=nbytes: records.bandwidth(
                    "alltoallv", nbytes, mbytes, ctx.node_of, seconds, opts.peak_gbps
                ),
            )
