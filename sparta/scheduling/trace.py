"""Timelines of what each rank computed and sent, as Chrome trace JSON (Perfetto, chrome://tracing).

A Tracer records spans on one rank; `gather` brings every rank's spans to rank 0 and
`write_chrome_trace` writes them with one process per rank and one thread per track
("compute", "comm", ...). Times come from time.perf_counter, which on Linux is the
system-wide monotonic clock, so ranks on one machine (or one emulated cluster) line up.

A communication span runs from the moment the transfer was issued to the moment this rank
waited for it and found it done: an upper bound of the transfer's own time.

    tracer = Tracer()
    y = pipelined_exchange(..., tracer=tracer)
    spans = gather(world.comm, tracer)           # every rank calls it; rank 0 gets them all
    if spans is not None: write_chrome_trace("moe.trace.json", spans); draw_timeline("moe.png", spans)

Code that does not take a tracer (an MoE layer) is traced through its communicators:
`TracedExchange(comm, tracer, "inter-node comm")` records every all-to-all it carries, named
by `tracer.context` (the pipeline sets it to the chunk, e.g. "bwd out 2"), and the pipeline
finds the tracer on its exchange to record its compute chunks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from sparta.comm.communicator import Communicator
from sparta.comm.exchange import Exchange, PendingAllToAll


@dataclass(frozen=True)
class Span:
    """One interval on one track: name (e.g. "fwd compute 2"), track (e.g. "compute"),
    start_s and end_s (time.perf_counter seconds), args (shown in the viewer)."""

    name: str
    track: str
    start_s: float
    end_s: float
    args: dict[str, Any] = field(default_factory=dict)


class Tracer:
    """Collects this rank's spans. `context` names what is being communicated now (set by
    the pipeline around each chunk's transfers) for the spans of a TracedExchange."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.context = ""

    def record(self, name: str, track: str, start_s: float, end_s: float, **args: Any) -> None:
        """Add a span from ``start_s`` to ``end_s`` (seconds, the tracer's clock) on ``track``."""
        self.spans.append(Span(name, track, start_s, end_s, args))

    @contextmanager
    def span(self, name: str, track: str, **args: Any) -> Iterator[None]:
        """Record the time the `with` body takes."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, track, begin, time.perf_counter(), **args)


class ObservedExchange(Exchange):
    """An Exchange that the pipeline (sparta.scheduling.pipeline) tells about its work: it
    records its compute chunks on `tracer` when there is one, and calls `issued(name)` just
    after it starts each transfer (gradient sync uses that to slot its own pieces in)."""

    tracer: Tracer | None = None

    def issued(self, name: str) -> None:
        """A transfer named `name` was just started on this exchange."""


class TracedExchange(ObservedExchange):
    """`inner` (a Communicator, a HierarchicalAllToAll, any Exchange) whose all-to-alls are
    recorded as spans on `track`, from issue to completion (for an async one: until its
    handle's wait returns). With `track=None` it records nothing itself and only carries
    `tracer` to the pipeline (for a hierarchical exchange whose intra and inter exchanges
    are traced). It is an Exchange over the same ranks and nothing more: hand a layer
    `exchange=TracedExchange(comm, ...)` for its rows, and `comm` itself for the rest."""

    def __init__(self, inner: Exchange, tracer: Tracer, track: str | None) -> None:
        self.inner, self.tracer, self.track = inner, tracer, track
        self.size, self.rank, self.ranks = inner.size, inner.rank, inner.ranks

    @property
    def where(self) -> str:
        return self.inner.where

    def __repr__(self) -> str:
        return f"TracedExchange({self.inner!r}, track={self.track!r})"

    def start_all_to_all(
        self,
        x: torch.Tensor,
        send_splits: Sequence[int] | None = None,
        recv_splits: Sequence[int] | None = None,
        check: bool | None = None,
    ) -> PendingAllToAll:
        begin = time.perf_counter()
        started = self.inner.start_all_to_all(x, send_splits, recv_splits, check)
        if self.track is None:
            return started
        name, track = self.tracer.context or "all_to_all", self.track

        def done(y: torch.Tensor) -> torch.Tensor:
            rows = int(y.shape[0]) if y.dim() else 0
            self.tracer.record(name, track, begin, time.perf_counter(), rows=rows)
            return y

        return PendingAllToAll(started.handle.then(done), started.send_splits, started.recv_splits)


def gather(comm: Communicator, tracer: Tracer) -> dict[int, list[Span]] | None:
    """Every rank's spans on rank 0 ({rank: spans}); None on the others. Collective."""
    mine = torch.frombuffer(bytearray(json.dumps([asdict(s) for s in tracer.spans]).encode()), dtype=torch.uint8)
    every = comm.all_gather(mine)
    if comm.rank != 0:
        return None
    return {r: [Span(**s) for s in json.loads(bytes(t.tolist()))] for r, t in enumerate(every)}  # type: ignore[union-attr]


def _disjoint(spans: Sequence[Span]) -> list[tuple[Span, float, float]]:
    """(span, start, end) in start order, each start clipped to the end of the previous span
    of its track (see write_chrome_trace)."""
    free: dict[str, float] = {}
    out = []
    for s in sorted(spans, key=lambda s: (s.start_s, s.end_s)):
        begin = max(s.start_s, free.get(s.track, s.start_s))
        end = max(s.end_s, begin)
        free[s.track] = end
        out.append((s, begin, end))
    return out


def write_chrome_trace(path: str | Path, spans: Mapping[int, Sequence[Span]]) -> None:
    """Chrome trace JSON: process = rank, thread = track, times in microseconds from the
    earliest span. Spans of one track are made disjoint for the viewers, which expect
    slices of one thread to nest: a transfer issued while an earlier one on the same track
    is in flight is drawn from the earlier one's end (the link carries them in turn); its
    issue time stays in args["issued_us"]."""
    everything = [s for ranks in spans.values() for s in ranks]
    origin = min((s.start_s for s in everything), default=0.0)
    tracks = sorted({s.track for s in everything})
    events: list[dict[str, Any]] = []
    for rank, ranks in sorted(spans.items()):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for tid, track in enumerate(tracks):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}})
        for s, begin, end in _disjoint(ranks):
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "pid": rank,
                    "tid": tracks.index(s.track),
                    "ts": (begin - origin) * 1e6,
                    "dur": (end - begin) * 1e6,
                    "args": {**s.args, "issued_us": round((s.start_s - origin) * 1e6, 1)},
                }
            )
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def draw_timeline(path: str | Path, spans: Mapping[int, Sequence[Span]], title: str = "") -> None:
    """A PNG of the same timeline: one row per (rank, track), one bar per span, a colour
    per track; chunk numbers are written on bars wide enough to hold them."""
    # An explicit Agg canvas: files only, and no change to the process's pyplot backend.
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    everything = [s for ranks in spans.values() for s in ranks]
    origin = min((s.start_s for s in everything), default=0.0)
    tracks = sorted({s.track for s in everything})
    rows = [(rank, track) for rank in sorted(spans) for track in tracks]
    colours = colormaps["tab10"]
    fig = Figure(figsize=(14, 0.45 * len(rows) + 1.5))
    FigureCanvasAgg(fig)  # the figure draws on this canvas from now on
    ax = fig.add_subplot()
    span_s = max((s.end_s - origin for s in everything), default=1.0)
    for y, (rank, track) in enumerate(rows):
        mine = [(s, b, e) for s, b, e in _disjoint(spans[rank]) if s.track == track]
        bars = [((b - origin) * 1e3, (e - b) * 1e3) for _, b, e in mine]
        colour = colours(tracks.index(track) % 10)
        ax.broken_barh(bars, (y - 0.4, 0.8), color=colour, alpha=0.7, linewidth=0.3, edgecolor="k")
        for (s, _, _), (x, w) in zip(mine, bars, strict=True):
            if w > span_s * 1e3 / 60:
                ax.text(x + w / 2, y, s.name.split(" ", 1)[-1], ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(rows)), [f"rank {r}: {t}" for r, t in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title or "sparta timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
