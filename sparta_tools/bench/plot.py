"""`sparta bench plot run.jsonl -o run.png`: busbw against size and latency bands, one line per
variant (engine and variant), one row per op (and traffic pattern); suites without a size
sweep get bars of the median with min-max whiskers. The run's header is printed under the
plots, so a PNG on its own says what produced it. Needs matplotlib (`pip install 'sparta[bench]'`).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections import defaultdict
from typing import Any

from sparta_tools.bench.records import read_records


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plot", help="PNG: busbw vs size and latency bands per variant, the header underneath",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("file", metavar="run.jsonl", help="a run's JSON lines (-J)")
    p.add_argument("-o", "--out", default="", help="the PNG to write (default: the run's name with .png)")
    p.set_defaults(run=run)


def header_text(head: dict[str, Any], width: int = 170) -> str:
    """The run's header as lines of at most ``width`` characters, printed under each plot."""
    git = head.get("git") or {}
    opts = head.get("options") or {}
    lines = [
        f"sparta {head.get('sparta')} @ {str(git.get('commit'))[:12]}{' (dirty)' if git.get('dirty') else ''} | "
        f"torch {head.get('torch')} | nccl {head.get('nccl')} | {head.get('mpi_library')} | "
        f"horovod {head.get('horovod')}",
        f"{head.get('ranks')} ranks on {head.get('nodes')} node(s) {head.get('hosts')} ranks/node "
        f"{head.get('ranks_per_node')} | {head.get('cpu_model')} | gpu {head.get('gpu_model')} | "
        f"device {head.get('device')} | bind {opts.get('bind')} | engines {head.get('engines') or head.get('engine')}",
        f"dtype {opts.get('dtype')} | -n {opts.get('iters')} -w {opts.get('warmup')} | times: {opts.get('combine')} "
        f"over ranks per call | {head.get('time')}",
        "command: " + " ".join(map(str, head.get("command") or [])),
    ]
    return "\n".join(textwrap.fill(line, width, subsequent_indent="    ") for line in lines)


def draw(records: list[dict[str, Any]], out: str) -> None:
    """The run's plots into PNG ``out``: busbw against size and the latency band per variant, the header under them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head = records[0]
    points = [r for r in records if r.get("type") == "point" and r.get("median_us") is not None]
    sized = [p for p in points if p.get("bytes") is not None and p.get("op")]
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in sized:
        groups[" ".join(str(p[k]) for k in ("op", "pattern") if p.get(k))].append(p)
    others = [p for p in points if p not in sized]
    rows = len(groups) + (1 if others else 0)
    if rows == 0:
        raise ValueError("the run has no timed points to plot")
    fig, axes = plt.subplots(rows, 2, figsize=(13, 3.6 * rows + 1.6), squeeze=False)
    for row, (title, pts) in enumerate(sorted(groups.items())):
        bw, lat = axes[row]
        lines: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for p in pts:
            lines[f"{p.get('engine')} {p.get('variant')}"].append(p)
        for name, series in sorted(lines.items()):
            series.sort(key=lambda p: p["bytes"])
            x = [p["bytes"] for p in series]
            if any(p.get("busbw_GBps") is not None for p in series):
                bw.plot(x, [p.get("busbw_GBps") or 0 for p in series], marker="o", ms=3, label=name)
            (line,) = lat.plot(x, [p["median_us"] for p in series], marker="o", ms=3, label=name)
            lo = [p.get("min_us", p["median_us"]) for p in series]
            hi = [p.get("max_us", p["median_us"]) for p in series]
            lat.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15)
            if all(p.get("p99_us") is not None for p in series):
                lat.plot(x, [p["p99_us"] for p in series], ls="--", lw=0.8, color=line.get_color())
        for ax, ylabel in ((bw, "busbw GB/s"), (lat, "time us (median; band min-max; dashed p99)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("size, bytes")
            ax.set_ylabel(ylabel)
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
        lat.set_yscale("log")
        bw.legend(fontsize=7)
    if others:
        ax = axes[-1][0]
        names = [" ".join(str(p[k]) for k in ("config", "candidate", "variant", "engine") if p.get(k)) for p in others]
        med = [p["median_us"] for p in others]
        err = [[m - p.get("min_us", m) for p, m in zip(others, med, strict=True)],
               [p.get("max_us", m) - m for p, m in zip(others, med, strict=True)]]  # fmt: skip
        ax.barh(range(len(med)), med, xerr=err, color="tab:blue", alpha=0.7)
        ax.set_yticks(range(len(med)), names, fontsize=7)
        ax.set_xlabel("time us (median; whiskers min-max)")
        axes[-1][1].axis("off")
    fig.suptitle(f"sparta bench {head.get('suite')}")
    text = header_text(head)
    fig.text(0.01, 0.005, text, fontsize=7, family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.03 + 0.012 * text.count("\n") * 4 / rows, 1, 0.97))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """`sparta bench plot`: draw the run file; exit 2 when it cannot be read."""
    try:
        records = read_records(args.file)
    except (OSError, ValueError) as exc:
        print(f"sparta bench plot: {exc}", file=sys.stderr)
        return 2
    out = args.out or (args.file.rsplit(".", 1)[0] + ".png")
    try:
        draw(records, out)
    except ImportError:
        print("sparta bench plot: needs matplotlib (pip install 'sparta[bench]')", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"sparta bench plot: {args.file}: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
