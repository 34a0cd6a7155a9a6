"""The parent side of benchmarks/moe_layer.py: the child processes it starts (one per
candidate for ``--memory``, a torchrun or mpirun launch per config for ``--ranks``), each
re-running that script with a hidden flag, and the JSON lines they print."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from moe_candidates import EP_CANDIDATES, BenchConfig

SCRIPT = str(Path(__file__).with_name("moe_layer.py"))


def emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


def memory_candidates(cfg: BenchConfig, candidates: list[str], threads: int) -> None:
    dense: dict[str, float] = {}
    kind = "cuda" if cfg.device == "cuda" else "rss"
    for name in candidates:
        cmd = [sys.executable, SCRIPT, *config_args(cfg), "--threads", str(threads), "--_child", name]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        result = json.loads(out)
        if name == "dense":
            dense = result
        elif "skipped" not in result and dense:
            for what in ("step", "peak"):
                key = f"{what}_{kind}_mib"
                result[f"{what}_ratio_to_dense"] = round(result[key] / dense[key], 4)
        emit({"bench": "moe_layer_memory", "config": cfg.name, "candidate": name, **asdict(cfg), **result})


def config_args(cfg: BenchConfig) -> list[str]:
    """The command-line flags that rebuild ``cfg`` in a child process."""
    flags = ["--config", cfg.name, "--device", cfg.device, "--dtype", cfg.dtype]
    return flags + (["--zero-grad"] if cfg.zero_grad else [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(ranks: int, args: argparse.Namespace, configs: list[BenchConfig], candidates: list[str]) -> int:
    """Run the expert-parallel timings on ``ranks`` processes under torchrun (``--engine
    torch``) or mpirun (``--engine mpi``); rank 0's JSON lines come out on our stdout.
    Returns the launches that failed (a wrong output value among them)."""
    failed = 0
    # One thread per rank: the ranks share the machine's cores, more would only contend.
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for cfg in configs:
        port = free_port()
        if args.engine == "mpi":
            launcher = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(ranks)]
            launcher += ["-x", "OMP_NUM_THREADS", "-x", "MKL_NUM_THREADS", "-x", "PYTHONUNBUFFERED", sys.executable]
        else:
            launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
            launcher += ["--master-addr=127.0.0.1", f"--master-port={port}"]
        cmd = [
            *launcher,
            SCRIPT,
            "--_ep_worker",
            "--_port",
            str(port),
            "--engine",
            args.engine,
            *config_args(cfg),
            "--repeats",
            str(args.repeats),
            "--bind",
            args.bind,
            "--candidates",
            ",".join(c for c in candidates if c in EP_CANDIDATES),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        for line in lines:
            print(line, flush=True)
        if proc.returncode != 0 or not lines:
            failed += 1
            emit(
                {
                    "bench": "moe_layer_ep",
                    "config": cfg.name,
                    "ranks": ranks,
                    "engine": args.engine,
                    "error": f"{launcher[0]} exited with {proc.returncode}",
                    "output_tail": (proc.stdout + proc.stderr)[-2000:],
                }
            )
    return failed
