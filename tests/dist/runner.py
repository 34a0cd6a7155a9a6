"""Run named checks on every rank and record one result line per check (see tests/launch.py)."""

from __future__ import annotations

import argparse
import json
import os
import re
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

import sparta
from sparta.comm import CommConfig

RESULTS_DIR = "SPARTA_TEST_RESULTS"  # set by tests/launch.py


def start(timeout_s: float = 90.0, **init_kwargs: object) -> tuple[sparta.World, argparse.Namespace]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="auto")
    args, _ = parser.parse_known_args()
    torch.set_num_threads(1)
    world = sparta.init(backend=args.backend, config=CommConfig(timeout_s=timeout_s), **init_kwargs)
    return world, args


def report(rank: int, check: str, ok: bool, error: str = "", **extra: object) -> None:
    """One result line, in this rank's own file: ranks sharing one stdout interleave lines."""
    line = json.dumps({"rank": rank, "check": check, "ok": ok, "error": error, **extra})
    print(f"rank {rank}: {check} {'ok' if ok else 'FAILED'}", flush=True)
    with open(os.path.join(os.environ[RESULTS_DIR], f"rank-{rank}.jsonl"), "a") as f:
        f.write(line + "\n")


def run_checks(world: sparta.World, checks: list[Callable[[sparta.World], None]]) -> int:
    """Run each check; a failure is reported, not raised, so later checks still run."""
    failures = 0
    for check in checks:
        try:
            check(world)
        except Exception:
            failures += 1
            report(world.rank, check.__name__, False, traceback.format_exc()[-2000:])
        else:
            report(world.rank, check.__name__, True)
    return failures


@contextmanager
def raises(exc: type[BaseException], match: str) -> Iterator[None]:
    try:
        yield
    except exc as e:
        if not re.search(match, str(e)):
            raise AssertionError(f"{exc.__name__} raised but {match!r} not in: {e}") from e
    else:
        raise AssertionError(f"expected {exc.__name__} matching {match!r}; nothing was raised")


def finish(world: sparta.World, failures: int) -> None:
    world.exit(1 if failures else 0)
