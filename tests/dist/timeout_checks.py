"""Rank 0 skips a collective; the others must raise CollectiveTimeoutError, not hang.

On the torch engine rank 0 then skips an all-to-all of CPU rows too, which goes through
shared memory (sparta.comm.shm) and must time out the same way."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch
from runner import report, start

from sparta.comm import CommConfig, Communicator
from sparta.comm.shm import close_all
from sparta.errors import CollectiveTimeoutError

if __name__ == "__main__":
    # Only this group has the short timeout: start-up under load may well take 3 s.
    world, _ = start()
    world.comm.barrier()
    everyone = [list(range(world.size))]
    group = world.comm.split_groups(everyone, CommConfig(timeout_s=3.0))
    assert group is not None
    cases: list[tuple[str, str, Communicator, Callable[[], object]]] = [
        ("timeout", "all_reduce", group, lambda: group.all_reduce(torch.ones(4)))
    ]
    if world.backend == "torch":
        rows = world.comm.split_groups(everyone, CommConfig(timeout_s=3.0, shared_memory="on"))
        assert rows is not None
        rows.all_to_all(torch.ones(world.size, 2), check=False)  # sets up its shared memory
        assert rows.shared_memory is not None
        cases.append(("timeout all_to_all", "all_to_all", rows, lambda: rows.all_to_all(torch.ones(world.size, 2))))
    if world.rank == 0:
        for name, *_ in cases:
            report(0, name, True)
        time.sleep(4 * len(cases))  # stay alive so peers time out rather than see a dead connection
    for name, op, comm, call in cases if world.rank != 0 else []:
        began = time.monotonic()
        try:
            call()
        except CollectiveTimeoutError as exc:
            waited = time.monotonic() - began
            text = str(exc)
            ok = f"rank {world.rank}" in text and op in text and f"group {comm.name!r}" in text and waited < 30
            report(world.rank, name, ok, "" if ok else f"message or delay wrong ({waited:.1f} s): {text}")
        except Exception as exc:  # a different failure is still a failure to report
            report(world.rank, name, False, f"{type(exc).__name__}: {exc}")
        else:
            report(world.rank, name, False, f"{op} returned without rank 0")
    sys.stdout.flush()
    # The engine is wedged by design here: skip its shutdown, which would wait for the lost op.
    close_all()
    os._exit(0)
