"""How a suite runs: what a suite is (`Suite`), and the driver that launches its ranks.

Driver (no launcher started this process): for each engine asked for, one job on `--nprocs`
local ranks under the engine's own launcher (torch: torchrun, mpi: mpirun, horovod:
horovodrun --gloo), each rank running this same command with `--_worker`; the job's rank 0
writes JSON lines to a file of the driver's, which merges them (one header, the points, a
`skipped` record for each engine that is not installed here) and prints the table. A job
past `--timeout` is killed whole. What each rank then does is rank.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from sparta_tools.bench import records
from sparta_tools.bench.options import ENGINES, BenchOptions, SuiteFlags
from sparta_tools.processes import run_bounded


@dataclass(frozen=True)
class Suite:
    """One `sparta bench <name>`. add_arguments: its own flags; flags: the SuiteFlags class
    they parse into (`flags.from_args`, validated on construction: ConfigError before anything
    launches; read as opts.flags_as(flags)); run(ctx): on every rank; check(opts): what the
    flags need of the whole run (dtype, device, --nprocs), also before anything launches;
    peers(opts): the driver's records of tools outside Sparta; engines: those it runs on by
    default."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    flags: type[SuiteFlags]
    run: Callable[[Any], None]
    check: Callable[[BenchOptions], None] | None = None
    peers: Callable[[BenchOptions], list[dict[str, Any]]] | None = None
    engines: tuple[str, ...] = ENGINES


LAUNCHER_OF = {"torch": "torchrun", "mpi": "mpirun", "horovod": "horovodrun"}


# ------------------------------------------------------------------------------ driver
def free_port() -> int:
    """A TCP port free on this host now (for a launch's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def horovodrun() -> str | None:
    """The horovodrun beside this interpreter, or on PATH, or None."""
    beside = Path(sys.executable).parent / "horovodrun"
    return str(beside) if beside.exists() else shutil.which("horovodrun")


def engine_missing(engine: str) -> str | None:
    """Why `engine` cannot be launched here, or None."""
    if engine == "mpi":
        if shutil.which("mpirun") is None:
            return "mpirun is not on PATH (apt-get install openmpi-bin libopenmpi-dev)"
        if find_spec("mpi4py") is None:
            return "mpi4py is not installed (pip install 'sparta[mpi]')"
    if engine == "horovod":
        if find_spec("horovod") is None:
            return "horovod is not installed (scripts/install_horovod.sh)"
        if horovodrun() is None:
            return "horovodrun is not on PATH"
    return None


def launch_command(engine: str, nprocs: int, argv: Sequence[str]) -> list[str]:
    """One local job of `nprocs` ranks running `sparta bench <argv>` under the engine's launcher."""
    py = sys.executable
    program = [py, "-m", "sparta.cli", "bench", *argv]
    if engine == "torch":
        return [py, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}", "--master-addr=127.0.0.1",
                f"--master-port={free_port()}", "-m", "sparta.cli", "bench", *argv]  # fmt: skip
    if engine == "mpi":
        return ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(nprocs),
                "-x", "OMP_NUM_THREADS", "-x", "PYTHONUNBUFFERED", "-x", "PATH", *program]  # fmt: skip
    return [horovodrun() or "horovodrun", "--gloo", "-np", str(nprocs), "-H", f"localhost:{nprocs}", *program]


def run_launch(cmd: list[str], timeout_s: float) -> tuple[int, str]:
    """(exit status, output tail); a launch past its timeout, or on Ctrl-C, is stopped with
    every rank it started (`sparta_tools.processes`)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    code, out, timed_out = run_bounded(cmd, env, timeout_s)
    if timed_out:
        out += f"\nsparta bench: the launch ran past --timeout {timeout_s:g} s and was stopped, its ranks with it"
    return code, out[-4000:]


def run_on_cluster(opts: BenchOptions, argv: list[str], engine: str) -> tuple[int, str]:
    """The job's ranks in an emulated cluster (sparta_tools.cluster): nodes of --ranks-per-node
    ranks behind links of --rate, each rank started as the engine's launcher would start it
    (torch: torchrun, horovod: horovodrun --gloo)."""
    from sparta_tools.cluster import ClusterConfig, ClusterUnavailableError, EmulatedCluster

    per_node = opts.ranks_per_node or 1
    config = ClusterConfig(nodes=opts.nprocs // per_node, ranks_per_node=per_node, rate=opts.rate)
    cmd = [sys.executable, "-m", "sparta.cli", "bench", *argv, "--ranks-per-node", str(per_node)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        with EmulatedCluster(config) as cluster:
            codes = cluster.run(cmd, timeout_s=opts.timeout_s, env=env, launcher=LAUNCHER_OF[engine])
    except ClusterUnavailableError as exc:
        return 1, f"sparta bench: the emulated cluster could not start the job: {exc}"
    except TimeoutError as exc:
        return 124, str(exc)
    # the first rank's own failure, not the SIGKILL the cluster then sent the others
    failed = [c for c in codes if c > 0] or [c for c in codes if c != 0] or [0]
    return failed[0], f"emulated cluster {config}: rank exit codes {codes}"


def merge(headers: list[dict[str, Any]], command: Sequence[str], output: str) -> dict[str, Any]:
    """One header for a run of several jobs (one per engine): the first job's facts, each
    job's engine, launcher and launch command under `launches`."""
    merged = dict(headers[0])
    per_job = ("engine", "launcher", "launch_command", "mpi_library", "binding", "hosts", "ranks_per_node")
    merged["engines"] = [h["engine"] for h in headers]
    merged["launches"] = [{k: h.get(k) for k in per_job} for h in headers]
    merged["command"] = list(command)
    merged["options"] = {**merged.get("options", {}), "output": output, "engines": merged["engines"]}
    for k in ("engine", "launch_command"):
        merged.pop(k, None)
    return merged


def drive(opts: BenchOptions, argv: Sequence[str], command: Sequence[str], engines: Sequence[str],
          peers: Callable[[BenchOptions], list[dict[str, Any]]] | None = None) -> int:  # fmt: skip
    """Launch one job per engine, merge their records, write -J, print the table."""
    headers: list[dict[str, Any]] = []
    points: list[dict[str, Any]] = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="sparta-bench-") as tmp:
        for engine in engines:
            why = engine_missing(engine)
            if opts.rate and engine == "mpi":
                why = "the emulated cluster (--rate) starts ranks as torchrun or horovodrun do, not as mpirun"
            if why:
                points.append({"type": "skipped", "suite": opts.suite, "engine": engine, "reason": why})
                continue
            out = Path(tmp) / f"{engine}.jsonl"
            worker = [*argv, "--_worker", "-J", str(out), "--engines", engine,
                      "--expect-ranks", str(opts.nprocs), "--_command", json.dumps(list(command))]  # fmt: skip
            if opts.rate:
                cmd = ["sparta_tools.cluster", f"rate={opts.rate}", f"launcher={LAUNCHER_OF[engine]}", *worker]
                print(f"# {opts.suite}: {engine} on {opts.nprocs} ranks, links of {opts.rate}", file=sys.stderr)
                code, tail = run_on_cluster(opts, worker, engine)
            else:
                cmd = launch_command(engine, opts.nprocs, worker)
                print(f"# {opts.suite}: {engine} on {opts.nprocs} ranks ({LAUNCHER_OF[engine]})", file=sys.stderr)
                code, tail = run_launch(cmd, opts.timeout_s)
            try:
                got = records.read_records(out) if out.exists() and out.stat().st_size else []
            except ValueError as exc:  # a job stopped mid-write: its engine fails, the others' records stand
                got, code = [], code or 1
                print(f"# {engine}: {exc}", file=sys.stderr)
            if got:
                got[0]["launch_command"] = cmd
                headers.append(got[0])
                points.extend(got[1:])
            if code != 0:
                failed.append(f"{engine} (exit {code})")
                if not any(p.get("type") == "point" and p.get("wrong") for p in got[1:]):
                    sys.stderr.write(tail + "\n")
    if peers is not None:
        points.extend(peers(opts))
    if not headers:
        print(f"sparta bench {opts.suite}: no engine ran ({'; '.join(failed) or 'none available'})", file=sys.stderr)
        for p in points:
            print(json.dumps(p), file=sys.stderr)
        return 1
    every = [merge(headers, command, opts.output), *points]
    finish(opts, every)
    wrong = sum(int(p.get("wrong") or 0) for p in points if p.get("type") == "point")
    if wrong:
        print(f"sparta bench {opts.suite}: {wrong} wrong values (see the #wrong column)", file=sys.stderr)
    if failed:
        print(f"sparta bench {opts.suite}: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if wrong or failed else 0


def finish(opts: BenchOptions, every: list[dict[str, Any]]) -> None:
    """Write the JSON lines (-J) and print the table (to stderr when the lines go to stdout)."""
    if opts.output:
        stream = records.emit_stream(opts.output)
        records.write_records(every, stream)
        if stream is not sys.stdout:
            stream.close()
    print(records.table(every), file=sys.stderr if opts.output == "-" else sys.stdout, flush=True)
