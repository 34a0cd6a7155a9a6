"""All-to-all and all-reduce over message sizes, for each engine, on 4 ranks.

    python benchmarks/collectives.py            # launches every engine, prints JSON lines
    python benchmarks/collectives.py --table    # and a readable table at the end
    torchrun --nproc-per-node 4 benchmarks/collectives.py --worker   # one engine, by hand

Each point: the per-rank message size in bytes, the median over repeats of the slowest
rank's time, and algorithm bandwidth (bytes / time). Three variants per point, run
alternately: `raw` is the engine's own call (dist.all_to_all_single, hvd.alltoall,
MPI Alltoall), `sparta` is Communicator with check_inputs off (what tuned code runs),
`sparta+check` is the default with agreed input checks.

What the input checks cost on small messages, where their round trip shows most (the
figure in CommConfig's docstring):

    python benchmarks/collectives.py --backends torch --nprocs 2 --check-cost 2000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SIZES = [4 << 10 << (2 * i) for i in range(8)]  # 4 KiB ... 64 MiB
LAUNCHES = {
    "torch": lambda py, n, me: [
        py,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={n}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        me,
    ],
    "mpi": lambda py, n, me: [
        "mpirun",
        "--oversubscribe",
        "--allow-run-as-root",
        "--bind-to",
        "none",
        "-np",
        str(n),
        py,
        me,
    ],
    "horovod": lambda py, n, me: [
        str(Path(py).parent / "horovodrun"),
        "--gloo",
        "-np",
        str(n),
        "-H",
        f"localhost:{n}",
        py,
        me,
    ],
}


def raw_ops(world, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The engine's own all-to-all and all-reduce on `x`, as a user of that engine writes them."""
    comm = world.comm
    if world.backend == "torch":
        import torch.distributed as dist

        out = torch.empty_like(x)
        return {
            "all_to_all": lambda: dist.all_to_all_single(out, x, group=comm.pg),
            "all_reduce": lambda: dist.all_reduce(x.clone(), group=comm.pg),
        }
    if world.backend == "horovod":
        import horovod.torch as hvd

        return {"all_to_all": lambda: hvd.alltoall(x), "all_reduce": lambda: hvd.allreduce(x, op=hvd.Sum)}
    from mpi4py import MPI

    src, dst = x.numpy(), torch.empty_like(x).numpy()
    return {
        "all_to_all": lambda: comm.mpi.Alltoall(src, dst),
        "all_reduce": lambda: comm.mpi.Allreduce(src, dst, op=MPI.SUM),
    }


def sparta_ops(comm, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    return {"all_to_all": lambda: comm.all_to_all(x), "all_reduce": lambda: comm.all_reduce(x)}


def worker(args: argparse.Namespace) -> None:
    import sparta
    from sparta.comm import CommConfig

    torch.set_num_threads(1)
    world = sparta.init(backend=args.backend)
    checked = world.comm
    fast = world.comm.split_groups([list(range(world.size))], CommConfig(check_inputs=False))
    assert fast is not None
    if args.check_cost:
        check_cost(world, fast, args.check_cost)
        world.shutdown()
        return
    for nbytes in SIZES[: args.max_sizes]:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        raw = raw_ops(world, x)
        variants = {"raw": raw, "sparta": sparta_ops(fast, x), "sparta+check": sparta_ops(checked, x)}
        repeats = max(3, min(30, int(64e6 / nbytes)))
        for op in ("all_to_all", "all_reduce"):
            times: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(repeats + 1):  # the first round warms up and is dropped
                for name, ops in variants.items():
                    checked.barrier()
                    t0 = time.perf_counter()
                    ops[op]()
                    dt = time.perf_counter() - t0
                    slowest = max(t.item() for t in checked.all_gather(torch.tensor([dt], dtype=torch.float64)))
                    times[name].append(slowest)
            if world.rank == 0:
                for name, ts in times.items():
                    med = statistics.median(ts[1:])
                    print(
                        json.dumps(
                            {
                                "backend": world.backend,
                                "variant": name,
                                "op": op,
                                "ranks": world.size,
                                "bytes": nbytes,
                                "median_s": med,
                                "algbw_GBps": nbytes / med / 1e9,
                                "repeats": repeats,
                            }
                        ),
                        flush=True,
                    )
    world.shutdown()


def check_cost(world, fast, repeats: int) -> None:
    """Median time of a 1 KiB all-reduce and all-to-all with check_inputs on and off (run
    alternately, a barrier before each call; the slowest rank's median), and of an
    async all-reduce's issue alone (what `async_op=True` blocks for)."""
    x = torch.ones(256, dtype=torch.float32)
    calls = {
        "all_reduce": lambda comm: comm.all_reduce(x),
        "all_reduce issue (async_op=True)": lambda comm: comm.all_reduce(x, async_op=True),
        "all_to_all": lambda comm: comm.all_to_all(x),
    }
    for op, call in calls.items():
        times: dict[str, list[float]] = {"check_inputs=False": [], "check_inputs=True": []}
        pending = []
        for i in range(repeats + 10):  # the first ten warm up and are dropped
            for name, comm in (("check_inputs=False", fast), ("check_inputs=True", world.comm)):
                world.comm.barrier()
                t0 = time.perf_counter()
                out = call(comm)
                dt = time.perf_counter() - t0
                pending.append(out)
                if i >= 10:
                    times[name].append(dt)
            for h in pending:
                if not isinstance(h, torch.Tensor):
                    h.wait()
            pending.clear()
        medians = torch.tensor([statistics.median(t) for t in times.values()], dtype=torch.float64)
        slowest = torch.stack(world.comm.all_gather(medians)).max(0).values.tolist()
        if world.rank == 0:
            record = {"backend": world.backend, "ranks": world.size, "op": op, "bytes": x.numel() * 4}
            record.update({f"{k} median_us": round(v * 1e6, 1) for k, v in zip(times, slowest, strict=True)})
            record["repeats"] = repeats
            print(json.dumps(record), flush=True)


VARIANTS = ("raw", "sparta", "sparta+check")


def table(rows: list[dict]) -> str:
    lines = [
        f"{'backend':8} {'op':10} {'bytes':>9} "
        + " ".join(f"{v + ' ms':>14}" for v in VARIANTS)
        + f" {'sparta GB/s':>12}"
    ]
    keyed = {(r["backend"], r["op"], r["bytes"], r["variant"]): r for r in rows}
    for backend, op, nbytes in sorted({(r["backend"], r["op"], r["bytes"]) for r in rows}):
        cells = [keyed.get((backend, op, nbytes, v)) for v in VARIANTS]
        ms = " ".join(f"{c['median_s'] * 1e3:14.3f}" if c else f"{'-':>14}" for c in cells)
        bw = f"{cells[1]['algbw_GBps']:12.3f}" if cells[1] else f"{'-':>12}"
        size = f"{nbytes >> 10} KiB" if nbytes < 1 << 20 else f"{nbytes >> 20} MiB"
        lines.append(f"{backend:8} {op:10} {size:>9} {ms} {bw}")
    return "\n".join(lines)


def driver(args: argparse.Namespace) -> None:
    me = str(Path(__file__).resolve())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    rows: list[dict] = []
    for backend in args.backends.split(","):
        if (
            backend == "mpi"
            and shutil.which("mpirun") is None
            or backend == "horovod"
            and shutil.which("horovodrun", path=str(Path(sys.executable).parent)) is None
        ):
            print(json.dumps({"backend": backend, "skipped": "engine not installed"}), flush=True)
            continue
        cmd = LAUNCHES[backend](sys.executable, args.nprocs, me) + [
            "--worker",
            "--backend",
            backend,
            "--max-sizes",
            str(args.max_sizes),
            "--check-cost",
            str(args.check_cost),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        for line in proc.stdout.splitlines():
            # horovodrun prefixes every line with "[rank]<stdout>:"
            record = line[line.find("{") :]
            if record.startswith("{") and record.endswith("}"):
                print(record, flush=True)
                rows.append(json.loads(record))
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise SystemExit(f"{backend} benchmark failed with exit code {proc.returncode}")
    if args.table and not args.check_cost:
        print(table(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help="run as one rank of an already launched job")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--backends", default="torch,mpi,horovod", help="engines the driver launches")
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--max-sizes", type=int, default=len(SIZES), help="measure only the first N sizes")
    parser.add_argument("--table", action="store_true", help="print a readable table after the JSON lines")
    parser.add_argument(
        "--check-cost", type=int, default=0, metavar="N", help="only time 1 KiB calls with and without checks, N each"
    )
    args = parser.parse_args()
    (worker if args.worker else driver)(args)


if __name__ == "__main__":
    main()
