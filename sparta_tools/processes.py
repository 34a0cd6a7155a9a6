"""A launch (torchrun, mpirun, horovodrun) run to completion or stopped whole.

torchrun starts each rank in a session of its own, so killing the launcher's process group
leaves the ranks running, holding the output pipe open: the caller then waits on them, and
they on one another's collectives. `run_bounded` stops the whole tree instead, on a timeout
and on Ctrl-C alike: SIGTERM to every descendant and the launcher's group (torchrun passes
it to its ranks), then SIGKILL to what is left after a grace period. Linux (/proc).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

GRACE_S = 5.0  # from SIGTERM to SIGKILL


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first), read from /proc."""
    parent_of: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # the command name may hold spaces and parentheses: the ppid follows its last ")"
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parent_of[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parent_of.items() if p in frontier]
        found += children
        frontier = children
    return found


def _signal_all(pids: Sequence[int], group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop(proc: subprocess.Popen[str], grace_s: float = GRACE_S) -> None:
    """Stop ``proc`` (started with ``start_new_session=True``) and everything it started."""
    tree = descendants(proc.pid)
    _signal_all(tree, proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_all(tree + descendants(proc.pid), proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)


def run_bounded(
    cmd: Sequence[str], env: Mapping[str, str], timeout_s: float, echo: TextIO | None = None
) -> tuple[int, str, bool]:
    """Run ``cmd`` with stdout and stderr together; (exit status, output, whether it ran past
    ``timeout_s`` and was stopped). ``echo``: also write each line there as it comes (a
    launch's progress, live); a failing echo (a closed pipe) stops the echo, not the reading.
    Ctrl-C stops the launch whole before it propagates."""
    deadline = time.monotonic() + timeout_s
    proc = subprocess.Popen(
        list(cmd),
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",  # a rank's stray bytes must not stop the reading (and then the rank, on a full pipe)
        start_new_session=True,
    )
    assert proc.stdout is not None
    stdout, lines = proc.stdout, []
    echoing = echo

    def read() -> None:
        nonlocal echoing
        for line in stdout:
            lines.append(line)
            if echoing is not None:
                try:
                    echoing.write(line)
                    echoing.flush()
                except (OSError, ValueError):
                    echoing = None

    reader = threading.Thread(target=read, name="run_bounded output", daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        stop(proc)
    except BaseException:
        stop(proc)
        raise
    finally:
        # to the end of the output, as long as the time allows: a grandchild out of reach may
        # hold the pipe open past the launcher's exit
        reader.join(timeout=max(GRACE_S, deadline - time.monotonic()))
        echoing = None
        if not reader.is_alive():
            stdout.close()
    return (124 if timed_out else proc.returncode), "".join(lines), timed_out
