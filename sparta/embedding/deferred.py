"""The deferred dense step of data_parallel="sparta" (`parallelize(..., defer_dense_step=True)`).

`opt.step()` steps the embedding shards as soon as their rows arrive and returns at once;
each dense parameter is waited for and stepped just before the next forward needs it, so
that forward's embedding lookups (and their all-to-alls) run while the last step's dense
all-reduces are still in flight. Waiting issues no collective, so every rank's collective
order is unchanged.

Where a parameter steps: modules whose subtree holds a SparseEmbedding (the "spine": the
model and the containers of its tables) run before the lookups, so in a training forward
their pre-hooks step only their own direct parameters. Every other module's pre-hook steps
its whole subtree (a module may use its children's weights directly, as
nn.MultiheadAttention does its out_proj's), so the first dense module a forward calls is up
to date whatever it touches. A spine module called without gradients or in eval mode steps
its whole subtree (evaluation is not what the overlap is for). Whatever no forward reached
steps at the next `opt.step()`, `opt.state_dict()`, `opt.flush()` or `state_dict()` of a
module of the model.

Numerics are the non-deferred ones exactly: each parameter steps with the same reduced
gradient, under the hyperparameters its group had at `opt.step()` (an LR scheduler stepping
in between changes the next step, not this one), alone (so the optimizer must update each
parameter from its own gradient and state: every torch.optim optimizer but LBFGS).
From `opt.step()` on, a deferred parameter's `.grad` is a copy of this rank's own gradient
(the engine may still be sending from the original, so the dense gradients take twice their
memory between step and forward), and it stays that, or whatever zero_grad makes of it: the
reduced gradient is handed to the optimizer for its step only. So code that reads `.grad`
after `opt.step()` (a gradient-norm log) sees this rank's values, not the average; training
is unchanged, since averaging is linear: a backward that accumulates into `.grad` without
zero_grad all-reduces to the same sum as it would onto the average (rounded differently). (Writing the average
back would need to know whether zero_grad(set_to_none=False) zeroed the copy in between,
which only torch's private version counter tells.)

Not covered: code that reads dense weights between `opt.step()` and the next forward (a
weight EMA, a norm log) sees the previous step's values unless it calls `opt.flush()`
first; and a spine module that uses a dense module's weight without calling that module
(`F.linear(h, self.head.weight)`) would compute with the old weight: its backward raises.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sparta.comm import Handle
from sparta.embedding.layer import SparseEmbedding
from sparta.embedding.queued import QueuedGradients


class DeferredDenseStep:
    """Steps `optimizer` (over `model`'s dense parameters) lazily, see the module docstring.

    `defer()` replaces `optimizer.step()`: it takes this round's dense all-reduces from
    `queued` and returns. `pending` maps each parameter still to step to its all-reduce.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, queued: QueuedGradients) -> None:
        self.optimizer, self.queued = optimizer, queued
        self.pending: dict[nn.Parameter, Handle[torch.Tensor]] = {}
        queued.unstepped = self.pending
        self._hyper: list[dict[str, Any]] = []
        spine = {m for m in model.modules() if any(isinstance(s, SparseEmbedding) for s in m.modules())}
        for module in model.modules():
            own = tuple(module.parameters(recurse=False))
            everything = tuple(module.parameters())
            if module in spine:
                module.register_forward_pre_hook(
                    lambda m, args, own=own, everything=everything: self._step(
                        own if torch.is_grad_enabled() and m.training else everything
                    )
                )
            elif everything:
                module.register_forward_pre_hook(lambda m, args, everything=everything: self._step(everything))
            module.register_state_dict_pre_hook(lambda *args: self.flush())

    def defer(self) -> None:
        """Hold back this round's dense step (or step now if no all-reduce is new since the last)."""
        self.flush()
        handles = self.queued.take_dense()
        if not handles:  # a second step() with no backward between steps on the gradients as they are
            self.optimizer.step()
            return
        # hyperparameters as they are now: a scheduler may change them before the step runs
        self._hyper = [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
            for g in self.optimizer.param_groups
        ]
        for p, handle in handles.items():
            # the engine may still be sending from the old `.grad` (MPI, Horovod): what runs
            # before the step (zero_grad(set_to_none=False)) writes into a copy instead
            p.grad = p.grad.clone() if p.grad is not None else None
            self.pending[p] = handle

    def flush(self) -> None:
        """Step every parameter still held back."""
        self._step(tuple(self.pending))

    @torch.no_grad()
    def _step(self, params: tuple[nn.Parameter, ...]) -> None:
        if not self.pending:  # every module's pre-hook lands here: most forwards find nothing held back
            return
        todo = {p: self.pending.pop(p) for p in params if p in self.pending}
        if not todo:
            return
        groups = self.optimizer.param_groups
        others = {p: p.grad for g in groups for p in g["params"] if p not in todo}
        restore: dict[nn.Parameter, torch.Tensor | None] = {}
        for p, handle in todo.items():  # step on the reduced gradient, then put `.grad` back
            restore[p] = p.grad
            p.grad = handle.wait()
        now = [{k: g[k] for k in hyper} for g, hyper in zip(groups, self._hyper, strict=True)]
        try:
            for p in others:  # torch optimizers skip parameters without a gradient
                p.grad = None
            for g, hyper in zip(groups, self._hyper, strict=True):
                g.update(hyper)
            self.optimizer.step()
        finally:
            for g, current in zip(groups, now, strict=True):
                g.update(current)
            for p, grad in [*others.items(), *restore.items()]:
                p.grad = grad
