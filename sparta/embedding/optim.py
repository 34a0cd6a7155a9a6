"""One torch optimizer over several: the sharded embeddings' and the dense parameters'.

Horovod's DistributedOptimizer all-reduces the gradient of every parameter it holds, so the
sharded tables (whose gradients reach their owners by all-to-all) need an optimizer of
their own; and under the PriorityQueue the shards step as soon as their rows arrive, before
the dense gradients are waited for (or, deferred, while the next forward runs: see
deferred.py). This class keeps the training loop's single `opt.step()`, and is a
`torch.optim.Optimizer` so LR schedulers and hooks accept it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sparta.embedding.deferred import DeferredDenseStep


class HybridOptimizer(torch.optim.Optimizer):
    """`step`, `zero_grad`, `state_dict`, `load_state_dict` over named parts.

    parts: named optimizers, e.g. {"sparse": Adam(shards), "dense": hvd.DistributedOptimizer(...)};
    steps run in insertion order. `param_groups` is every part's groups (the same dicts, so
    a learning-rate change made through it, e.g. by an LR scheduler, reaches the part).
    before_step: per part name, a function run just before that part steps (waiting for
    its queued gradients).
    deferred: steps its optimizer (one of `parts`) lazily instead of in `step()`; `flush()`,
    `state_dict()` and `load_state_dict()` first complete what it holds back.
    """

    def __init__(
        self,
        parts: dict[str, torch.optim.Optimizer],
        before_step: dict[str, Callable[[], None]] | None = None,
        deferred: DeferredDenseStep | None = None,
    ) -> None:
        self.parts = parts
        self.before_step = before_step or {}
        self.deferred = deferred
        # the parts' own group dicts: add_param_group keeps the objects it is given
        super().__init__([g for opt in parts.values() for g in opt.param_groups], {})

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for name, opt in self.parts.items():
            if name in self.before_step:
                self.before_step[name]()
            if self.deferred is not None and opt is self.deferred.optimizer:
                self.deferred.defer()
            else:
                opt.step()
        return loss

    def flush(self) -> None:
        """Complete a deferred step now (before reading the dense weights outside a forward)."""
        if self.deferred is not None:
            self.deferred.flush()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:  # over every part's groups: Horovod's optimizer takes no set_to_none
            super().zero_grad(set_to_none=False)
            return
        for opt in self.parts.values():
            opt.zero_grad()

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        self.flush()
        return {name: opt.state_dict() for name, opt in self.parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # type: ignore[override]
        self.flush()
        for name, opt in self.parts.items():
            opt.load_state_dict(state[name])
