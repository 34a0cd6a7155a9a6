"""How a suite runs: the driver that launches the ranks, and what each rank does around a suite.

Driver (no launcher started this process): for each engine asked for, one job on `--nprocs`
local ranks under the engine's own launcher (torch: torchrun, mpi: mpirun, horovod:
horovodrun --gloo), each rank running this same command with `--_worker`; the job's rank 0
writes JSON lines to a file of the driver's, which merges them (one header, the points, a
`skipped` record for each engine that is not installed here) and prints the table. A job
past `--timeout` is killed whole.

Rank (under torchrun, mpirun or horovodrun, by the driver or by hand on a cluster): pin
(`--bind`), start the engine (every collective bounded by `--timeout`), refuse a world that
is not the one expected (`--expect-ranks`, `--expect-nodes`: a launch whose nodes ran as
separate jobs sees a smaller world), gather the header's facts from every rank, run the
suite (`BenchContext`), and end with exit status 1 when any point's result was wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch

from sparta.errors import ConfigError
from sparta_tools.bench import records
from sparta_tools.bench.options import ENGINES, BenchOptions


@dataclass(frozen=True)
class Suite:
    """One `sparta bench <name>`. add_arguments: its own flags (they land in opts.extra);
    check(opts): validates them (ConfigError) before anything launches; run(ctx): on every
    rank; peers(opts, extra): the driver's records of tools outside Sparta; engines: those it
    runs on by default."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    check: Callable[[BenchOptions], None]
    run: Callable[[Any], None]
    peers: Callable[[Any, dict[str, Any]], list[dict[str, Any]]] | None = None
    engines: tuple[str, ...] = ENGINES


LAUNCHER_OF = {"torch": "torchrun", "mpi": "mpirun", "horovod": "horovodrun"}


# ------------------------------------------------------------------------------ driver
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def horovodrun() -> str | None:
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
    """(exit status, output tail); a launch past its timeout is killed with its whole session."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return 124, (out or "")[
            -4000:
        ] + f"\nsparta bench: the launch ran past --timeout {timeout_s:g} s and was killed"
    return proc.returncode, (out or "")[-4000:]


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
    return max(codes, key=abs), f"emulated cluster {config}: rank exit codes {codes}"


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
            got = records.read_records(out) if out.exists() and out.stat().st_size else []
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


# ------------------------------------------------------------------------------ ranks
class BenchContext:
    """What a suite sees on every rank: the world, both communicators (`comm` with Sparta's
    input checks, `fast` without), the device, the options, and the measuring helpers.
    Records are written by rank 0 only; every helper here is collective (every rank calls
    it in the same order)."""

    def __init__(self, opts: BenchOptions, world: Any, stream: Any) -> None:
        from sparta.comm import CommConfig

        self.opts = opts
        self.world = world
        self.engine: str = world.backend
        self.rank: int = world.rank
        self.size: int = world.size
        self.comm = world.comm
        fast = world.comm.split_groups(
            [list(range(world.size))], CommConfig(timeout_s=opts.timeout_s, check_inputs=False)
        )
        assert fast is not None  # every rank is in the one group
        self.fast = fast
        self.node_of = [next(i for i, ranks in enumerate(world.node_ranks) if r in ranks) for r in range(world.size)]
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if opts.device == "cuda" else torch.device("cpu")
        )
        self.stream = stream
        self.wrong = 0
        self.points = 0
        self.planted = not opts.extra.get("plant_wrong", False)  # True once the planted error is placed
        self._skipped: set[tuple[Any, ...]] = set()
        self.emitted: list[dict[str, Any]] = []

    # records
    def emit(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            self.emitted.append(record)
            if self.stream is not None:
                records.write_records([record], self.stream)

    def skip(self, reason: str, **what: Any) -> None:
        """A `skipped` record, once per (what, reason)."""
        key = (tuple(sorted(what.items())), reason)
        if key not in self._skipped:
            self._skipped.add(key)
            self.emit({"type": "skipped", "suite": self.opts.suite, "engine": self.engine, **what, "reason": reason})

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # checking
    def plant(self, expected: torch.Tensor) -> torch.Tensor:
        """The oracle as given, or (hidden --_plant-wrong) with one element off on rank 0 at
        the first check: proves that a wrong result fails the run."""
        if not self.planted and expected.numel():
            self.planted = True
            if self.rank == 0:
                expected = expected.clone()
                flat = expected.view(-1)
                flat[0] = flat[0] + 1
        return expected

    def count_wrong(self, got: torch.Tensor, expected: torch.Tensor) -> int:
        """Elements of `got` that differ from `expected` (all of them if the shapes differ)."""
        expected = self.plant(expected)
        if got.shape != expected.shape:
            return int(expected.numel())
        return int((got != expected).sum().item())

    # timing
    def measure(self, calls: dict[str, Callable[[], Any]]) -> dict[str, list[float]]:
        """Seconds per timed call and variant on this rank: -w untimed calls each, then -n
        iterations in which every variant runs once, in an order rotated each iteration;
        a barrier before every call."""
        names = list(calls)
        for _ in range(self.opts.warmup):
            for name in names:
                calls[name]()
        self.sync()
        times: dict[str, list[float]] = {name: [] for name in names}
        barrier = self.comm.barrier
        for i in range(self.opts.iters):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                barrier()
                begin = time.perf_counter()
                calls[name]()
                self.sync()
                times[name].append(time.perf_counter() - begin)
        return times

    def gather_times(
        self, times: dict[str, list[float]], wrong: dict[str, int]
    ) -> tuple[dict[str, list[list[float]]], dict[str, int]]:
        """Every rank's times per variant ([rank][call]) and the wrong counts summed over ranks."""
        names = list(times)
        mine = torch.tensor([v for n in names for v in (*times[n], float(wrong.get(n, 0)))], dtype=torch.float64)
        rows = [t.tolist() for t in self.comm.all_gather(mine)]
        k = self.opts.iters + 1
        per_rank = {n: [row[i * k : i * k + self.opts.iters] for row in rows] for i, n in enumerate(names)}
        wrongs = {n: int(sum(row[i * k + self.opts.iters] for row in rows)) for i, n in enumerate(names)}
        return per_rank, wrongs

    def time_points(
        self,
        base: dict[str, Any],
        calls: dict[str, Callable[[], Any]],
        check: Callable[[str, Any], int] | None,
        fields: Callable[[float], dict[str, Any]],
        unchecked: dict[str, str] | None = None,
        annotate: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> None:
        """Check each variant's result (before timing and the last timed call's), time the
        variants together, and emit one point per variant. `fields(median_seconds)` adds the
        bandwidths; `check(variant, result)` counts wrong elements; `unchecked` names the
        variants no oracle applies to, and why (their `wrong` is null, `unchecked` says why);
        `annotate(points)` may add fields that need every variant's figures (rank 0)."""
        unchecked = unchecked or {}
        wrong: dict[str, int] = {}
        last: dict[str, Any] = {}
        if check is not None and self.opts.check:
            for name, call in calls.items():
                result = call()
                wrong[name] = 0 if name in unchecked else check(name, result)
            recording = {name: (lambda c=call, n=name: last.__setitem__(n, c())) for name, call in calls.items()}
            times = self.measure(recording)
            for name in calls:
                wrong[name] += 0 if name in unchecked else check(name, last[name])
        else:
            times = self.measure(calls)
        per_rank, wrongs = self.gather_times(times, wrong)
        points = []
        for name in calls:
            stats = records.time_stats(per_rank[name], self.opts.combine)
            point = {"type": "point", "suite": self.opts.suite, "engine": self.engine, **base, "variant": name}
            point.update(stats)
            point.update(fields(stats["median_us"] / 1e6))
            checked = self.opts.check and check is not None and name not in unchecked
            point["wrong"] = wrongs[name] if checked else None
            if name in unchecked:
                point["unchecked"] = unchecked[name]
            point.update({"ranks": self.size, "nodes": len(set(self.node_of)), "iters": self.opts.iters})
            self.wrong += wrongs[name]
            self.points += 1
            points.append(point)
        if annotate is not None:
            annotate(points)
        for point in points:
            self.emit(point)


def pin(bind: str) -> None:
    """--bind core: local rank i on core i (mod this process's CPUs), before the engine
    starts its threads (they inherit it); unbound, the scheduler moves ranks between cores
    and one starved rank stalls every collective."""
    if bind != "core":
        return
    from sparta.comm.launch import detect

    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[detect().local_rank % len(cpus)]})


def gather_json(comm: Any, obj: Any) -> list[Any]:
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    return [json.loads(bytes(t.tolist())) for t in comm.all_gather(data)]


def check_world(opts: BenchOptions, world: Any) -> str | None:
    """Why this world is not the one expected (every rank sees the same sizes), or None."""
    if opts.expect_ranks and world.size != opts.expect_ranks:
        return (
            f"the launch joined {world.size} ranks but {opts.expect_ranks} were expected (--expect-ranks): "
            "nodes that ran as separate jobs? check the launcher's host list and rendezvous"
        )
    if opts.expect_nodes and world.num_nodes != opts.expect_nodes:
        return (
            f"the {world.size} ranks span {world.num_nodes} host(s) but {opts.expect_nodes} were expected "
            "(--expect-nodes): the launcher placed every rank on one host?"
        )
    return None


def worker(opts: BenchOptions, suite_run: Callable[[BenchContext], None], command: Sequence[str],
           standalone: bool) -> int:  # fmt: skip
    """One rank. `standalone`: started by the user's own launcher (rank 0 then prints the
    table too), not by the driver."""
    import sparta
    from sparta.comm import CommConfig
    from sparta.comm.launch import detect

    launch = detect()
    engine = opts.engines[0] if opts.engines else "auto"
    if len(opts.engines) > 1:
        raise ConfigError(
            f"--engines {','.join(opts.engines)}: a launched job runs one engine; run without a launcher "
            "(sparta bench starts one job per engine) or give one engine"
        )
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    pin(opts.bind)
    world = sparta.init(
        backend=engine, ranks_per_node=opts.ranks_per_node or None, config=CommConfig(timeout_s=opts.timeout_s)
    )
    problem = check_world(opts, world)
    if problem:
        if world.rank == 0:
            print(f"sparta bench {opts.suite}: {problem}", file=sys.stderr, flush=True)
        world.shutdown()
        return 2
    facts = gather_json(world.comm, records.local_facts(opts.device))
    stream = None
    if world.rank == 0 and opts.output:
        stream = records.emit_stream(opts.output)
    options = {k: v for k, v in asdict(opts).items() if k != "extra"} | {"suite_options": opts.extra}
    # under the user's own launcher, `command` is one rank's argv: the launcher's line says how to rerun
    launched_by = records.user_launch_command() if standalone else None
    head = records.header(
        opts.suite, world.backend, launch.launcher, world.node_ranks, facts, options, command, launched_by
    )
    ctx = BenchContext(opts, world, stream)
    ctx.emit(head)
    suite_run(ctx)
    if world.rank == 0:
        if standalone:
            if stream is not None and stream is not sys.stdout:
                stream.close()
            print(records.table(ctx.emitted), file=sys.stderr if opts.output == "-" else sys.stdout, flush=True)
        if ctx.wrong:
            print(f"sparta bench {opts.suite}: {ctx.wrong} wrong values", file=sys.stderr, flush=True)
    world.shutdown()
    return 1 if ctx.wrong else 0
