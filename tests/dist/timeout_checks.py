"""Rank 0 skips a collective; the others must raise CollectiveTimeoutError naming it, not hang:
an all-reduce on a split of the world with a short timeout (every engine), then every other
collective on a split of its own (where one failure breaks every group, Horovod's, each
refuses at once instead), and under torch also on a process group torch made itself
(its own default timeout, 30 minutes) wrapped with a short one."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch
from runner import report, start

from sparta.comm import CommConfig, Communicator, World
from sparta.errors import CollectiveError, CollectiveTimeoutError

# every other collective, each on a group of its own (a timed-out group is broken)
OPS: dict[str, Callable[[Communicator], object]] = {
    "barrier": lambda c: c.barrier(),
    "broadcast": lambda c: c.broadcast(torch.ones(3), src=1),
    "all_gather": lambda c: c.all_gather(torch.ones(2)),
    "all_to_all": lambda c: c.all_to_all(torch.ones(2 * c.size)),
    "reduce_scatter": lambda c: c.reduce_scatter(torch.ones(2 * c.size)),
}


def skipped_by_rank0(world: World, group: Communicator, check: str, op: str = "all_reduce") -> None:
    if world.rank == 0:
        report(0, check, True)
        return
    began = time.monotonic()
    try:
        OPS[op](group) if op in OPS else group.all_reduce(torch.ones(4))
    except CollectiveTimeoutError as exc:
        waited = time.monotonic() - began
        text = str(exc)
        ok = f"rank {world.rank}" in text and op in text and f"group {group.name!r}" in text and waited < 30
        report(world.rank, check, ok, "" if ok else f"message or delay wrong ({waited:.1f} s): {text}")
    except CollectiveError as exc:  # where one failure breaks every group, the first timeout did
        waited, text = time.monotonic() - began, str(exc)
        ok = group.failures_span_world and "is broken" in text and op in text and waited < 1
        report(world.rank, check, ok, "" if ok else f"{type(exc).__name__} ({waited:.1f} s): {text}")
    except Exception as exc:  # a different failure is still a failure to report
        report(world.rank, check, False, f"{type(exc).__name__}: {exc}")
    else:
        report(world.rank, check, False, f"{op} returned without rank 0")


if __name__ == "__main__":
    # Only these groups have the short timeout: start-up under load may well take 3 s.
    world, _ = start()
    world.comm.barrier()
    everyone = [list(range(world.size))]
    group = world.comm.split_groups(everyone, CommConfig(timeout_s=3.0))
    # all made before any times out: a split's rendezvous takes its group's timeout too
    others = {op: world.comm.split_groups(everyone, CommConfig(timeout_s=2.0)) for op in OPS}
    assert group is not None and all(others.values())
    skipped_by_rank0(world, group, "timeout")
    for op, other in others.items():
        skipped_by_rank0(world, other, f"timeout_{op}", op)  # type: ignore[arg-type]
    if world.backend == "torch":
        import torch.distributed as dist

        pg = dist.new_group(list(range(world.size)))  # torch's default timeout
        skipped_by_rank0(world, Communicator.from_process_group(pg, CommConfig(timeout_s=3.0)), "timeout_wrapped")
    if world.rank == 0:
        time.sleep(4 + len(OPS) * 2.5)  # alive while the peers time out, rather than see a dead connection
    sys.stdout.flush()
    # The engine is wedged by design here: skip its shutdown, which would wait for the lost op.
    os._exit(0)
