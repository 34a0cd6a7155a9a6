"""Dense gradients all-reduced through sparta.comm's PriorityQueue: data parallelism that
needs neither DDP nor Horovod, so hybrid training runs on every engine (MPI included).

Each dense parameter is one task, keyed by its position in the model (the order the next
forward needs it), and its gradient is submitted the moment autograd has accumulated it.
The queue issues the tasks in key order, in chunks, identically on every rank; the
optimizer step waits for them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sparta.comm import Communicator, Handle
from sparta.comm.priority import PriorityQueue, QueueConfig, TaskKey
from sparta.errors import InputError


class QueuedGradients:
    """Average `params`' gradients over `comm` through a PriorityQueue.

    The round starts at each forward of `model` with gradients enabled; `synchronize()`
    (HybridOptimizer calls it before stepping) waits and writes the averages into `.grad`.
    Every listed parameter must receive a gradient every step, as under DDP's default.
    """

    def __init__(
        self,
        model: nn.Module,
        params: list[tuple[str, nn.Parameter]],
        comm: Communicator,
        config: QueueConfig | None = None,
    ) -> None:
        self.queue = PriorityQueue(comm, config)
        self.keys = {p: TaskKey(i, name) for i, (name, p) in enumerate(params) if p.requires_grad}
        self.handles: dict[nn.Parameter, Handle[torch.Tensor]] = {}
        model.register_forward_pre_hook(self._start_round)
        for p in self.keys:
            p.register_post_accumulate_grad_hook(self._submit)

    def _start_round(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self.queue.expect(self.keys.values())
            self.handles = {}

    def _submit(self, p: torch.Tensor) -> None:
        self.handles[p] = self.queue.submit(self.keys[p], p.grad, reduce="avg")  # type: ignore[index]

    def synchronize(self) -> None:
        missing = [k.name for p, k in self.keys.items() if p not in self.handles]
        if missing:
            raise InputError(
                f"QueuedGradients: no gradient reached {missing} this step; every dense parameter must be "
                "used in the loss (or frozen with requires_grad=False before parallelize)"
            )
        with torch.no_grad():
            for p, handle in self.handles.items():
                p.grad.copy_(handle.wait())  # type: ignore[union-attr]
        self.handles = {}
