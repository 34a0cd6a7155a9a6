"""The replay behind the cost model: one pipelined exchange on two resources.

`timeline` replays `pipeline.run_pipeline`'s issue order on the network (one FIFO channel: the
slow link carries one transfer's bytes at a time; a fit's alpha delays its transfer's arrival
but leaves the channel to the next) and this rank's compute thread, and returns a `Timeline`:
when each transfer travelled and when the rank computed. `CostModel` (cost_model.py) feeds it
a profile's fits; the gradient partitioner (grad_sync.py) reads its idle network gaps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sparta.errors import InputError


@dataclass(frozen=True)
class Timeline:
    """One simulated pipeline: when the network carried each transfer and when this rank
    computed, as (start, end) seconds from the first issue; end_s when the last chunk is back."""

    network: tuple[tuple[float, float], ...]
    compute: tuple[tuple[float, float], ...]
    end_s: float

    def idle_network(self) -> tuple[tuple[float, float], ...]:
        """The (start, end) intervals before end_s when no transfer is on the network: where
        other traffic (a dense gradient all-reduce) can travel without delaying this one."""
        gaps, t = [], 0.0
        for begin, end in sorted(self.network):
            if begin > t:
                gaps.append((t, begin))
            t = max(t, end)
        if self.end_s > t:
            gaps.append((t, self.end_s))
        return tuple(gaps)

    def gap_openings(self) -> tuple[int, ...]:
        """For each gap of idle_network(), how many transfers (in issue order, which is the
        network's FIFO order) are issued before it opens: a piece submitted right after that
        many transfers queues behind the last of them and travels in the gap."""
        return tuple(sum(begin < gap_begin for begin, _ in self.network) for gap_begin, _ in self.idle_network())


def timeline(
    comm_s: Sequence[float],
    compute_s: Sequence[float],
    blocking_s: Sequence[float] | float = 0.0,
    latency_s: Sequence[float] | float = 0.0,
    before_s: Sequence[float] | float = 0.0,
    after_s: Sequence[float] | float = 0.0,
) -> Timeline:
    """Replay pipeline.run_pipeline for chunks of `comm_s[i]` network time each way,
    `compute_s[i]` compute, and `blocking_s[i]` spent on this thread to start each of their
    transfers (the hierarchical intra-node step). The network is one FIFO channel; of a
    transfer's time, `latency_s[i]` (a fit's alpha: setup, handshakes, the last byte's
    flight) delays its arrival without holding the channel, so a transfer issued behind it
    starts moving data at once. `before_s[i]` / `after_s[i]`: this rank's compute that
    makes chunk i's rows and that takes its returned rows (a micro-batch's dense layers,
    microbatch.py; zero for a plain exchange). A float for any of the last four: the same
    for every chunk."""
    degree = len(comm_s)
    blocks, lats, befores, afters = (
        [float(v)] * degree if isinstance(v, (int, float)) else list(v)
        for v in (blocking_s, latency_s, before_s, after_s)
    )
    if degree < 1 or any(len(v) != degree for v in (compute_s, blocks, lats, befores, afters)):
        raise InputError(
            f"timeline: {degree} transfer times, {len(compute_s)} compute times, {len(blocks)} blocking "
            f"times, {len(lats)} latencies, {len(befores)} before and {len(afters)} after times; "
            "give one of each per chunk (at least one chunk)"
        )
    now, free = 0.0, 0.0  # compute thread clock; time the network channel frees up
    network: list[tuple[float, float]] = []
    compute: list[tuple[float, float]] = []

    def run(seconds: float) -> None:
        nonlocal now
        if seconds > 0:
            compute.append((now, now + seconds))
            now += seconds

    def start(i: int) -> float:
        nonlocal now, free
        now += blocks[i]
        begin = max(now, free)
        latency = min(lats[i], comm_s[i])
        free = begin + comm_s[i] - latency
        network.append((begin, free))
        return free + latency

    def returned(i: int) -> None:
        nonlocal now
        now = max(now, back[i])
        run(afters[i])

    run(befores[0])
    outbound = [start(0)]
    back: list[float] = []
    for i in range(degree):
        if i + 1 < degree:
            run(befores[i + 1])
        now = max(now, outbound[i])
        if i + 1 < degree:
            outbound.append(start(i + 1))
        compute.append((now, now + compute_s[i]))
        now += compute_s[i]
        back.append(start(i))
        if i >= 1:
            returned(i - 1)
    returned(degree - 1)
    return Timeline(tuple(network), tuple(compute), now)
