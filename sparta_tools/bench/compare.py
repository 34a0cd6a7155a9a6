"""`sparta bench compare a.jsonl b.jsonl`: the same points of two runs, side by side.

Runs of different shape (suite, ranks, nodes, ranks per node, device, dtype, or a different
set of points) are refused, exit 2, naming the differences, unless `--force` (then the
common points are compared). Points pair by the fields their suite names as their identity
(`identity` in each point: e.g. op and bytes, or model and layout); a run that holds two
points of one identity is refused. A point whose [min, max] time ranges over calls do not
overlap is flagged SLOWER or FASTER; a point without such a range (a peer's line of
nccl-tests) gets no verdict. The exit status is 1 when any point got SLOWER, 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sparta_tools.bench.records import read_records

SHAPE = ("suite", "ranks", "nodes", "ranks_per_node", "device")
KEY = ("suite", "engine", "op", "pattern", "config", "candidate", "variant", "bytes", "dtype", "ranks")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compare", help="compare two runs point by point; flags changes whose ranges do not overlap",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("base", help="the reference run (JSON lines from -J)")
    p.add_argument("new", help="the run to judge against it")
    p.add_argument("--force", action="store_true", help="compare the common points of runs of different shape")
    p.set_defaults(run=run)


def shape(records: list[dict[str, Any]]) -> dict[str, Any]:
    """What two runs must share to be compared: suite, ranks, nodes, ranks per node, device and dtype."""
    head = records[0]
    out = {k: head.get(k) for k in SHAPE}
    out["dtype"] = (head.get("options") or {}).get("dtype")
    return out


def key(point: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """What identifies ``point``: its suite's `identity` fields (KEY for records without)."""
    names = point.get("identity") or KEY
    return tuple((k, repr(point.get(k))) for k in names)


def label(k: tuple[tuple[str, Any], ...]) -> str:
    """The point's identity as one line: its values, sizes in bytes made readable."""
    from sparta_tools.bench.options import human_size

    skip = {"suite", "ranks", "size", "count", "dtype"}
    words = []
    for name, value in k:
        if name in skip or value == "None":
            continue
        words.append(human_size(int(value)) if name == "bytes" else value.strip("'"))
    return " ".join(words)


def _points(records: list[dict[str, Any]], which: str) -> dict[tuple[tuple[str, Any], ...], dict[str, Any]]:
    out: dict[tuple[tuple[str, Any], ...], dict[str, Any]] = {}
    for p in records:
        if p.get("type") == "point":
            k = key(p)
            if k in out:
                raise ValueError(f"the {which} run holds two points of one identity: {label(k)}")
            out[k] = p
    return out


def differences(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[str]:
    """What makes the two runs of different shape (empty when they match)."""
    out = []
    sa, sb = shape(a), shape(b)
    out += [f"{k}: {sa[k]} vs {sb[k]}" for k in sa if sa[k] != sb[k]]
    ka, kb = set(_points(a, "first")), set(_points(b, "second"))
    if ka - kb:
        out.append(f"{len(ka - kb)} point(s) only in the first, e.g. {label(sorted(ka - kb, key=str)[0])}")
    if kb - ka:
        out.append(f"{len(kb - ka)} point(s) only in the second, e.g. {label(sorted(kb - ka, key=str)[0])}")
    return out


def compare(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per common point: medians, ratio new/base, and the verdict on the ranges."""
    pa, pb = _points(a, "first"), _points(b, "second")
    rows = []
    for k in [k for k in pa if k in pb]:
        x, y = pa[k], pb[k]
        if x.get("median_us") is None or y.get("median_us") is None:
            continue
        ranged = all(p.get(f) is not None for p in (x, y) for f in ("min_us", "max_us"))
        lo_a, hi_a = (x["min_us"], x["max_us"]) if ranged else (x["median_us"],) * 2
        lo_b, hi_b = (y["min_us"], y["max_us"]) if ranged else (y["median_us"],) * 2
        verdict = "no range" if not ranged else "SLOWER" if lo_b > hi_a else "FASTER" if hi_b < lo_a else ""
        rows.append({"point": label(k), "base_us": x["median_us"], "new_us": y["median_us"],
                     "ratio": y["median_us"] / x["median_us"] if x["median_us"] else float("inf"),
                     "base_range": (lo_a, hi_a), "new_range": (lo_b, hi_b), "verdict": verdict})  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> int:
    """`sparta bench compare`: the table; exit 1 when a point got slower, 2 when the runs cannot be compared."""
    try:
        a, b = read_records(args.base), read_records(args.new)
        diff = differences(a, b)
    except (OSError, ValueError) as exc:
        print(f"sparta bench compare: {exc}", file=sys.stderr)
        return 2
    if diff and not args.force:
        print("sparta bench compare: the runs differ in shape (use --force to compare their common points):\n  "
              + "\n  ".join(diff), file=sys.stderr)  # fmt: skip
        return 2
    for d in diff:
        print(f"# differs: {d}")
    rows = compare(a, b)
    width = max([len(r["point"]) for r in rows] + [5])
    print(f"# {args.base} -> {args.new}: median us, [min, max] over calls; flagged where the ranges do not overlap")
    print(f"#{'point':>{width - 1}} {'base':>10} {'new':>10} {'new/base':>9}  {'base range':>21}  {'new range':>21}")
    for r in rows:
        ra = f"[{r['base_range'][0]:.1f}, {r['base_range'][1]:.1f}]"
        rb = f"[{r['new_range'][0]:.1f}, {r['new_range'][1]:.1f}]"
        print(f"{r['point']:>{width}} {r['base_us']:10.1f} {r['new_us']:10.1f} {r['ratio']:9.3f}  {ra:>21}  {rb:>21}"
              f"  {r['verdict']}")  # fmt: skip
    slower = sum(r["verdict"] == "SLOWER" for r in rows)
    faster = sum(r["verdict"] == "FASTER" for r in rows)
    print(f"# {len(rows)} points compared: {slower} slower, {faster} faster (ranges apart), the rest within noise")
    return 1 if slower else 0
