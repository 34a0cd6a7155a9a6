"""Checkpoints of sharded embeddings that reload under any world size and sharding.

A SparseEmbedding's ``state_dict()`` is local (its shard, keyed by the part of the table it
holds), so any rank may call it alone. ``full_state_dict`` is the collective form: the whole
table under ``weight``, to save from one rank and reload on any number of ranks.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from sparta.embedding.layer import SparseEmbedding


def full_state_dict(model: nn.Module, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """``state`` (default ``model.state_dict()``) with every sharded table's shard replaced by
    the whole table, under ``<path>.weight``.

    Collective: every rank of every SparseEmbedding's communicator must call it (one
    all-gather per sharded table, in module order). Returns the same tables on every rank,
    so save it from one rank only: ``state = full_state_dict(model); if rank == 0:
    torch.save(state, path)``. ``state`` lets other collective forms be combined, e.g.
    ``full_state_dict(model, sparta.moe.full_state_dict(model))`` for a model with both.
    """
    state = dict(model.state_dict() if state is None else state)
    for path, module in model.named_modules():
        if isinstance(module, SparseEmbedding) and module.comm is not None:
            prefix = f"{path}." if path else ""
            state.pop(prefix + module.shard_key(), None)
            state[prefix + "weight"] = module.full_weight()
    return state
