"""A communicator whose collective failed refuses every later call, on every engine.

Rank 0 stays out of two collectives on groups with a 2 s timeout, so that its peers' fail:
- "dropped": the peers start an all-reduce and drop its handle without wait(); their next
  call waits it, finds it timed out, and raises the broken error naming the dropped op;
- "failed": the peers' all-reduce raises CollectiveTimeoutError; every later call on that
  group raises the broken error at once, naming the failure and the way out.
- "queued": a PriorityQueue's chunk times out inside a later submit; waiting on a task whose
  remaining chunks were never issued raises the broken error, not "submit those first".
Where the engine's failures span the world (`failures_span_world`), the second group is
broken by the first failure already, and must say so at once.

Run by tests/test_comm_dist.py under every launcher.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from runner import report, start

from sparta.comm import CommConfig, Communicator, PriorityQueue, QueueConfig, TaskKey
from sparta.errors import CollectiveError, CollectiveTimeoutError

BROKEN = "is broken and refuses every collective: an earlier collective failed"


def refuses_at_once(comm: Communicator, cause: str) -> str:
    """'' if `comm` refuses a call within a second with the broken error naming `cause`."""
    began = time.monotonic()
    try:
        comm.all_to_all(torch.ones(comm.size, 2))
    except CollectiveError as exc:
        text, waited = str(exc), time.monotonic() - began
        ok = BROKEN in text and cause in text and "Rebuild the world" in text and waited < 1.0
        return "" if ok and comm.broken and cause in comm.broken else f"({waited:.1f} s, broken={comm.broken}): {text}"
    return "all_to_all ran on a broken communicator"


def dropped_case(comm: Communicator) -> str:
    dropped = comm.all_reduce(torch.ones(2), async_op=True, check=False)
    del dropped
    try:
        comm.barrier()
    except CollectiveError as exc:
        text = str(exc)
        if not (BROKEN in text and "dropped without wait()" in text and "all_reduce(sum)" in text):
            return f"wrong message: {text}"
    else:
        return "the barrier ran although the dropped all_reduce never completed"
    return refuses_at_once(comm, "dropped without wait()")


def failed_case(comm: Communicator) -> str:
    if comm.failures_span_world:  # broken by the dropped handle's failure already
        return refuses_at_once(comm, "dropped without wait()")
    try:
        comm.all_reduce(torch.ones(4), check=False)
    except CollectiveTimeoutError:
        pass
    else:
        return "all_reduce returned without rank 0"
    return refuses_at_once(comm, "all_reduce(sum)")


def queued_case(comm: Communicator) -> str:
    # one 8-byte chunk in flight at a time; b, ready after a's first chunk, goes before a's
    # other two, so submitting b waits on a0, which rank 0 never joins
    queue = PriorityQueue(comm, QueueConfig(chunk_bytes=8, chunks_per_ready=1, max_in_flight=1))
    a, b = TaskKey(1, "a"), TaskKey(0, "b")
    if comm.failures_span_world:  # broken by the first case's failure already: no round starts
        try:
            queue.expect([a, b], ready_order=[a, b])
        except CollectiveError as exc:
            ok = "queue's communicator is broken" in str(exc) and "dropped without wait()" in str(exc)
            return "" if ok else f"wrong message: {exc}"
        return "a round started on a broken communicator"
    queue.expect([a, b], ready_order=[a, b])
    first = queue.submit(a, torch.ones(6), check=False)
    try:
        queue.submit(b, torch.ones(2), check=False)
    except CollectiveError:
        pass
    else:
        return "the queue went on without rank 0"
    try:
        first.wait()
    except CollectiveError as exc:
        text = str(exc)
        if not ("queue's communicator is broken" in text and "Rebuild the world" in text):
            return f"wrong message: {text}"
    else:
        return "task a finished although two of its chunks were never issued"
    return refuses_at_once(comm, "Rebuild the world")


if __name__ == "__main__":
    # Only these groups have the short timeout: start-up under load may well take 2 s.
    world, _ = start()
    world.comm.barrier()
    everyone = [list(range(world.size))]
    first = world.comm.split_groups(everyone, CommConfig(timeout_s=2.0))
    second = world.comm.split_groups(everyone, CommConfig(timeout_s=2.0))
    third = world.comm.split_groups(everyone, CommConfig(timeout_s=2.0))
    assert first is not None and second is not None and third is not None
    if world.rank == 0:
        report(0, "dropped handle", True)
        report(0, "failed collective", True)
        report(0, "queued task", True)
        time.sleep(15)  # stay alive so that peers time out rather than see a dead connection
    else:
        cases = (
            ("dropped handle", lambda: dropped_case(first)),
            ("failed collective", lambda: failed_case(second)),
            ("queued task", lambda: queued_case(third)),
        )
        for name, case in cases:
            try:
                error = case()
            except Exception as exc:  # a different failure is still a failure to report
                error = f"{type(exc).__name__}: {exc}"
            report(world.rank, name, not error, error)
    sys.stdout.flush()
    # The engine is wedged by design here: skip its shutdown, which would wait for the lost ops.
    os._exit(0)
