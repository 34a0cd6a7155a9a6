"""The ranks a checkpoint is saved or loaded by, and how they agree on a failure.

Every failure on any rank becomes one `CheckpointError` on every rank: each rank reports
what went wrong on it (or None), all gather the reports, and all raise if any is set, so no
rank is left waiting in a collective the others skipped.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from sparta.comm.launch import detect
from sparta.errors import SpartaError


class CheckpointError(SpartaError, RuntimeError):
    """A checkpoint could not be written or read; raised on every rank alike."""


class CheckpointGroup:
    """The ranks that save or load together: ``pg`` (None: the default group) when
    torch.distributed is initialised, else this one process. Its collectives (`gather`,
    `broadcast`, `agree`) become local calls in one process."""

    def __init__(self, pg: dist.ProcessGroup | None) -> None:
        self.pg = pg
        self.on = dist.is_available() and dist.is_initialized()
        launched = detect().size
        if not self.on and (pg is not None or launched > 1):
            # every rank would take itself for the only one and write the same files
            raise CheckpointError(
                f"this process is one of {launched} launched ranks but torch.distributed is not initialised: "
                "build the layout first (sparta.parallel.build_layout starts it), or "
                "torch.distributed.init_process_group"
            )
        self.rank = dist.get_rank(pg) if self.on else 0
        self.size = dist.get_world_size(pg) if self.on else 1

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        if not self.on:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.on:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.pg, group_src=0)
        return box[0]

    def agree(self, problem: str | None, what: str) -> None:
        """Raise CheckpointError on every rank if any rank has a problem (a collective)."""
        problems = [f"rank {r}: {p}" for r, p in enumerate(self.gather(problem)) if p is not None]
        if problems:
            raise CheckpointError(f"{what} failed: " + "; ".join(problems))

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Silence DCP's warning that it runs in one process, when that is what was meant."""
        with warnings.catch_warnings():
            if not self.on:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
