"""Online check of the cost model's choice: try its best few plans on real steps, keep the fastest.

A model fitted a minute ago on a shared machine can be wrong by tens of percent: per-chunk
overheads grow when the CPU is contended, and shaped links behave differently under many
small flows than under one large one. So the co-scheduler never trusts it blindly: during
warm-up, each candidate (the model's best plans, plus unpipelined r=1, which it must never
lose to) runs `trials` steps; every rank then adopts the one whose slowest-rank median
time is lowest (the baseline unless another clearly beats it). The timings are agreed over
the communicator, so every rank picks the same plan, as the pipeline's matched collectives
require; they also calibrate the cost model (cost_model.Calibration).

    tuner = OnlineTuner(world.comm, [*plan.ranked(2), UNPIPELINED], baseline=UNPIPELINED, margin=0.03)
    for step in steps:
        choice = tuner.current            # Choice(degrees, hierarchical)
        t = run_step(choice); tuner.observe(t)
    tuner.chosen                          # None until every candidate has run its trials
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from sparta.comm.communicator import Communicator
from sparta.errors import ConfigError
from sparta.scheduling.chunks import PipelineDegrees


@dataclass(frozen=True)
class Choice:
    """A pipeline configuration: degrees and whether the all-to-all is hierarchical; with
    `microbatches` > 1 the whole block is cut into that many micro-batches whose dense layers
    overlap each other's exchange (microbatch.overlapped_block), each exchanged whole
    (degrees 1)."""

    degrees: PipelineDegrees
    hierarchical: bool
    microbatches: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ConfigError(f"Choice.microbatches = {self.microbatches!r}; use an int >= 1 (1: no micro-batches)")
        if self.microbatches > 1 and self.degrees != PipelineDegrees(1, 1):
            raise ConfigError(
                f"Choice: {self.microbatches} micro-batches with {self.degrees}; micro-batches are the "
                "pipeline's chunks, so give PipelineDegrees(1, 1)"
            )


UNPIPELINED = Choice(PipelineDegrees(1, 1), hierarchical=False)


C = TypeVar("C", bound=Hashable)


class OnlineTuner(Generic[C]):
    """Round-robin over `candidates` (duplicates dropped, order kept; any hashable: a Choice,
    or a Choice with a gradient-sync mode) for `warmup` untimed rounds (a configuration's
    first steps build buffers, buckets and connections, and would bias the calibration),
    then `trials` timed steps each, then the fastest. With a
    `baseline` (e.g. UNPIPELINED), another candidate wins only if its time is below
    baseline * (1 - margin): a gain within the noise of a shared machine is no gain, and
    the baseline is what the pipeline must never lose to. observe() is collective over
    `comm` once the last trial is in."""

    def __init__(
        self,
        comm: Communicator,
        candidates: Sequence[C],
        trials: int = 2,
        baseline: C | None = None,
        margin: float = 0.0,
        warmup: int = 0,
    ) -> None:
        unique = list(dict.fromkeys(candidates))
        if not unique:
            raise ConfigError("OnlineTuner needs at least one candidate")
        if trials < 1 or warmup < 0:
            raise ConfigError(f"OnlineTuner trials = {trials}, warmup = {warmup}; use >= 1 and >= 0")
        if baseline is not None and baseline not in unique:
            raise ConfigError(f"OnlineTuner baseline {baseline} is not among the candidates {unique}")
        if not 0.0 <= margin < 1.0:
            raise ConfigError(f"OnlineTuner margin = {margin}; use 0 <= margin < 1")
        self.comm, self.candidates, self.trials = comm, tuple(unique), trials
        self.baseline, self.margin, self.warmup = baseline, margin, warmup
        self.times: list[list[float]] = [[] for _ in unique]
        self.chosen: C | None = None
        self.measured: dict[C, float] = {}  # agreed (slowest-rank) median seconds, once chosen
        self._step = 0

    @property
    def current(self) -> C:
        """The configuration the next step should run."""
        if self.chosen is not None:
            return self.chosen
        return self.candidates[self._step % len(self.candidates)]

    def observe(self, seconds: float) -> None:
        """This rank's time of the step just run with `current`."""
        if self.chosen is not None:
            return
        if self._step >= self.warmup * len(self.candidates):
            self.times[self._step % len(self.candidates)].append(seconds)
        self._step += 1
        if self._step == (self.warmup + self.trials) * len(self.candidates):
            # for an even count the mean of the two middle trials: the upper one alone would
            # bias a two-trial median, and the calibration fitted to it, upward
            medians = torch.tensor([statistics.median(t) for t in self.times], dtype=torch.float64)
            slowest = torch.stack(self.comm.all_gather(medians)).max(0).values  # type: ignore[arg-type]
            self.measured = {c: float(t) for c, t in zip(self.candidates, slowest, strict=True)}
            best = self.candidates[int(torch.argmin(slowest))]
            if self.baseline is not None and self.measured[best] >= self.measured[self.baseline] * (1 - self.margin):
                best = self.baseline
            self.chosen = best
