"""The flags every `sparta bench` suite shares, spelled like nccl-tests where the concept is the same.

    -b/--minbytes  -e/--maxbytes  -f/--stepfactor   message sizes: b, b*f, b*f^2, ... <= e ("4K", "64M", "1G")
    -n/--iters     -w/--warmup_iters                timed calls per variant and point; untimed ones before
    -c/--check     0|1                              seeded oracle check before timing and of the last timed call
    -d/--datatype  float|half|bfloat16|double|int8|uint8|int32|int64 (or torch's names)
    -a/--average   max|avg|min|rank0 (or nccl-tests' 3|1|2|0): how ranks' times of one call combine
    -J/--output_file PATH                           JSON lines ("-": stdout, the table then goes to stderr)

and Sparta's own: --engines, --nprocs (ranks to start when no launcher started us), --device,
--seed, --bind, --timeout, --expect-ranks / --expect-nodes (refuse a launch that did not join
them all), --ranks-per-node (pose consecutive ranks as nodes: inter-node figures on one machine
or an emulated cluster), --rate (start the ranks on an emulated cluster of network namespaces
whose links are shaped to this rate: sparta_tools.cluster, root), --peak (GB/s to compare busbw against).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from sparta.errors import ConfigError

ENGINES = ("torch", "mpi", "horovod")
COMBINES = ("max", "avg", "min", "rank0")
NCCL_AVERAGE = {"0": "rank0", "1": "avg", "2": "min", "3": "max"}  # nccl-tests' -a numbers
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}
DTYPE_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "bf16": "bfloat16"}
BINDS = ("none", "core")
_SIZE = re.compile(r"^(\d+)([KMGT]?)(i?B?)$", re.IGNORECASE)
F = TypeVar("F", bound="SuiteFlags")
N = TypeVar("N", int, float)


def parse_size(text: str) -> int:
    """'4096', '4K', '64M', '1G' (powers of 1024, as nccl-tests reads them) -> bytes."""
    match = _SIZE.match(text.strip())
    if not match:
        raise ConfigError(f"size {text!r}: give bytes as an integer with an optional K, M, G or T suffix (e.g. 64M)")
    value, unit = int(match.group(1)), match.group(2).upper()
    return value << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[unit]


def dtype_name(text: str) -> str:
    """The dtype's name for ``-d`` (nccl-tests' float, half, double taken too); ConfigError for others."""
    name = DTYPE_ALIASES.get(text, text)
    if name not in DTYPES:
        raise ConfigError(f"--datatype {text!r}: use one of {', '.join(DTYPES)} (or nccl-tests' float, half, double)")
    return name


def human_size(nbytes: int) -> str:
    """``nbytes`` as nccl-tests writes sizes: 4K, 64M, 1G where exact, else the number."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


@dataclass(frozen=True)
class SuiteFlags:
    """A suite's own flags, parsed: each suite subclasses it next to its `add_*_arguments`,
    validates the values in `__post_init__` (ConfigError naming the flag) and parses them
    from the command line in `from_args`. This base class is a suite with no flags."""

    @classmethod
    def from_args(cls: type[F], args: argparse.Namespace) -> F:
        """The flags from the parsed command line; ConfigError names a bad one."""
        return cls()


@dataclass
class BenchOptions:
    """One suite run. Sizes in bytes (per nccl-tests' conventions, see records.BANDWIDTH);
    iters/warmup per variant and point; combine: how the ranks' times of one call make the
    call's time; timeout_s bounds the whole launch (driver) and every collective (ranks);
    flags: the suite's own (read them with `flags_as`); plant_wrong (hidden --_plant-wrong):
    one expected value off, proving that a wrong result fails the run."""

    suite: str
    minbytes: int = 4 << 10
    maxbytes: int = 64 << 20
    stepfactor: int = 4
    iters: int = 20
    warmup: int = 5
    check: bool = True
    dtype: str = "float32"
    combine: str = "max"
    output: str = ""
    engines: tuple[str, ...] = ()
    nprocs: int = 2
    device: str = "cpu"
    seed: int = 0
    bind: str = "none"
    timeout_s: float = 600.0
    expect_ranks: int = 0
    expect_nodes: int = 0
    ranks_per_node: int = 0
    rate: str = ""
    peak_gbps: float = 0.0
    flags: SuiteFlags = field(default_factory=SuiteFlags)
    plant_wrong: bool = False

    def __post_init__(self) -> None:
        if self.minbytes < 1 or self.maxbytes < self.minbytes:
            raise ConfigError(
                f"-b {self.minbytes} -e {self.maxbytes}: need 1 <= minbytes <= maxbytes (e.g. -b 4K -e 64M)"
            )
        if self.stepfactor < 2:
            raise ConfigError(f"-f {self.stepfactor}: the step factor must be >= 2 (sizes grow by it)")
        if self.iters < 1:
            raise ConfigError(f"-n {self.iters}: need at least one timed call per point")
        if self.warmup < 0:
            raise ConfigError(f"-w {self.warmup}: warm-up calls must be >= 0")
        if self.combine not in COMBINES:
            raise ConfigError(f"-a {self.combine!r}: use one of {COMBINES} (or nccl-tests' 0-3)")
        dtype_name(self.dtype)
        bad = [e for e in self.engines if e not in ENGINES]
        if bad:
            raise ConfigError(f"--engines {','.join(bad)}: unknown; use a comma-separated subset of {ENGINES}")
        if self.nprocs < 1:
            raise ConfigError(f"--nprocs {self.nprocs}: start at least one rank")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device {self.device!r}: use cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: torch sees no CUDA device here; use --device cpu")
        if self.bind not in BINDS:
            raise ConfigError(f"--bind {self.bind!r}: use one of {BINDS}")
        if not self.timeout_s > 0:
            raise ConfigError(f"--timeout {self.timeout_s}: give seconds > 0")
        if self.expect_ranks < 0 or self.expect_nodes < 0:
            raise ConfigError("--expect-ranks / --expect-nodes must be >= 0 (0: no expectation)")
        if self.ranks_per_node < 0:
            raise ConfigError(f"--ranks-per-node {self.ranks_per_node}: give >= 1 (0: nodes by host name)")
        if self.rate:
            from sparta_tools.cluster import ClusterConfig

            per_node = self.ranks_per_node or 1
            if self.nprocs % per_node or self.nprocs // per_node < 2:
                raise ConfigError(
                    f"--rate {self.rate}: --nprocs {self.nprocs} must make at least 2 nodes of --ranks-per-node "
                    f"{per_node}"
                )
            ClusterConfig(nodes=self.nprocs // per_node, ranks_per_node=per_node, rate=self.rate)  # checks the rate

    def flags_as(self, kind: type[F]) -> F:
        """The suite's flags as its own class `kind` (TypeError if they are another suite's)."""
        if not isinstance(self.flags, kind):
            raise TypeError(f"suite {self.suite}: its flags are {type(self.flags).__name__}, not {kind.__name__}")
        return self.flags

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[dtype_name(self.dtype)]

    def sizes(self) -> list[int]:
        """b, b*f, b*f^2, ... up to e, as nccl-tests steps them."""
        out, size = [], self.minbytes
        while size <= self.maxbytes:
            out.append(size)
            size *= self.stepfactor
        return out


def add_common(parser: argparse.ArgumentParser) -> None:
    """The shared flags (see the module docstring)."""
    g = parser.add_argument_group("sizes and timing (nccl-tests' spelling)")
    g.add_argument("-b", "--minbytes", default="4K", help="smallest message, bytes (K/M/G suffixes; default 4K)")
    g.add_argument("-e", "--maxbytes", default="64M", help="largest message, bytes (default 64M)")
    g.add_argument("-f", "--stepfactor", type=int, default=4, help="size multiplier between points (default 4)")
    g.add_argument("-n", "--iters", type=int, default=20, help="timed calls per variant and point (default 20)")
    g.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed calls first (default 5)")
    g.add_argument("-c", "--check", type=int, choices=(0, 1), default=1, help="1: check every point (default)")
    g.add_argument("-d", "--datatype", "--dtype", dest="datatype", default="float32", help="element type")
    g.add_argument(
        "-a", "--average", default="max", help="how ranks' times of one call combine: max (default), avg, min, rank0"
    )
    g.add_argument("-J", "--output_file", "--json", dest="output", default="", help="JSON lines here ('-': stdout)")
    r = parser.add_argument_group("ranks and placement")
    r.add_argument(
        "--engines", default="", help="comma-separated: torch,mpi,horovod (default: all; under a launcher: its own)"
    )
    r.add_argument(
        "--nprocs", "--np", type=int, default=2, help="ranks to start when no launcher started us (default 2)"
    )
    r.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    r.add_argument("--seed", type=int, default=0, help="seeds the oracle's data and every traffic pattern")
    r.add_argument("--bind", default="none", choices=BINDS, help="core: pin local rank i to core i (mod cores)")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds for a launch and for any one collective")
    r.add_argument("--expect-ranks", type=int, default=0, help="refuse to run unless the world has this many ranks")
    r.add_argument("--expect-nodes", type=int, default=0, help="refuse to run unless the ranks span this many hosts")
    r.add_argument(
        "--ranks-per-node",
        type=int,
        default=0,
        help="pose consecutive ranks as nodes of this size (one machine, an emulated cluster); default: by host",
    )
    r.add_argument(
        "--rate",
        default="",
        help="run on an emulated cluster (root): nodes of --ranks-per-node ranks (default 1) behind links of this "
        "rate (tc units: 100mbit, 1gbit), the torch and horovod engines (not mpi)",
    )
    r.add_argument("--peak", type=float, default=0.0, help="link peak in GB/s: records add busbw as %% of it")
    parser.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_plant-wrong", dest="plant_wrong", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_command", dest="command", default="", help=argparse.SUPPRESS)


def options_from(args: argparse.Namespace, suite: str, flags: SuiteFlags) -> BenchOptions:
    """BenchOptions from parsed flags and the suite's own, parsed; ConfigError names the bad flag."""
    combine = NCCL_AVERAGE.get(args.average, args.average)
    engines = tuple(e for e in args.engines.split(",") if e) if args.engines else ()
    return BenchOptions(
        suite=suite,
        minbytes=parse_size(args.minbytes),
        maxbytes=parse_size(args.maxbytes),
        stepfactor=args.stepfactor,
        iters=args.iters,
        warmup=args.warmup_iters,
        check=bool(args.check),
        dtype=dtype_name(args.datatype),
        combine=combine,
        output=args.output,
        engines=engines,
        nprocs=args.nprocs,
        device=args.device,
        seed=args.seed,
        bind=args.bind,
        timeout_s=args.timeout,
        expect_ranks=args.expect_ranks,
        expect_nodes=args.expect_nodes,
        ranks_per_node=args.ranks_per_node,
        rate=args.rate,
        peak_gbps=args.peak,
        flags=flags,
        plant_wrong=args.plant_wrong,
    )


def comma_names(text: str) -> tuple[str, ...]:
    """The names of a comma-separated flag value (`--ops`, `--variants`, `--patterns`)."""
    return tuple(t for t in text.split(",") if t)


def comma_numbers(text: str, kind: Callable[[str], N], error: Callable[[str], ConfigError]) -> tuple[N, ...]:
    """The numbers of a comma-separated flag value (`--vocabs`, `--skews`), each read by
    `kind`; ``error(text)`` where one does not read."""
    try:
        return tuple(kind(t) for t in text.split(",") if t)
    except ValueError:
        raise error(text) from None


def check_subset(chosen: tuple[str, ...], known: tuple[str, ...], flag: str) -> None:
    """ConfigError naming `flag` and the known names unless `chosen` is a non-empty subset of `known`."""
    if not chosen or any(t not in known for t in chosen):
        raise ConfigError(f"{flag} {','.join(chosen)!r}: use a comma-separated subset of {','.join(known)}")
