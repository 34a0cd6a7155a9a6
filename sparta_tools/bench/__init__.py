"""`sparta bench`: Sparta's microbenchmark suite, for tuning a cluster and choosing between implementations.

    sparta bench collectives -b 4K -e 64M -f 4 -n 20 -w 5 -J run.jsonl     # every op, every engine
    sparta bench alltoallv --patterns uniform,zipf,moe -b 64K -e 16M -J v.jsonl
    torchrun --nnodes 2 --nproc-per-node 8 ... -m sparta.cli bench collectives --expect-nodes 2
    sparta bench compare base.jsonl new.jsonl      # refuses runs of different shape without --force
    sparta bench plot run.jsonl -o run.png

Suites (`registry()`): collectives, alltoallv, and the folded scripts (moe-layer, pipeline,
dispatch: moe.py; embedding; trainer: suites.py). Without a launcher a suite
starts its own local ranks, one job per engine (runner.drive); under torchrun, mpirun or
horovodrun each rank runs it directly (rank.worker). Output: JSON lines, a header first
(records.py says what every field means; header.py builds the header), and a table on stdout.

A suite is a `Suite`: its flags and the frozen dataclass they parse into (a SuiteFlags,
validated on construction), a check of what they need of the whole run (both ConfigError,
before any rank starts), and `run(ctx)` on every rank (rank.BenchContext: time_points checks
each variant against an oracle, times the variants alternately and emits one record per
variant). To add one, list it in suites.folded().
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch

from sparta.errors import ConfigError
from sparta_tools.bench.options import add_common, options_from
from sparta_tools.bench.runner import Suite


def _collectives() -> list[Suite]:
    from sparta_tools.bench import collectives as c
    from sparta_tools.bench.peers import run_peers

    return [
        Suite("collectives", "every collective on every engine: Sparta's Communicator beside the engine's own call",
              c.add_collectives_arguments, c.CollectivesFlags, c.run_collectives,
              peers=lambda opts: run_peers(opts, opts.flags_as(c.CollectivesFlags).ops)),
        Suite("alltoallv", "uneven all-to-all: uniform, Zipf, a byte-matrix file, or a real MoE router's counts",
              c.add_alltoallv_arguments, c.AlltoallvFlags, c.run_alltoallv, check=c.check_alltoallv_options,
              peers=lambda opts: run_peers(opts, ["alltoallv"])),
    ]  # fmt: skip


def registry() -> dict[str, Suite]:
    from sparta_tools.bench.suites import folded

    return {s.name: s for s in [*_collectives(), *folded()]}


def build_parser(all_suites: dict[str, Suite]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparta bench",
        description="Sparta's microbenchmarks (nccl-tests' flags where the concept is the same). "
        "Without a launcher each suite starts --nprocs local ranks per engine; under torchrun, mpirun or "
        "horovodrun it runs on the launched ranks. JSON lines with -J (a header first), a table on stdout; "
        "exit 1 when any result differs from the seeded oracle.",
    )
    sub = parser.add_subparsers(dest="suite", metavar="SUITE")
    for suite in all_suites.values():
        p = sub.add_parser(suite.name, help=suite.help, description=suite.help)
        add_common(p)
        suite.add_arguments(p)
    from sparta_tools.bench import compare, plot

    compare.add_parser(sub)
    plot.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`sparta bench ...`; returns the exit status (2: bad flags, 1: wrong values or a failed launch)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    all_suites = registry()
    parser = build_parser(all_suites)
    args = parser.parse_args(argv)
    if args.suite is None:
        parser.print_help()
        return 0
    if args.suite in ("compare", "plot"):
        return int(args.run(args))
    suite = all_suites[args.suite]
    try:
        opts = options_from(args, suite.name, suite.flags.from_args(args))
        if suite.check is not None:
            suite.check(opts)
    except ConfigError as exc:
        parser.exit(2, f"sparta bench {suite.name}: error: {exc}\n")
    from sparta.comm.launch import detect
    from sparta_tools.bench import rank, runner

    command = json.loads(args.command) if args.command else ["sparta", "bench", *argv]
    if args._worker or detect().launcher != "none":
        try:
            return rank.worker(opts, suite.run, command, standalone=not args._worker)
        except ConfigError as exc:
            print(f"sparta bench {suite.name}: error: {exc}", file=sys.stderr, flush=True)
            return 2
    gpus = torch.cuda.device_count()
    if opts.device == "cuda" and opts.nprocs > gpus:
        parser.exit(2, f"sparta bench {suite.name}: error: --device cuda --nprocs {opts.nprocs}: each rank takes a "
                       f"GPU of its own and this machine has {gpus}; start at most that many ranks\n")  # fmt: skip
    engines = opts.engines or suite.engines
    return runner.drive(opts, argv, command, engines, suite.peers)
