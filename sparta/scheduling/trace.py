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
    if spans is not None: write_chrome_trace("moe.trace.json", spans)
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
    """Collects this rank's spans."""

    def __init__(self) -> None:
        self.spans: list[Span] = []

    def record(self, name: str, track: str, start_s: float, end_s: float, **args: Any) -> None:
        self.spans.append(Span(name, track, start_s, end_s, args))

    @contextmanager
    def span(self, name: str, track: str, **args: Any) -> Iterator[None]:
        """Record the time the `with` body takes."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, track, begin, time.perf_counter(), **args)


def gather(comm: Communicator, tracer: Tracer) -> dict[int, list[Span]] | None:
    """Every rank's spans on rank 0 ({rank: spans}); None on the others. Collective."""
    mine = torch.frombuffer(bytearray(json.dumps([asdict(s) for s in tracer.spans]).encode()), dtype=torch.uint8)
    every = comm.all_gather(mine)
    if comm.rank != 0:
        return None
    return {r: [Span(**s) for s in json.loads(bytes(t.tolist()))] for r, t in enumerate(every)}  # type: ignore[union-attr]


def write_chrome_trace(path: str | Path, spans: Mapping[int, Sequence[Span]]) -> None:
    """Chrome trace JSON: process = rank, thread = track, times in microseconds from the
    earliest span."""
    everything = [s for ranks in spans.values() for s in ranks]
    origin = min((s.start_s for s in everything), default=0.0)
    tracks = sorted({s.track for s in everything})
    events: list[dict[str, Any]] = []
    for rank, ranks in sorted(spans.items()):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for tid, track in enumerate(tracks):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}})
        for s in ranks:
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "pid": rank,
                    "tid": tracks.index(s.track),
                    "ts": (s.start_s - origin) * 1e6,
                    "dur": max(s.end_s - s.start_s, 0.0) * 1e6,
                    "args": s.args,
                }
            )
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
