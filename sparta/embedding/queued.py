"""Gradients exchanged through sparta.comm's PriorityQueue: data parallelism that needs
neither DDP nor Horovod, so hybrid training runs on every engine (MPI included).

Every trainable parameter is one task, keyed by its position in the model (the order the
next forward needs it: the embeddings first). A dense gradient is an all-reduce submitted
the moment autograd has accumulated it; a SparseEmbedding's rows are an all-to-all
submitted from its backward (`defer_gradients`). The round declares the tasks ready in the
reverse of the model's parameter order (the order backward produces them), so the queue's
agreed schedule issues dense chunks while backward still computes, and the embedding's
exchange overtakes every dense chunk not yet placed. The optimizer waits only at its step:
first for the embeddings' rows (their shards step at once), then for the dense gradients
(or, with a DeferredDenseStep, for each dense module's just before the next forward uses it).
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

import torch
from torch import nn

from sparta.comm import Communicator, Handle
from sparta.comm.priority import PriorityQueue, QueueConfig, TaskKey
from sparta.embedding.layer import SparseEmbedding
from sparta.errors import InputError


class QueuedGradients:
    """Average `model`'s gradients over `comm` through a PriorityQueue.

    The round starts at each forward of `model` with gradients enabled. `finish_tables()`
    puts the embeddings' rows into their shards' `.grad`; `finish_dense()` waits and writes
    the dense averages into `.grad` (HybridOptimizer calls each before stepping its part).
    Every trainable parameter must receive a gradient every step, as under DDP's default.
    """

    def __init__(self, model: nn.Module, comm: Communicator, config: QueueConfig | None = None) -> None:
        self.queue = PriorityQueue(comm, config)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        keys = {p: TaskKey(i, name) for i, (name, p) in enumerate(named)}
        self.tables = [m for m in model.modules() if isinstance(m, SparseEmbedding) and m.weight in keys]
        shards = {m.weight for m in self.tables}
        self.dense = {p: k for p, k in keys.items() if p not in shards}
        self.ready_order = [keys[p] for _, p in reversed(named)]
        self.handles: dict[nn.Parameter, Handle[torch.Tensor]] = {}
        # parameters whose last step a DeferredDenseStep still holds back: a gradient reaching
        # one means a forward used its old value (see deferred.py)
        self.unstepped: Container[nn.Parameter] = ()
        model.register_forward_pre_hook(self._start_round)
        for table in self.tables:
            table.defer_gradients(self.queue, keys[table.weight])
        for p in self.dense:
            p.register_post_accumulate_grad_hook(self._submit)

    def _start_round(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            # a backward earlier in this step (gradient accumulation) keeps its tables' rows;
            # its dense all-reduces are superseded, as `.grad` accumulates locally
            for table in self.tables:
                table.finish_gradients()
            self.queue.expect(self.ready_order, self.ready_order)
            self.handles = {}

    def _submit(self, p: torch.Tensor) -> None:
        if p in self.unstepped:
            raise InputError(
                f"QueuedGradients: {self.dense[p].name} got a gradient from a forward that ran before its deferred "  # type: ignore[index]
                "step: that forward used it without calling the module that owns it (e.g. F.linear(x, "
                "self.head.weight)); call the module, or parallelize without defer_dense_step"
            )
        self.handles[p] = self.queue.submit(self.dense[p], p.grad, reduce="avg")  # type: ignore[index]

    def _check_round(self) -> None:
        missing = self.queue.missing()
        if missing:
            raise InputError(
                f"QueuedGradients: no gradient reached {[k.name for k in missing]} this step; every trainable "
                "parameter must be used in the loss (or frozen with requires_grad=False before parallelize)"
            )

    def finish_tables(self) -> None:
        self._check_round()
        for table in self.tables:
            table.finish_gradients()

    def take_dense(self) -> dict[nn.Parameter, Handle[torch.Tensor]]:
        """This round's dense all-reduces, each handed out once (a second call gets none)."""
        self._check_round()
        handles, self.handles = self.handles, {}
        return handles

    def finish_dense(self) -> None:
        with torch.no_grad():
            for p, handle in self.take_dense().items():
                p.grad.copy_(handle.wait())  # type: ignore[union-attr]
