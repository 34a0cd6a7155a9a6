"""`sparta` command line: `sparta --help` lists the subcommands."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import shutil
import sys
from collections.abc import Sequence


def _info(_: argparse.Namespace) -> int:
    """Print versions and which engines this installation can start."""
    import torch

    import sparta

    engines = {
        "torch": {
            "available": True,
            "cpu": "gloo",
            "cuda": "nccl" if torch.cuda.is_available() else None,
        },
        "horovod": {"available": importlib.util.find_spec("horovod") is not None},
        "mpi": {"available": importlib.util.find_spec("mpi4py") is not None, "mpirun": shutil.which("mpirun")},
    }
    print(
        json.dumps(
            {
                "sparta": sparta.__version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
                "cuda_devices": torch.cuda.device_count(),
                "engines": engines,
            },
            indent=2,
        )
    )
    return 0


def _profile(args: argparse.Namespace) -> int:
    """Launch the ranks (sparta_tools.profile), or, on a rank, run the MoE block."""
    from sparta.errors import ConfigError
    from sparta_tools.profile import ProfileRun, launch, run_worker

    if args.worker:
        run_worker(ProfileRun.from_json(args.worker))
        return 0
    try:
        run = ProfileRun(
            out=args.out, nprocs=args.nprocs, ranks_per_node=args.ranks_per_node, tokens=args.tokens,
            d_model=args.d_model, d_ff=args.d_ff, experts=args.experts, top_k=args.top_k,
            pipeline_degree=args.pipeline_degree, hierarchical=not args.flat, steps=args.steps, rate=args.rate,
            timeout_s=args.timeout,
        )  # fmt: skip
    except ConfigError as exc:  # a bad flag: exit 2 with the message, as argparse does
        print(exc, file=sys.stderr)
        return 2
    return launch(run)


def _train(args: argparse.Namespace) -> int:
    """Validate the run file and the overrides (before any engine starts), then train."""
    from sparta.errors import ConfigError
    from sparta.parallel.config_file import load_config

    overrides = list(args.set or [])
    if args.plan:
        from sparta.planner import plan_overrides, workload

        try:
            overrides = plan_overrides(args.plan, workload(load_config(args.config, overrides))) + overrides
        except ConfigError as e:
            print(f"sparta train: {e}", file=sys.stderr, flush=True)
            return 2
    if args.trace:
        overrides.append(f"output.trace={json.dumps(args.trace)}")
    try:
        config = load_config(args.config, overrides)
    except ConfigError as e:
        # Every rank reads the same file and fails alike, before any collective: no hang.
        print(f"sparta train: {e}", file=sys.stderr, flush=True)
        return 2
    from sparta.parallel.train import run

    return run(config, backend=args.backend)


def _plan(args: argparse.Namespace) -> int:
    from sparta.planner.command import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    """The `sparta` command's parser: one subcommand per verb (train, plan, profile, info; bench has its own)."""
    import sparta

    parser = argparse.ArgumentParser(
        prog="sparta",
        description="Sparta: MoE and sparse-embedding training with scheduled sparse communication.",
    )
    parser.add_argument("--version", action="version", version=f"sparta {sparta.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="versions and the communication engines available here")
    info.set_defaults(run=_info)
    prof = sub.add_parser(
        "profile",
        help="run an expert-parallel MoE block on local ranks: Chrome trace, PNG timeline, fitted cost models",
        description="Run an MoE layer (experts over all ranks) forward+backward, write <out>/trace.json "
        "(Perfetto, chrome://tracing), <out>/timeline.png and <out>/profile.json, and print the fitted "
        "cost models (alpha, beta, fit error per op) and the chosen pipeline degrees as JSON lines.",
    )
    prof.add_argument("--out", default="sparta-profile", help="folder for trace.json, timeline.png, profile.json")
    prof.add_argument("--nprocs", type=int, default=2, help="ranks to start on this machine")
    prof.add_argument("--ranks-per-node", type=int, default=0, help="ranks per (emulated) node; 0: all on one")
    prof.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    prof.add_argument("--d-model", type=int, default=256)
    prof.add_argument("--d-ff", type=int, default=512)
    prof.add_argument("--experts", type=int, default=4, help="experts in all, spread over every rank")
    prof.add_argument("--top-k", type=int, default=2)
    prof.add_argument("--pipeline-degree", default="auto", help="'auto', an int, FWD,BWD or FWD,BWD,TAPER")
    prof.add_argument("--flat", action="store_true", help="no two-level (intra, then inter-node) exchange")
    prof.add_argument("--steps", type=int, default=2, help="traced steps after one warm-up step")
    prof.add_argument("--rate", default="", help="run in an emulated cluster with this link rate (root; e.g. 300mbit)")
    prof.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are stopped")
    prof.add_argument("--worker", default="", help=argparse.SUPPRESS)
    prof.set_defaults(run=_profile)
    train = sub.add_parser(
        "train",
        help="train a model with pipeline x data x tensor (+ expert) parallelism from a TOML or YAML run file",
        description="Train the run described by --config (sections model, parallel, train, data, checkpoint, "
        "output; see sparta/parallel/config.py and examples/moe_gpt.toml) on the ranks of the launcher it runs "
        "under: torchrun, mpirun or horovodrun (the same file on each), or one process without one. Rank 0 shows "
        "a progress bar and writes output.metrics, one JSON record per step.",
    )
    train.add_argument("--config", required=True, help="the run file (.toml, or .yaml/.yml with PyYAML)")
    train.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override one field, e.g. --set train.steps=20 --set parallel.schedule=GPipe (repeatable; a TOML "
        "value or a bare string; validated like the file)",
    )
    train.add_argument(
        "--plan", default="", help="apply a plan file from `sparta plan` (its [parallel]; --set still wins)"
    )
    train.add_argument("--trace", default="", help="write a Chrome trace here (output.trace; see output.trace_steps)")
    train.add_argument(
        "--backend",
        choices=("auto", "torch", "mpi", "horovod"),
        default="auto",
        help="communication engine; auto picks it from the launcher",
    )
    train.set_defaults(run=_train)
    plan = sub.add_parser(
        "plan",
        help="measure a model's costs, then search layouts, schedules and micro-batches under a memory budget",
        description="With --measure (under a launcher, on as many ranks as you will train on): time the run "
        "file's model parts, collectives and optimizer, and save them. With --costs: predict every plan the "
        "trainer can run on --world ranks, print the fastest within --memory GiB per rank and why the others were "
        "left out, and write the best to --out for `sparta train --plan`. See sparta/planner/.",
    )
    plan.add_argument("--config", required=True, help="the run file whose model and batch are planned")
    plan.add_argument("--measure", default="", help="measure the costs on the launched ranks and save them here")
    plan.add_argument("--costs", default="", help="costs saved by --measure")
    plan.add_argument("--hardware", default="", help="instead of --costs: published figures of H100 or A100 clusters")
    plan.add_argument("--schedules", default="", help="comma-separated schedules to search (default: all)")
    plan.add_argument("--max-microbatches", type=int, default=0, help="largest micro-batch count to search")
    plan.add_argument(
        "--embeddings",
        default="",
        help="comma-separated embeddings to search: dense (replicated), sparse (row-sharded over dp); default both",
    )
    plan.add_argument("--world", type=int, default=0, help="ranks to plan for")
    plan.add_argument("--memory", type=float, default=0.0, help="memory budget per rank, GiB")
    plan.add_argument("--out", default="", help="write the best plan here (for `sparta train --plan`)")
    plan.add_argument("--top", type=int, default=10, help="plans to print")
    plan.add_argument("--trace", default="", help="write the best plan's predicted timeline (Chrome trace JSON)")
    plan.add_argument("--any-hardware", action="store_true", help="use costs measured on other hardware, on purpose")
    plan.set_defaults(run=_plan)
    sub.add_parser(
        "bench",
        add_help=False,
        help="microbenchmarks: collectives, alltoallv, ... (nccl-tests' flags; `sparta bench --help`)",
    )  # parsed by sparta_tools.bench, which main() hands every argument after "bench"
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`sparta ARGS`: run the subcommand; returns the process's exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # suites with flags of their own (nccl-tests' -b -e -f ...)
        from sparta_tools.bench import main as bench

        return bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 0
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
