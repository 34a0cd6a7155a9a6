"""What a checkpoint of the 3D trainer holds, under which layout-free key.

``sparta.parallel.checkpoint.Checkpointer`` writes and reads the checkpoint (atomically, all
ranks agreeing); this module says which tensor of this rank goes under which key, and reads
the model's and the optimizer's state out of and back into the model parts.

Layout-free keys. A checkpoint names every tensor by what it is in the full model, never by
which rank held it, so pp x dp x tp with experts on 8 ranks, 4 ranks and one process (with or
without a process group) all read and write the same checkpoint:

- ``model.<fqn>``: every parameter and persistent buffer under its full-model name
  (``model.layers.3.attn.wq.weight``; stage modules are deep copies of the full model, so a
  stage's names are the full model's). Tensor-parallel and FSDP2 parameters are DTensors,
  which DCP saves as chunks of the global tensor and reshards on load.
- ``model.<path>.experts.<w>.<id>``: one entry per global expert, as GroupedExperts'
  ``state_dict`` already names them; replicas of an expert (ep smaller than dp) save the same
  key, which DCP writes once. Experts whose hidden units are split over tp
  (``GroupedExperts.split_ff``) save their slice as a chunk of the whole expert's tensor.
- ``model.<path>.weight`` of a SparseEmbedding: the whole ``[num_embeddings, dim]`` table as
  one DCP tensor, of which each rank writes (and reads) the rows and columns it holds as a
  chunk at their offset (a ``Piece``); the module's own local ``state_dict`` key
  (``weight.rows<a>-<b>.cols<c>-<d>``) depends on the layout and is not used. A
  VocabParallelHead's row shard is saved the same way, as its whole ``[vocab, d]`` weight, so
  a plain ``nn.Embedding`` / ``nn.Linear`` of one process loads either. So is a head stage's
  `VocabShard` (``ParallelConfig.vocab_stages``). (The chunks go
  through DCP's public planner interface: `checkpoint_planners`.)
- ``optim.<fqn>.<state>``: each optimizer state tensor shaped like its parameter under the
  parameter's key, cut the same way (AdamW's ``exp_avg`` per expert, per embedding chunk, per
  TP shard); other state (AdamW's ``step``) is saved as is under every key of its parameter.
  ``optim.param_groups`` (``PARAM_GROUPS``): rank 0's hyperparameters (lr, betas, ...),
  restored on load as ``Optimizer.load_state_dict`` does.
- ``extra`` and ``rng.<rank>``: added by the Checkpointer (the dict given to ``save``, from
  rank 0; each rank's torch RNG state).

A fresh optimizer has no state to load into: ``materialise_optimizer_state`` first creates it
with one step at zero gradients and a zero learning rate (as torch's own
``set_optimizer_state_dict`` does; the parameters do not move), then DCP fills it in place.

Before anything is loaded, ``compare`` matches every rank's keys and global shapes
(``key_sizes``) against the checkpoint's metadata and names the missing and unexpected keys
and the shapes that differ.

Functions here raise ``StateError`` for a model or optimizer they cannot map to these keys;
the Checkpointer agrees on it across ranks and raises ``StateError`` on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from sparta.embedding.layer import SparseEmbedding
from sparta.embedding.vocab_parallel import VocabParallelHead
from sparta.errors import SpartaError
from sparta.moe.experts import GroupedExperts

from .checkpoint_planners import Piece
from .vocab_stages import VocabShard

__all__ = [
    "PARAM_GROUPS",
    "ScalarRef",
    "Slot",
    "StateError",
    "compare",
    "dcp_state_dict",
    "forget_optimizer_state",
    "key_sizes",
    "materialise_optimizer_state",
    "model_slots",
    "restore_param_groups",
    "restore_scalars",
]

PARAM_GROUPS = "optim.param_groups"  # the key of rank 0's optimizer hyperparameters
_MODEL, _OPTIM = "model.", "optim."
_LISTED = 12  # keys named in an error message, per kind

ScalarRef = tuple[str, dict[str, Any], str]
"""Optimizer state that is not a tensor: (its key, the parameter's state dict, the state's name)."""


class StateError(SpartaError, RuntimeError):
    """The model parts or the optimizer cannot be mapped to layout-free keys (the message says
    why and how to fix it); the Checkpointer reports it as StateError on every rank."""


# ---------------------------------------------------------------------- slots
@dataclass(frozen=True)
class Slot:
    """One checkpoint key and where its tensor lives on this rank: ``tensor`` (a parameter or
    buffer), or its row ``index`` (an expert of a GroupedExperts weight), as a chunk at
    ``offsets`` of a global tensor of shape ``size`` where those are set (a SparseEmbedding
    shard, an expert's slice under expert tensor parallelism)."""

    key: str
    tensor: Tensor
    index: int | None = None
    offsets: tuple[int, ...] | None = None
    size: tuple[int, ...] | None = None

    def view(self, t: Tensor) -> Tensor:
        """The part of ``t`` (shaped like ``tensor``) that this key names."""
        return t[self.index] if self.index is not None else t


def _unwrap(module: nn.Module) -> nn.Module:
    """The module under DDP's wrapper (whose state_dict keys start with ``module.``)."""
    while isinstance(module, DistributedDataParallel):
        module = module.module
    return module


def model_slots(parts: list[nn.Module]) -> list[Slot]:
    """Every layout-free key of this rank's model parts, in a deterministic order.

    The keys are the parts' own ``state_dict`` keys (so persistent buffers and extra state
    come too), except that a SparseEmbedding's local shard key becomes its table's
    ``weight`` chunk and a GroupedExperts' per-expert keys point at rows of its weights.

    parts: this rank's stage modules, bare or wrapped by DDP/FSDP2 (FSDP2 modules are
    resharded, so that their parameters are the sharded DTensors DCP saves). Raises
    StateError for what it cannot name (extra state, a DTensor weight of a layer sharded by
    its own communicator, two different tensors under one key).
    """
    slots: dict[str, Slot] = {}
    for part in parts:
        root = _unwrap(part)
        for module in root.modules():
            if isinstance(module, FSDPModule):  # FSDP2: parameters back to their sharded DTensors
                module.reshard()
        special: dict[str, Slot] = {}
        # every path of a shared module (a table tied to a head is under both), as state_dict does
        for path, module in root.named_modules(remove_duplicate=False):
            prefix = f"{path}." if path else ""
            if isinstance(module, VocabParallelHead) and not hasattr(module, "tied"):
                _refuse_dtensor(module.weight, prefix + "weight")
                layout = module.layout
                size = (layout.num_embeddings, layout.embedding_dim)
                offsets = (layout.row_range(layout.rank)[0], 0)
                special[prefix + "weight"] = Slot(prefix + "weight", module.weight, offsets=offsets, size=size)
            elif isinstance(module, VocabShard):  # a head stage's rows (vocab_stages)
                _refuse_dtensor(module.weight, prefix + "weight")
                size, offsets = (module.vocab_size, module.weight.shape[1]), (module.start, 0)
                special[prefix + "weight"] = Slot(prefix + "weight", module.weight, offsets=offsets, size=size)
            elif isinstance(module, SparseEmbedding):
                _refuse_dtensor(module.weight, prefix + "weight")
                layout = module.layout
                offsets = (layout.row_range(layout.rank)[0], layout.col_range(layout.rank)[0])
                size = (module.num_embeddings, module.embedding_dim)
                own = prefix + module.shard_key()
                special[own] = Slot(prefix + "weight", module.weight, offsets=offsets, size=size)
            elif isinstance(module, GroupedExperts):
                for name, weight in module.named_weights():
                    _refuse_dtensor(weight, prefix + name)
                    offsets, size = module.expert_slice(name) or (None, None)
                    for local in range(module.num_experts):
                        key = f"{prefix}{name}.{module.first_expert + local}"
                        special[key] = Slot(key, weight, index=local, offsets=offsets, size=size)
        for key, value in root.state_dict(keep_vars=True).items():
            if not isinstance(value, Tensor):
                raise StateError(
                    f"{key} is a module's extra state ({type(value).__name__}), which the checkpointer does not "
                    "save; keep such state in the extra dict of save()"
                )
            slot = special.pop(key, None) or Slot(key, value)
            other = slots.get(slot.key)
            if other is not None and other.tensor is not slot.tensor:
                raise StateError(
                    f"two model parts of this rank hold different tensors named {slot.key!r}; stage modules "
                    "must each own the modules they keep (a deep copy with the others' modules deleted)"
                )
            slots[slot.key] = slot
        if special:
            raise StateError(
                f"these keys of the model's sharded layers are not in its state_dict: {sorted(special)[:_LISTED]}; "
                "a module overrides state_dict in a way the checkpointer does not know"
            )
    return list(slots.values())


def _refuse_dtensor(tensor: Tensor, name: str) -> None:
    if isinstance(tensor, DTensor):
        raise StateError(
            f"{name} is a DTensor (e.g. wrapped by FSDP2), but the layer is already sharded by its own "
            "communicator: leave its sharded weights out of fully_shard"
        )


def dcp_state_dict(
    slots: list[Slot], optimizers: list[torch.optim.Optimizer], rank: int, with_groups: bool = True
) -> tuple[dict[str, Any], dict[str, Piece], list[ScalarRef]]:
    """(DCP state dict, chunks of global tensors, optimizer state that is not a tensor) of
    the model and the optimizers.

    The state dict's tensors share storage with the parameters and optimizer state, so a
    DCP load writes straight into them; the last list says where to put back the values
    that DCP loads by replacing them in the dict: (key, the parameter's state, name).
    slots: ``model_slots`` of the parts the optimizers step. rank: this rank in the saving
    group; rank 0 adds ``PARAM_GROUPS`` when ``with_groups``. Raises StateError when an
    optimizer steps a parameter that no slot holds.
    """
    state: dict[str, Any] = {}
    pieces: dict[str, Piece] = {}
    scalars: list[ScalarRef] = []

    def put(key: str, slot: Slot, value: Any, like_param: bool) -> None:
        if isinstance(value, Tensor) and like_param:
            if slot.offsets is not None:
                assert slot.size is not None
                pieces[key] = Piece(slot.view(value.detach()), slot.offsets, slot.size)
            else:
                state[key] = slot.view(value.detach())
        else:
            state[key] = value.detach() if isinstance(value, Tensor) else value

    by_param: dict[int, list[Slot]] = {}
    for slot in slots:
        put(_MODEL + slot.key, slot, slot.tensor, True)
        if isinstance(slot.tensor, nn.Parameter):
            by_param.setdefault(id(slot.tensor), []).append(slot)
    for opt in optimizers:
        for group in opt.param_groups:
            for param in group["params"]:
                if id(param) not in by_param:
                    raise StateError(
                        f"the optimizer holds a parameter of shape {tuple(param.shape)} that none of model_parts "
                        "has; pass every module whose parameters the optimizer steps"
                    )
                entries = opt.state.get(param, {})
                for name, value in entries.items():
                    shaped = isinstance(value, Tensor) and value.shape == param.shape and value.dim() > 0
                    for slot in by_param[id(param)]:
                        put(f"{_OPTIM}{slot.key}.{name}", slot, value, shaped)
                        if not isinstance(value, Tensor):
                            scalars.append((f"{_OPTIM}{slot.key}.{name}", entries, name))
    if with_groups and optimizers and rank == 0:
        state[PARAM_GROUPS] = [[_hyper(g) for g in opt.param_groups] for opt in optimizers]
    return state, pieces, scalars


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


# ------------------------------------------------------------- optimizer state
def materialise_optimizer_state(
    optimizers: list[torch.optim.Optimizer],
) -> list[tuple[torch.optim.Optimizer, Tensor]]:
    """Create the optimizer state a fresh optimizer lacks (for DCP to load into) by one step
    with zero gradients and a zero learning rate, as torch's own state_dict helpers do; the
    parameters do not change. Returns the (optimizer, parameter) pairs it created state for."""
    created: list[tuple[torch.optim.Optimizer, Tensor]] = []
    for opt in optimizers:
        params = [p for g in opt.param_groups for p in g["params"]]
        fresh = [p for p in params if p.requires_grad and not opt.state.get(p)]
        if not fresh:
            continue
        saved_grads = {id(p): p.grad for p in params}
        saved_lrs = [g.get("lr") for g in opt.param_groups]
        try:
            for p in params:
                p.grad = None
            for p in fresh:
                grad = torch.zeros_like(p)
                p.grad = grad.to_sparse() if isinstance(opt, torch.optim.SparseAdam) else grad
            for g in opt.param_groups:
                if "lr" in g:
                    g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], Tensor) else 0.0
            opt.step()
        finally:
            for g, lr in zip(opt.param_groups, saved_lrs, strict=True):
                if lr is not None:
                    g["lr"] = lr
            for p in params:
                p.grad = saved_grads[id(p)]
        created.extend((opt, p) for p in fresh if opt.state.get(p))
    return created


def never_stepped(
    created: list[tuple[torch.optim.Optimizer, Tensor]], slots: list[Slot], held: Any
) -> list[tuple[torch.optim.Optimizer, Tensor]]:
    """Of the (optimizer, parameter) pairs ``materialise_optimizer_state`` just created, those
    whose state the checkpoint (``held``: its keys) lacks altogether: the parameter had not
    been stepped when it was saved (no gradient yet), so after the load it has no state
    either, as in the run that saved it. None when no optimizer was saved with it (its
    ``PARAM_GROUPS`` absent): loading an optimizer from it is a mistake to name."""
    if PARAM_GROUPS not in held:
        return []
    out = []
    for opt, param in created:
        mine = [slot.key for slot in slots if slot.tensor is param]
        keys = [f"{_OPTIM}{key}.{name}" for key in mine for name in opt.state[param]]
        # the parameter itself in the checkpoint: else it is another model's, named as such
        saved = bool(mine) and all(f"{_MODEL}{key}" in held for key in mine)
        if saved and keys and not any(key in held for key in keys):
            out.append((opt, param))
    return out


def forget_optimizer_state(created: list[tuple[torch.optim.Optimizer, Tensor]]) -> None:
    """Drop the state ``materialise_optimizer_state`` made, when the load does not happen."""
    for opt, param in created:
        opt.state.pop(param, None)


def restore_scalars(state: dict[str, Any], scalars: list[ScalarRef]) -> None:
    """Put back the optimizer state that DCP loads by replacing it in ``state`` (values that
    are not tensors, e.g. a Python step count), rather than by filling a tensor in place."""
    for key, entries, name in scalars:
        entries[name] = state[key]


def restore_param_groups(
    saved: list[list[dict[str, Any]]], optimizers: list[torch.optim.Optimizer], path: Path
) -> None:
    """Set each optimizer's hyperparameters (lr, betas, ...) to the saved ``PARAM_GROUPS``
    value (one list of groups per optimizer; the last one serves optimizers beyond it), as
    ``Optimizer.load_state_dict`` does. Raises StateError, naming ``path``, when the number
    of groups differs."""
    for i, opt in enumerate(optimizers):
        groups = saved[min(i, len(saved) - 1)]
        if len(groups) != len(opt.param_groups):
            raise StateError(
                f"{path} holds {len(groups)} parameter groups for optimizer {i}, this one has "
                f"{len(opt.param_groups)}: build the optimizer with the groups it was saved with"
            )
        for group, hyper in zip(opt.param_groups, groups, strict=True):
            group.update(hyper)


# ------------------------------------------------------------------ comparison
def key_sizes(state: dict[str, Any], pieces: dict[str, Piece]) -> dict[str, tuple[int, ...] | None]:
    """Every key this rank loads, with the global shape it needs there (None for a value
    that is not a tensor): what ``compare`` matches against the checkpoint."""
    sizes = {key: _global_size(value) for key, value in state.items()}
    sizes.update({key: tuple(piece.size) for key, piece in pieces.items()})
    return sizes


def _global_size(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, Tensor) else None


def compare(metadata: Metadata, needs: list[dict[str, tuple[int, ...] | None]], with_optimizer: bool) -> str:
    """What does not fit between the checkpoint and every rank's needs ("" when all fits).

    metadata: the checkpoint's DCP metadata. needs: every rank's ``key_sizes``.
    with_optimizer: whether any rank loads an optimizer (else the checkpoint's ``optim.*``
    keys are not unexpected). The answer names the missing and unexpected keys and the
    shapes that differ (at most a dozen of each)."""
    held = metadata.state_dict_metadata
    needed: dict[str, tuple[int, ...] | None] = {}
    for rank_needs in needs:
        needed.update(rank_needs)
    missing = sorted(k for k in needed if k not in held)
    counted = (_MODEL, _OPTIM) if with_optimizer else (_MODEL,)
    unexpected = sorted(k for k in held if k.startswith(counted) and k != PARAM_GROUPS and k not in needed)
    mismatched = []
    for key, size in sorted(needed.items()):
        md = held.get(key)
        if size is not None and isinstance(md, TensorStorageMetadata) and tuple(md.size) != size:
            mismatched.append(f"{key} (checkpoint {tuple(md.size)}, model {size})")
    if not (missing or unexpected or mismatched):
        return ""
    parts = []
    for what, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", mismatched)):
        if keys:
            more = f" and {len(keys) - _LISTED} more" if len(keys) > _LISTED else ""
            parts.append(f"{what} ({len(keys)}): {', '.join(keys[:_LISTED])}{more}")
    return (
        f"the checkpoint does not fit this model: {'; '.join(parts)}. It was saved from another model "
        "(or another optimizer): load it into the model it was saved from"
    )
