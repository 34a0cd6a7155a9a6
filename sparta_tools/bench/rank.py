"""What each rank of a `sparta bench` job does around a suite.

Under torchrun, mpirun or horovodrun (started by the driver, runner.py, or by hand on a
cluster): pin (`--bind`), start the engine (every collective bounded by `--timeout`), refuse a
world that is not the one expected (`--expect-ranks`, `--expect-nodes`: a launch whose nodes
ran as separate jobs sees a smaller world), gather the header's facts from every rank, run
the suite (`BenchContext`), and end with exit status 1 when any point's result was wrong.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch

from sparta.errors import ConfigError
from sparta_tools.bench import header, records
from sparta_tools.bench.options import BenchOptions


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
        self.planted = not opts.plant_wrong  # True once the planted error is placed
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
            point["identity"] = ["suite", "engine", *base, "variant", "ranks"]  # what `compare` pairs points by
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
    """Every rank's JSON-serialisable ``obj``, in rank order (collective over ``comm``)."""
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
    facts = gather_json(world.comm, header.local_facts(opts.device))
    stream = None
    if world.rank == 0 and opts.output:
        stream = records.emit_stream(opts.output)
    options = asdict(opts)
    options["suite_options"] = options.pop("flags")  # the name `sparta bench` runs have always recorded them under
    # under the user's own launcher, `command` is one rank's argv: the launcher's line says how to rerun
    launched_by = header.user_launch_command() if standalone else None
    head = header.record(
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
