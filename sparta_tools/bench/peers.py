"""Peers outside Sparta, run by the driver when their binaries are on PATH: nccl-tests and the
OSU micro-benchmarks. A peer that cannot run leaves a `skipped` record with the reason.

nccl-tests run as one process over `--nprocs` GPUs (`-g`); OSU under mpirun on `--nprocs`
local ranks. Their own figures are recorded as they print them: nccl-tests' time is its mean
per iteration (out-of-place columns), OSU's the mean latency with min/max over ranks (`-f`),
so compare their medians with Sparta's with that in mind.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

from sparta_tools.bench.options import BenchOptions, human_size

NCCL_TESTS = {
    "all_reduce": "all_reduce_perf",
    "all_gather": "all_gather_perf",
    "reduce_scatter": "reduce_scatter_perf",
    "all_to_all": "alltoall_perf",
    "broadcast": "broadcast_perf",
}
OSU = {
    "all_reduce": "osu_allreduce",
    "all_gather": "osu_allgather",
    "reduce_scatter": "osu_reduce_scatter",
    "all_to_all": "osu_alltoall",
    "broadcast": "osu_bcast",
    "alltoallv": "osu_alltoallv",
}
NCCL_DTYPES = {"float32": "float", "float16": "half", "float64": "double", "bfloat16": "bfloat16",
               "int8": "int8", "uint8": "uint8", "int32": "int32", "int64": "int64"}  # fmt: skip


def parse_nccl_tests(text: str, op: str) -> list[dict[str, Any]]:
    """nccl-tests' table rows (size count type redop root, then out-of-place time algbw busbw #wrong)."""
    out = []
    for line in text.splitlines():
        t = line.split()
        if len(t) < 9 or not t[0].isdigit():
            continue
        try:
            size, time_us, algbw, busbw = int(t[0]), float(t[5]), float(t[6]), float(t[7])
            wrong = int(t[8]) if t[8].isdigit() else None
        except ValueError:
            continue
        out.append({"op": op, "bytes": size, "size": human_size(size), "median_us": time_us, "algbw_GBps": algbw,
                    "busbw_GBps": busbw, "wrong": wrong})  # fmt: skip
    return out


def parse_osu(text: str, op: str) -> list[dict[str, Any]]:
    """OSU rows with -f: size, avg latency, min, max, iterations[, validation]."""
    out = []
    for line in text.splitlines():
        t = line.split()
        if len(t) < 5 or not t[0].isdigit():
            continue
        try:
            size, avg, lo, hi = int(t[0]), float(t[1]), float(t[2]), float(t[3])
        except ValueError:
            continue
        wrong = None
        if len(t) >= 6:
            wrong = 0 if t[5].lower().startswith("pass") else 1
        out.append({"op": op, "bytes": size, "size": human_size(size), "median_us": avg, "min_us": lo, "max_us": hi,
                    "wrong": wrong, "note": "OSU: mean latency; min/max are over ranks"})  # fmt: skip
    return out


def _run(cmd: list[str], timeout_s: float) -> tuple[int, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return 124, ""
    return proc.returncode, proc.stdout + proc.stderr


def run_peers(opts: BenchOptions, ops: Sequence[str]) -> list[dict[str, Any]]:
    """Records of the peers for `ops` (points, or `skipped` with the reason)."""
    found: list[dict[str, Any]] = []
    common = {"suite": opts.suite, "dtype": opts.dtype}
    for op in ops:
        binary = NCCL_TESTS.get(op)
        if binary:
            where = shutil.which(binary)
            if where is None:
                found.append({"type": "skipped", **common, "peer": f"nccl-tests {binary}", "reason": "not on PATH"})
            elif opts.device != "cuda":
                found.append({"type": "skipped", **common, "peer": f"nccl-tests {binary}",
                              "reason": "nccl-tests time CUDA buffers; run with --device cuda"})  # fmt: skip
            else:
                cmd = [where, "-b", str(opts.minbytes), "-e", str(opts.maxbytes), "-f", str(opts.stepfactor),
                       "-n", str(opts.iters), "-w", str(opts.warmup), "-c", "1", "-g", str(opts.nprocs),
                       "-d", NCCL_DTYPES[opts.dtype]]  # fmt: skip
                code, text = _run(cmd, opts.timeout_s)
                rows = parse_nccl_tests(text, op) if code == 0 else []
                if not rows:
                    found.append({"type": "skipped", **common, "peer": f"nccl-tests {binary}",
                                  "reason": f"exit {code}: {text[-300:]}"})  # fmt: skip
                for row in rows:
                    found.append({"type": "point", **common, "engine": "nccl-tests", "variant": "nccl-tests",
                                  "command": cmd, "ranks": opts.nprocs, **row})  # fmt: skip
        binary = OSU[op]
        where = shutil.which(binary)
        if where is None:
            found.append({"type": "skipped", **common, "peer": f"OSU {binary}", "reason": "not on PATH"})
            continue
        if shutil.which("mpirun") is None:
            found.append({"type": "skipped", **common, "peer": f"OSU {binary}", "reason": "mpirun is not on PATH"})
            continue
        cmd = ["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", str(opts.nprocs), where, "-f", "-c",
               "-m", f"{opts.minbytes}:{opts.maxbytes}", "-i", str(opts.iters), "-x", str(opts.warmup)]  # fmt: skip
        code, text = _run(cmd, opts.timeout_s)
        rows = parse_osu(text, op) if code == 0 else []
        if not rows:
            found.append(
                {"type": "skipped", **common, "peer": f"OSU {binary}", "reason": f"exit {code}: {text[-300:]}"}
            )
        for row in rows:
            found.append({"type": "point", **common, "engine": "osu", "variant": "osu", "command": cmd,
                          "ranks": opts.nprocs, **row})  # fmt: skip
    return found
