"""What `sparta bench` writes: JSON lines, a header first, then one record per point.

Record types (the "type" field):
    header   the run: versions (Sparta and its git commit, torch, NCCL, MPI, Horovod), hosts,
             ranks per node, CPU/GPU model, each rank's CPU affinity, the relevant environment,
             the command (``launch_command``: the launcher's line, the driver's or the
             user's own), the options, and the definitions below (BANDWIDTH, TIMING);
             header.py builds it
    point    one (op or pattern, engine, variant, size): times in microseconds over the timed
             calls (median, min, max, p99; each call's time combined over ranks per -a), the
             spread of the ranks' own medians, bandwidths in GB/s (1e9 bytes/s), imbalance,
             and `wrong`: elements that differed from the seeded oracle, over all ranks
    skipped  a variant, engine or peer that could not run here, with the reason
Timings never assert anything; `wrong` > 0 anywhere makes the run exit 1.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

SCHEMA = 1

BANDWIDTH = {
    "units": "GB/s = 1e9 bytes per second; times in microseconds",
    "size": "nccl-tests' size: all_reduce/broadcast the buffer; all_gather the gathered output; "
    "reduce_scatter the input; all_to_all each rank's whole send buffer; alltoallv the mean bytes a rank sends",
    "algbw": "size / median time; alltoallv: the busiest rank's max(sent, received) bytes (its own included) / time",
    "busbw": "algbw * 2(n-1)/n for all_reduce; * (n-1)/n for all_gather, reduce_scatter, all_to_all, alltoallv; "
    "* 1 for broadcast (n ranks)",
    "busbw_noself": "the busiest rank's max(sent, received) bytes to and from OTHER ranks / time (DeepEP's "
    "definition: a rank's own traffic excluded; for the uniform collectives it equals busbw)",
    "internode_busbw": "the busiest rank's max(sent, received) bytes to and from ranks on OTHER nodes / time, for "
    "the traffic of the flat algorithm (every rank's block to every rank; all_reduce as reduce-scatter + "
    "all-gather); a two-level algorithm crosses with 1/ranks-per-node of it for the reducing and gathering "
    "ops, so its figure here reads that much higher than its links carried; null on one node",
    "imbalance": "the busiest rank's max(sent, received) bytes / the mean over ranks (1.0 when even)",
    "pct_peak": "busbw / --peak * 100, when --peak was given",
}
TIMING = (
    "every call: barrier, clock, the call (CUDA: then synchronize), clock; variants alternate in a rotated "
    "order each iteration; -w untimed calls per variant first; one call's time combines the ranks' times per -a "
    "(max: the slowest rank's, what every rank waited for); median/min/max/p99 are over the -n calls; "
    "rank_spread_us is the slowest rank's median minus the fastest rank's"
)


# ------------------------------------------------------------------------------ statistics
def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sequence."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def combine(per_rank: Sequence[Sequence[float]], how: str) -> list[float]:
    """Each call's time from the ranks' times of it: per_rank[r][i] -> [i]."""
    calls = list(zip(*per_rank, strict=True))
    if how == "max":
        return [max(c) for c in calls]
    if how == "min":
        return [min(c) for c in calls]
    if how == "avg":
        return [sum(c) / len(c) for c in calls]
    return list(per_rank[0])  # rank0


def time_stats(per_rank: Sequence[Sequence[float]], how: str) -> dict[str, Any]:
    """Seconds per rank and call -> the point's time fields (microseconds)."""
    calls = combine(per_rank, how)
    medians = [statistics.median(r) for r in per_rank]
    us = 1e6
    return {
        "median_us": round(statistics.median(calls) * us, 3),
        "min_us": round(min(calls) * us, 3),
        "max_us": round(max(calls) * us, 3),
        "p99_us": round(percentile(calls, 99) * us, 3),
        "rank_spread_us": round((max(medians) - min(medians)) * us, 3),
        "slowest_rank": max(range(len(medians)), key=medians.__getitem__),
    }


BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "alltoallv": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def sig(x: float, digits: int = 6) -> float:
    """`x` to `digits` significant digits (GB/s of tiny messages are small numbers)."""
    return float(f"{x:.{digits}g}")


def traffic_fields(
    matrix: Sequence[Sequence[float]], node_of: Sequence[int], seconds: float
) -> dict[str, float | None]:
    """busbw_noself, internode_busbw and imbalance from bytes matrix[i][j] that rank i sends j."""
    n = len(matrix)
    sent = [sum(row) for row in matrix]
    recv = [sum(matrix[i][j] for i in range(n)) for j in range(n)]
    load = [max(s, r) for s, r in zip(sent, recv, strict=True)]
    off = [
        max(sum(matrix[i][j] for j in range(n) if j != i), sum(matrix[j][i] for j in range(n) if j != i))
        for i in range(n)
    ]
    inter = [
        max(
            sum(matrix[i][j] for j in range(n) if node_of[j] != node_of[i]),
            sum(matrix[j][i] for j in range(n) if node_of[j] != node_of[i]),
        )
        for i in range(n)
    ]
    mean = sum(load) / n
    return {
        "busiest_bytes": max(load),
        "busbw_noself_GBps": sig(max(off) / seconds / 1e9),
        "internode_busbw_GBps": sig(max(inter) / seconds / 1e9) if len(set(node_of)) > 1 else None,
        "imbalance": round(max(load) / mean, 4) if mean else 1.0,
    }


def collective_matrix(op: str, size: int, n: int, root: int = 0) -> list[list[float]]:
    """The bytes the flat algorithm moves for `op` at nccl-tests' `size`, as a matrix: every
    rank's block reaches every other rank (all_reduce: twice, reduce-scatter then all-gather);
    broadcast: the root's buffer reaches every other rank. Within a node it is what any
    algorithm moves; across nodes a two-level one moves less (see BANDWIDTH's
    internode_busbw)."""
    if op == "broadcast":
        return [[float(size) if i == root and j != root else 0.0 for j in range(n)] for i in range(n)]
    block = size / n * (2 if op == "all_reduce" else 1)
    return [[block] * n for _ in range(n)]


def bandwidth(op: str, size: int, matrix: Sequence[Sequence[float]], node_of: Sequence[int], seconds: float,
              peak_gbps: float = 0.0) -> dict[str, Any]:  # fmt: skip
    """algbw, busbw and the traffic fields of one point at its median time `seconds`."""
    n = len(matrix)
    fields = traffic_fields(matrix, node_of, seconds)
    moved = fields.pop("busiest_bytes") if op == "alltoallv" else size
    fields.pop("busiest_bytes", None)
    algbw = moved / seconds / 1e9
    busbw = algbw * BUS_FACTOR[op](n)
    if op == "broadcast":
        # the root's tree/pipeline is the engine's business; each receiver's bytes / time
        fields["busbw_noself_GBps"] = sig(busbw)
        fields["internode_busbw_GBps"] = sig(busbw) if len(set(node_of)) > 1 else None
        fields["imbalance"] = 1.0
    out = {"algbw_GBps": sig(algbw), "busbw_GBps": sig(busbw), **fields}
    if peak_gbps:
        out["pct_peak"] = round(busbw / peak_gbps * 100, 2)
    return out


# ------------------------------------------------------------------------------ files
def write_records(records: Iterable[dict[str, Any]], stream: IO[str]) -> None:
    """``records`` as JSON lines on ``stream``, flushed."""
    for record in records:
        stream.write(json.dumps(record) + "\n")
    stream.flush()


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """A run file's records; refuses a file whose first record is not a header."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON line ({exc})") from None
    if not records or records[0].get("type") != "header":
        raise ValueError(f"{path}: the first record is not a `sparta bench` header")
    return records


# ------------------------------------------------------------------------------ table
COLUMNS = (  # (field, title, width, format)
    ("op", "op", 14, "s"),
    ("pattern", "pattern", 9, "s"),
    ("candidate", "candidate", 18, "s"),
    ("engine", "engine", 7, "s"),
    ("config", "config", 6, "s"),
    ("vocab", "vocab", 7, "d"),
    ("variant", "variant", 18, "s"),
    ("size", "size", 7, "s"),
    ("median_us", "median_us", 11, ".1f"),
    ("min_us", "min_us", 10, ".1f"),
    ("p99_us", "p99_us", 10, ".1f"),
    ("rank_spread_us", "spread_us", 10, ".1f"),
    ("algbw_GBps", "algbw", 8, ".4g"),
    ("busbw_GBps", "busbw", 8, ".4g"),
    ("busbw_noself_GBps", "bw!self", 8, ".4g"),
    ("internode_busbw_GBps", "inter", 8, ".4g"),
    ("imbalance", "imbal", 6, ".2f"),
    ("ratio_to_dense", "x_dense", 8, ".3f"),
    ("bytes_sent_per_step", "sent_B", 10, "d"),
    ("pct_peak", "%peak", 6, ".1f"),
    ("wrong", "#wrong", 7, "d"),
)


def _cell(value: Any, width: int, fmt: str) -> str:
    if value is None:
        return f"{'-':>{width}}"
    if fmt == "s":
        return f"{str(value):>{width}}"
    try:
        return f"{value:>{width}{fmt}}"
    except (ValueError, TypeError):
        return f"{str(value):>{width}}"


def table(records: Sequence[dict[str, Any]]) -> str:
    """nccl-tests-like text: a comment block from the header, one row per point, skipped
    records as comments at the end."""
    from sparta_tools.bench.options import human_size

    head = next((r for r in records if r.get("type") == "header"), {})
    points = [r for r in records if r.get("type") == "point"]
    points = [{**p, "size": human_size(int(p["bytes"]))} if "bytes" in p else p for p in points]
    columns = [c for c in COLUMNS if any(c[0] in p for p in points)]
    lines = []
    if head:
        git = head.get("git") or {}
        lines.append(
            f"# sparta bench {head.get('suite')} | sparta {head.get('sparta')} ({str(git.get('commit'))[:10]}"
            f"{', dirty' if git.get('dirty') else ''}) torch {head.get('torch')} | {head.get('ranks')} ranks on "
            f"{head.get('nodes')} node(s) {head.get('hosts')} | {head.get('device')} | {head.get('cpu_model')}"
        )
        opts = head.get("options", {})
        lines.append(
            f"# dtype {opts.get('dtype')} | -n {opts.get('iters')} -w {opts.get('warmup')} | "
            f"times: {opts.get('combine')} over ranks per call, us | bandwidth GB/s (definitions in the JSON "
            f"header) | bind {opts.get('bind')}"
        )
    lines.append("#" + " ".join(f"{title:>{width}}" for _, title, width, _ in columns)[1:])
    for p in points:
        lines.append(" ".join(_cell(p.get(key), width, fmt) for key, _, width, fmt in columns))
    for s in (r for r in records if r.get("type") == "skipped"):
        what = " ".join(str(s[k]) for k in ("engine", "op", "variant", "peer", "candidate") if s.get(k))
        lines.append(f"# skipped {what}: {s.get('reason')}")
    wrong = sum(int(p.get("wrong") or 0) for p in points)
    lines.append(f"# {len(points)} points, {wrong} wrong")
    return "\n".join(lines)


def emit_stream(path: str) -> IO[str]:
    """Where JSON lines go: a file, or stdout for '-'."""
    if path == "-":
        return sys.stdout
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return open(path, "w")
