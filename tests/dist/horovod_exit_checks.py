"""Ranks leave a Horovod world at different times: ranks 2-3 finish and exit while ranks 0-1
still have an all-gather to make over their own process set. Run by tests/test_horovod_exit.py."""

from __future__ import annotations

import time

import torch
from runner import finish, run_checks, start

from sparta import World

LATE_S = 2.0  # how long ranks 0-1 stay behind: ranks 2-3 are in world.exit() by then


def check_a_late_group_collective_outlives_early_exits(world: World) -> None:
    """hvd.shutdown() on one rank ends every rank's background loop; world.exit() must wait
    for the peers, or ranks 0-1's all-gather fails with 'Horovod has been shut down'."""
    pair = world.comm.split_groups([[0, 1], [2, 3]])
    assert pair is not None
    if world.rank < 2:
        time.sleep(LATE_S)
        got = pair.all_gather(torch.tensor([world.rank]))
        assert isinstance(got, list) and [int(t) for t in got] == [0, 1], got


CHECKS = [check_a_late_group_collective_outlives_early_exits]

if __name__ == "__main__":
    world, _ = start()
    finish(world, run_checks(world, CHECKS))
