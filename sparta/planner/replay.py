"""Replaying a plan's schedule on its stages' costs: every pipeline rank's actions in
torch's order, each waiting for its inputs (the hop from the stage before, or after,
queued on a link between nodes), the time each compute and collective takes, the
activations in flight (the part of the simulator that runs the clock; `simulate.py` prices
the stages and the step around it).

Ranks that oversubscribe a host (8 ranks on 2 CPU cores) share its speed: the replay is a
processor-sharing one, each busy pipeline rank (with its dp x tp replicas) running at
``slots`` / (busy ranks on the host) of its speed-one time while more are busy than the host
has slots, so a pipeline's bubble leaves the others faster. The collectives inside an action
are not shared: they were measured with every rank at them at once; nor is what a part timed
under its group (a tp half, an ep MoE layer) spent waiting in its own collectives
(``PartCost.busy``). On one node those collectives run on the host's cores too (gloo over
loopback: the kernel's copies were 21 % of the machine's time in a traced 8-rank pp2 dp4 ep4
step on 2 cores, 50 ms of each rank's 234 ms of CPU a step), so a pipeline rank inside one
counts among the busy ones that the others share the host with (``waits_compete``); across
nodes a collective waits on the link, and the cores are the others'. With a device per rank
(GPUs) nothing is shared and the replay is exact event timing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from sparta.errors import ConfigError
from sparta.scheduling.trace import Span

from .stage_cost import StageCost

_ACTION = re.compile(r"(\d+)([FBIW])(\d+)")


def replay(
    actions: Mapping[int, Sequence[str]],
    stages: list[StageCost],
    owner: Mapping[int, int],
    hop: Mapping[tuple[int, int], tuple[float, tuple[int, int] | None]],
    zero_bubble: bool,
    unshard: Mapping[int, tuple[float, float]],
    trace: bool,
    share: float,
    waits_compete: bool = False,
) -> tuple[dict[int, list[Span]], dict[int, float], dict[int, float]]:
    """Run every rank's actions in order; returns the spans, each rank's finish time and its
    peak activation bytes. ``unshard``: per stage under fsdp, the seconds its units that
    reshard after forward, and those that do not, take to gather (`simulate`'s module doc).
    ``share``: how many pipeline ranks can compute at full speed at once (their replicas
    share the hosts' compute slots); with more busy, each runs at
    share / busy of its speed (processor sharing), which is what ranks oversubscribing a
    host's cores see. An action computes its speed-one seconds, then waits its collectives'
    seconds, which are not shared: they were measured with every rank of the launch
    running collectives at once, so the contention is in them already (sharing them again
    doubled the tp4 plans' predictions on 8 ranks over 2 cores). ``waits_compete``: a rank
    waiting in its collectives still counts among the busy ones that the computing ranks
    share the host with (one node: loopback collectives take the cores, module docstring)."""
    queues = {
        r: [(int(m[1]), m[2], int(m[3])) for a in acts for m in _ACTION.finditer(a)] for r, acts in actions.items()
    }
    pos = dict.fromkeys(queues, 0)
    free = dict.fromkeys(queues, 0.0)
    live = dict.fromkeys(queues, 0.0)
    peak = dict.fromkeys(queues, 0.0)
    done: dict[tuple[int, str, int], float] = {}
    arrival: dict[tuple[tuple[int, str, int], int], float] = {}  # (output, rank) -> when it reaches that rank
    link_free: dict[tuple[int, int], float] = {}
    spans: dict[int, list[Span]] = {r: [] for r in queues}
    running: dict[int, list[float]] = {}  # rank -> [compute left, collectives left, start]
    n_stages = len(stages)
    sharded = {s: [True, True] for s in unshard}  # [resharding units, the others]
    seconds_of = {
        "F": lambda st: (st.fwd, st.fwd_comm),
        "B": lambda st: (st.bwd, st.bwd_comm),
        "I": lambda st: (st.bwd_input, st.bwd_input_comm),
        "W": lambda st: (max(st.zb_bwd - st.bwd_input, 0.0), st.weight_comm),
    }

    def inputs(stage: int, kind: str, mb: int) -> list[tuple[int, str, int]]:
        if kind == "F":
            return [(stage - 1, "F", mb)] if stage > 0 else []
        if kind == "W":
            return [(stage, "G", mb)]
        # B or I: the stage's own forward and the next stage's input gradient (from its B or I)
        return [(stage, "F", mb)] + ([(stage + 1, "G", mb)] if stage < n_stages - 1 else [])

    def start_time(rank: int) -> float | None:
        """When ``rank``'s next action can start, or None if an input is not yet produced."""
        stage, kind, mb = queues[rank][pos[rank]]
        at = free[rank]
        for key in inputs(stage, kind, mb):
            if key not in done:
                return None
            at = max(at, arrival[key, rank] if owner[key[0]] != rank else done[key])
        return at

    now = 0.0
    # a rank's next start is fixed once its inputs are produced, so it is looked for only where
    # an action's output may have unblocked one: its own rank and the rank it goes to (a scan
    # of every rank at every event was most of a 64-GPU search's time)
    waits: dict[int, float] = {}
    dirty = set(queues)
    while True:
        for rank in dirty:
            if rank not in running and pos[rank] < len(queues[rank]):
                at = start_time(rank)
                if at is not None:
                    waits[rank] = at
        dirty.clear()
        for rank, at in sorted(waits.items()):
            if at > now + 1e-12:
                continue
            del waits[rank]
            stage, kind, mb = queues[rank][pos[rank]]
            st = stages[stage]
            compute, waited = seconds_of[kind](st)
            if stage in sharded and kind != "W":
                state = sharded[stage]
                waited += sum(t for t, gone in zip(unshard[stage], state, strict=True) if gone)
                state[:] = [kind == "F" and not zero_bubble, False]
            running[rank] = [compute, waited, now]
            if kind == "F":
                live[rank] += st.saved
            elif kind in "BI":
                peak[rank] = max(peak[rank], live[rank] + st.transient)
            peak[rank] = max(peak[rank], live[rank])
        if not running and not waits:
            break
        eps = 1e-12 * max(1.0, now)
        computing, least_compute, least_wait = 0, math.inf, math.inf  # one pass: this runs per event
        for left, waiting, _ in running.values():
            if left > eps:
                computing += 1
                if left < least_compute:
                    least_compute = left
            elif waiting < least_wait:
                least_wait = waiting
        busy = len(running) if waits_compete else computing
        rate = min(1.0, share / busy) if computing else 1.0
        step = min(least_compute / rate, least_wait, min(waits.values(), default=math.inf) - now)
        now += step
        for rank in list(running):
            entry = running[rank]
            if entry[0] > eps:
                entry[0] -= step * rate
            else:
                entry[1] -= step
            if entry[0] > eps or entry[1] > eps:
                continue
            del running[rank]
            stage, kind, mb = queues[rank][pos[rank]]
            st = stages[stage]
            output = (stage, "G" if kind in "BI" else kind, mb)
            free[rank] = done[output] = now
            # where the output goes (F: the next stage, B/I: the one before), and when it gets
            # there: sends across a node's link queue on it, one after another
            to = stage + 1 if kind == "F" else stage - 1 if kind in "BI" else -1
            dirty.add(rank)
            if 0 <= to < n_stages and owner[to] != rank:
                dirty.add(owner[to])
                seconds, link = hop[rank, owner[to]]
                begin = now if link is None else max(now, link_free.get(link, 0.0))
                arrival[output, owner[to]] = begin + seconds
                if link is not None:
                    link_free[link] = begin + seconds
            if trace:
                spans[rank].append(Span(f"{stage}{kind}{mb}", "compute", entry[2], now))
            if kind == "B" or (kind == "W" and zero_bubble):
                live[rank] -= st.saved
            pos[rank] += 1
    stuck = {r: "".join(map(str, q[pos[r]])) for r, q in queues.items() if pos[r] < len(q)}
    if stuck:
        raise ConfigError(f"the schedule's actions wait on each other (next actions: {stuck})")
    return spans, free, peak
