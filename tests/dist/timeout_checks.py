"""Rank 0 skips a collective; the others must raise CollectiveTimeoutError, not hang: on a
split of the world with a short timeout (every engine), and under torch also on a process
group torch made itself (its own default timeout, 30 minutes) wrapped with a short one."""

from __future__ import annotations

import os
import sys
import time

import torch
from runner import report, start

from sparta.comm import CommConfig, Communicator, World
from sparta.errors import CollectiveTimeoutError


def skipped_by_rank0(world: World, group: Communicator, check: str) -> None:
    if world.rank == 0:
        report(0, check, True)
        time.sleep(4)  # stay alive so peers time out rather than see a dead connection
        return
    began = time.monotonic()
    try:
        group.all_reduce(torch.ones(4))
    except CollectiveTimeoutError as exc:
        waited = time.monotonic() - began
        text = str(exc)
        ok = f"rank {world.rank}" in text and "all_reduce" in text and f"group {group.name!r}" in text and waited < 30
        report(world.rank, check, ok, "" if ok else f"message or delay wrong ({waited:.1f} s): {text}")
    except Exception as exc:  # a different failure is still a failure to report
        report(world.rank, check, False, f"{type(exc).__name__}: {exc}")
    else:
        report(world.rank, check, False, "all_reduce returned without rank 0")


if __name__ == "__main__":
    # Only these groups have the short timeout: start-up under load may well take 3 s.
    world, _ = start()
    world.comm.barrier()
    group = world.comm.split_groups([list(range(world.size))], CommConfig(timeout_s=3.0))
    assert group is not None
    skipped_by_rank0(world, group, "timeout")
    if world.backend == "torch":
        import torch.distributed as dist

        pg = dist.new_group(list(range(world.size)))  # torch's default timeout
        skipped_by_rank0(world, Communicator.from_process_group(pg, CommConfig(timeout_s=3.0)), "timeout_wrapped")
    sys.stdout.flush()
    # The engine is wedged by design here: skip its shutdown, which would wait for the lost op.
    os._exit(0)
