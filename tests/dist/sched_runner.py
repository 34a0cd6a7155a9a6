"""`finish` for the scheduling workers: runner.finish, but leaving without C++ teardown.

torch 2.13's gloo aborts now and then in its C++ teardown at interpreter exit after
collectives ("terminate called without an active exception", exit code -6), failing a
launch whose checks all passed. Reproduced with plain torch.distributed (tcp:// init, one
async all_gather, exit); os._exit after destroying the process group avoids it. Until
runner.finish does the same, the scheduling workers use this.
"""

from __future__ import annotations

import os
import sys

import sparta


def finish(world: sparta.World, failures: int) -> None:
    world.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failures else 0)
