"""What torch's zero-bubble split of a backward costs, timed through torch's own schedules.

Zero-bubble schedules (ZBVZeroBubble, InterleavedZeroBubble, DualPipeV) run each backward
as an input pass I, then later a weight pass W. torch computes I with hooks that keep the
gradients W starts from, and W as a second autograd pass from them, so I + W is more than
one backward B: on a trainer `Block` (d_model 128, 4 x 128 tokens, one thread) 1.21 B, the
input pass alone 1.12 times a plain gradient to the input. Priced as I = that plain input
gradient and W = B - I, every zero-bubble plan of the planner's benchmark came out 15-27 %
short.

`zero_bubble_factor` measures (I + W) / B for a part with public API only: two copies of
the part as the two stages of a V on one rank, stepped by `ScheduleZBVZeroBubble` (F, I, W)
and by `ScheduleInterleaved1F1B` (F, B) over the same micro-batches; the step times differ
by 2m (I + W - B). The simulator scales a part's I and W by it alike (torch's split is not
timed apart by any public call).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

from sparta.comm.communicator import Communicator
from sparta.scheduling.profiler import Profiler

MICROBATCHES = 4
# a factor past this is noise (the difference of two step times), not torch's split
MOST = 2.0


def zero_bubble_factor(
    profiler: Profiler,
    module: nn.Module,
    make: Callable[[int], torch.Tensor],
    tokens: int,
    backward_s: float,
    alone: dist.ProcessGroup,
    active: int,
) -> float:
    """(I + W) / B of ``module`` ([..., d] -> same shape) at ``tokens`` per micro-batch, on the
    first ``active`` ranks (the others idle; every rank of ``profiler.comm`` calls it):
    ``make(n)`` builds an input of n tokens, ``backward_s`` is the part's plain backward at
    ``tokens`` (its measured fit), ``alone`` a process group of this rank only, which the
    stages live on. At least 1."""
    if profiler.comm.rank >= active:
        zbv, plain = profiler.time(idle), profiler.time(idle)
    else:
        x = make(MICROBATCHES * tokens).detach()
        target = torch.zeros(MICROBATCHES, device=x.device)
        zbv = profiler.time(_step(ScheduleZBVZeroBubble, module, x, target, alone))
        plain = profiler.time(_step(ScheduleInterleaved1F1B, module, x, target, alone))
    extra = (zbv - plain) / (2 * MICROBATCHES)
    every = profiler.comm.all_gather(torch.tensor([extra], dtype=torch.float64))
    extra = float(torch.cat(every)[:active].mean())  # type: ignore[arg-type]
    return min(max(1.0 + extra / max(backward_s, 1e-12), 1.0), MOST)


def alone_group(comm: Communicator) -> dist.ProcessGroup:
    """A process group of this rank alone (collective: every rank creates every one)."""
    mine = None
    for rank in comm.ranks:
        group = dist.new_group([rank])
        mine = group if rank == comm.ranks[comm.rank] else mine
    assert mine is not None
    return mine


def _step(
    schedule: type[ScheduleZBVZeroBubble] | type[ScheduleInterleaved1F1B],
    module: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor,
    alone: dist.ProcessGroup,
) -> Callable[[], None]:
    """One optimizer step's pipeline of ``schedule`` over two copies of ``module``, both
    stages on this rank (a V of one rank)."""
    stages = [PipelineStage(copy.deepcopy(module), i, 2, x.device, group=alone) for i in range(2)]
    runner = schedule(stages, MICROBATCHES, loss_fn=_loss)  # type: ignore[arg-type]
    return lambda: runner.step(x, target=target)


def _loss(y: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return y.float().pow(2).mean()


def idle() -> None:
    """Nothing: what a rank times while others time a part (`Profiler.time` is collective)."""
