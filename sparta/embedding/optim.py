"""One optimizer object over two: the sharded embeddings' and the dense parameters'.

Horovod's DistributedOptimizer all-reduces the gradient of every parameter it holds, so the
sharded tables (whose gradients already reached their owners by all-to-all) need an
optimizer of their own; this class lets the training loop keep its single `opt.step()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class HybridOptimizer:
    """`step`, `zero_grad`, `state_dict`, `load_state_dict` and `param_groups` over parts.

    parts: named optimizers, e.g. {"sparse": Adam(shards), "dense": hvd.DistributedOptimizer(...)};
    steps run in insertion order. `param_groups` lists every part's groups (the same dicts,
    so a learning-rate change made through it reaches the part). `before_step` runs first
    (e.g. waiting for queued gradient all-reduces).
    """

    def __init__(self, parts: dict[str, torch.optim.Optimizer], before_step: Callable[[], None] | None = None) -> None:
        self.parts = parts
        self.before_step = before_step

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.parts.values() for group in opt.param_groups]

    def step(self) -> None:
        if self.before_step is not None:
            self.before_step()
        for opt in self.parts.values():
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.parts.values():
            opt.zero_grad()  # Horovod's optimizer takes no set_to_none

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, opt in self.parts.items():
            opt.load_state_dict(state[name])
