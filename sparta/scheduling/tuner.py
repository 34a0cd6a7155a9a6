"""Online check of the cost model's choice: try its best few plans on real steps, keep the fastest.

A model fitted a minute ago on a shared machine can be wrong by tens of percent: per-chunk
overheads grow when the CPU is contended, and shaped links behave differently under many
small flows than under one large one. So the co-scheduler never trusts it blindly: during
warm-up, each candidate (the model's best plans, plus unpipelined r=1, which it must never
lose to) runs `trials` steps; every rank then adopts the one whose slowest-rank median
time is lowest. The timings are agreed over the communicator, so every rank picks the same
plan, as the pipeline's matched collectives require.

    tuner = OnlineTuner(world.comm, model.ranked(shape)[:2] + [UNPIPELINED])
    for step in steps:
        choice = tuner.current            # Choice(degrees, hierarchical)
        t = run_step(choice); tuner.observe(t)
    tuner.chosen                          # None until every candidate has run its trials
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparta.comm.communicator import Communicator
from sparta.errors import ConfigError
from sparta.scheduling.pipeline import PipelineDegrees


@dataclass(frozen=True)
class Choice:
    """A pipeline configuration: degrees and whether the all-to-all is hierarchical."""

    degrees: PipelineDegrees
    hierarchical: bool


UNPIPELINED = Choice(PipelineDegrees(1, 1), hierarchical=False)


class OnlineTuner:
    """Round-robin over `candidates` (duplicates dropped, order kept) for `trials` steps
    each, then the fastest. observe() is collective over `comm` once the last trial is in."""

    def __init__(self, comm: Communicator, candidates: Sequence[Choice], trials: int = 2) -> None:
        unique = list(dict.fromkeys(candidates))
        if not unique:
            raise ConfigError("OnlineTuner needs at least one candidate Choice")
        if trials < 1:
            raise ConfigError(f"OnlineTuner trials = {trials}; use >= 1")
        self.comm, self.candidates, self.trials = comm, tuple(unique), trials
        self.times: list[list[float]] = [[] for _ in unique]
        self.chosen: Choice | None = None
        self._step = 0

    @property
    def current(self) -> Choice:
        """The configuration the next step should run."""
        if self.chosen is not None:
            return self.chosen
        return self.candidates[self._step % len(self.candidates)]

    def observe(self, seconds: float) -> None:
        """This rank's time of the step just run with `current`."""
        if self.chosen is not None:
            return
        self.times[self._step % len(self.candidates)].append(seconds)
        self._step += 1
        if self._step == self.trials * len(self.candidates):
            medians = torch.tensor([sorted(t)[len(t) // 2] for t in self.times], dtype=torch.float64)
            slowest = torch.stack(self.comm.all_gather(medians)).max(0).values  # type: ignore[arg-type]
            self.chosen = self.candidates[int(torch.argmin(slowest))]
