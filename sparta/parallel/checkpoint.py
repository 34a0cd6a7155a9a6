"""Checkpoints of the 3D trainer that load under any other layout, written atomically.

``Checkpointer(directory).save(step, model_parts, optimizer, extra)`` writes one
``torch.distributed.checkpoint`` (DCP) checkpoint of every rank's model parts (this rank's
pipeline stage modules, bare or wrapped by DDP/FSDP2), the optimizer state and ``extra`` (the
data position, LR scheduler state, ...); ``load(model_parts, optimizer)`` reads the newest one
back into whatever layout the job now has, or returns None when there is none.

Layout-free keys. A checkpoint names every tensor by what it is in the full model, never by
which rank held it, so pp x dp x tp with experts on 8 ranks, 4 ranks and one process (with or
without a process group) all read and write the same checkpoint:

- ``model.<fqn>``: every parameter and persistent buffer under its full-model name
  (``model.layers.3.attn.wq.weight``; stage modules are deep copies of the full model, so a
  stage's names are the full model's). Tensor-parallel and FSDP2 parameters are DTensors,
  which DCP saves as chunks of the global tensor and reshards on load.
- ``model.<path>.experts.<w>.<id>``: one entry per global expert, as GroupedExperts'
  ``state_dict`` already names them; replicas of an expert (ep smaller than dp) save the same
  key, which DCP writes once.
- ``model.<path>.weight`` of a SparseEmbedding: the whole ``[num_embeddings, dim]`` table as
  one DCP tensor, of which each rank writes (and reads) the rows and columns it holds as a
  chunk at their offset; the module's own local ``state_dict`` key
  (``weight.rows<a>-<b>.cols<c>-<d>``) depends on the layout and is not used. A
  VocabParallelHead's row shard is saved the same way, as its whole ``[vocab, d]`` weight, so
  a plain ``nn.Embedding`` / ``nn.Linear`` of one process loads either. (The chunks go
  through DCP's public planner interface: ``DefaultSavePlanner`` / ``DefaultLoadPlanner``
  subclasses add their write and read items; DCP reads each chunk from whatever chunks the
  checkpoint holds.)
- ``optim.<fqn>.<state>``: each optimizer state tensor shaped like its parameter under the
  parameter's key, cut the same way (AdamW's ``exp_avg`` per expert, per embedding chunk, per
  TP shard); other state (AdamW's ``step``) is saved as is under every key of its parameter.
  ``optim.param_groups``: rank 0's hyperparameters (lr, betas, ...), restored on load as
  ``Optimizer.load_state_dict`` does.
- ``extra``: the dict given to ``save``, from rank 0 (so it must be the same on every rank);
  ``rng.<rank>``: each rank's torch RNG state (CPU, and CUDA where initialised), restored on
  load when the world size is the one that saved (another layout reseeds nothing: the
  trainer's model and data draw no random numbers once built).

A fresh optimizer has no state to load into: ``load`` first creates it with one step at zero
gradients and a zero learning rate (as torch's own ``set_optimizer_state_dict`` does; the
parameters do not move), then DCP fills it in place.

Atomic writes. DCP writes into ``directory/.tmp-step_<N>`` (each file fsynced, the metadata
last); after every rank has written, rank 0 fsyncs that directory and renames it to
``step_<N>`` (one ``rename``, atomic on POSIX), fsyncs ``directory``, then removes the oldest
complete checkpoints beyond ``keep``. A crash at any point leaves the previous ``step_*``
directories whole: a partial ``.tmp-*`` directory is never read, and rank 0 removes it at the
next ``save`` or ``load``. Every rank must see the same ``directory`` (a shared filesystem).

Errors. Any failure on any rank (a full disk, an unwritable directory, a checkpoint that
does not fit the model) raises ``CheckpointError`` on every rank, after the ranks agree on
it, never a hang: a checkpoint from another model names its missing and unexpected keys and
the shapes that differ, before anything is loaded.

Collectives. ``save`` and ``load`` are collective over the default process group (or
``process_group``) when ``torch.distributed`` is initialised: every rank calls them, in the
same order. Without a process group, one process saves and loads alone; a process that a
launcher started as one of several ranks is refused then (each would take itself for the only
one and write the same files): build the layout first, which starts torch.distributed.

Trust. ``extra``, the RNG states and the optimizer's hyperparameters are pickled, and loading
unpickles them: load only checkpoints your own jobs wrote.

Checked (tests/parallel/test_checkpoint.py, torch 2.13 CPU, gloo): the MoE decoder with sharded
embeddings saved on 8 ranks (pp2 x dp2 x tp2 ep2, FSDP2) loads on 4 (dp4 ep4, DDP) and in one
process without a process group with the same probe loss within 1e-6 and the same next AdamW
steps within 1e-5; a 4-rank run SIGKILLed while writing a checkpoint resumes from the previous
one with exactly the losses of a run never stopped.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from sparta.comm.launch import detect
from sparta.embedding.layer import SparseEmbedding
from sparta.embedding.vocab_parallel import VocabParallelHead
from sparta.errors import ConfigError, SpartaError
from sparta.moe.experts import GroupedExperts

STEP_PREFIX = "step_"  # a complete checkpoint: directory/step_<N>
_TMP_PREFIX = ".tmp-step_"  # being written; never read
_OLD_PREFIX = ".old-step_"  # a complete checkpoint of the same step being replaced
_STEP_DIR = re.compile(r"step_(\d+)")
_MODEL, _OPTIM, _GROUPS, _EXTRA, _RNG = "model.", "optim.", "optim.param_groups", "extra", "rng."
_LISTED = 12  # keys named in an error message, per kind


class CheckpointError(SpartaError, RuntimeError):
    """A checkpoint could not be written or read; raised on every rank alike."""


@dataclass
class Checkpointer:
    """Saves and loads the trainer's checkpoints under ``directory`` (see the module).

    directory: where ``step_<N>`` checkpoints live; created on the first save. Every rank
        must see the same directory.
    keep: how many complete checkpoints to keep (the newest by step); older ones are removed
        after a new one is complete. None keeps all.
    rng: save each rank's torch RNG state and restore it when the world size matches.
    process_group: the group DCP and the agreement collectives run over; None means the
        default group when ``torch.distributed`` is initialised, else one process.
    """

    directory: str | os.PathLike[str]
    keep: int | None = 3
    rng: bool = True
    process_group: dist.ProcessGroup | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.directory, (str, os.PathLike)) or not str(self.directory):
            raise ConfigError(f"Checkpointer.directory={self.directory!r} must be a non-empty path")
        self.directory = Path(self.directory)
        if self.keep is not None and (isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1):
            raise ConfigError(f"Checkpointer.keep={self.keep!r} must be an int >= 1, or None to keep every checkpoint")
        if not isinstance(self.rng, bool):
            raise ConfigError(f"Checkpointer.rng={self.rng!r} must be True or False")

    # ------------------------------------------------------------------ listing
    @property
    def path(self) -> Path:
        assert isinstance(self.directory, Path)
        return self.directory

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints in ``directory``, oldest first (local; no collective)."""
        return [step for step, _ in _complete(self.path)]

    def step_path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is (or would be)."""
        return self.path / f"{STEP_PREFIX}{step}"

    # --------------------------------------------------------------------- save
    def save(
        self,
        step: int,
        model_parts: Sequence[nn.Module] | nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Write ``step_<step>`` atomically; returns its path. Collective (see the module).

        model_parts: this rank's stage modules (a module or a list; DDP wrappers are looked
            through). optimizer: one optimizer or a list over those parts' parameters, or None.
        extra: plain values to hand back from ``load`` (data position, scheduler state, ...),
            the same on every rank; saved from rank 0. ``load`` adds ``"step"``.
        """
        group = _Group(self.process_group)
        problem = _check_step_extra(step, extra)
        state: dict[str, Any] = {}
        pieces: dict[str, _Piece] = {}
        if problem is None:
            try:
                slots = _model_slots(_as_list(model_parts))
                state, pieces, _ = _save_state(slots, _optimizers(optimizer), group.rank)
            except Exception as exc:  # on this rank only: agreed on below, so no rank waits alone
                problem = _describe(exc)
        if problem is None and group.rank == 0:
            state[_EXTRA] = {**(extra or {}), "step": step}
        if problem is None and self.rng:
            state[f"{_RNG}{group.rank}"] = _rng_state()
        group.agree(problem, f"saving step {step}")

        tmp = self.path / f"{_TMP_PREFIX}{step}"
        problem = None
        if group.rank == 0:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                _remove_partial(self.path)
                tmp.mkdir()
            except OSError as exc:
                problem = f"cannot create {tmp}: {exc}"
        group.agree(problem, f"saving step {step}")

        try:
            with _quiet(group):
                dcp.save(
                    state,
                    storage_writer=FileSystemWriter(tmp, sync_files=True),
                    planner=_SavePlanner(pieces),
                    process_group=group.pg,
                )
        except (Exception, CheckpointException) as exc:  # DCP raises the same exception on every rank
            if group.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            group.gather(None)  # every rank raises once the partial directory is gone
            raise CheckpointError(f"saving step {step} failed: writing {tmp} failed: {_reason(exc)}") from None

        final = self.step_path(step)
        problem = None
        if group.rank == 0:
            try:
                _publish(tmp, final)
            except OSError as exc:
                problem = f"cannot move the complete checkpoint {tmp} to {final}: {exc}"
            if problem is None and self.keep is not None:
                # the oldest others, never the one just written (a resumed run may save a
                # lower step than a checkpoint left from before)
                others = [old for _, old in _complete(self.path) if old != final]
                for old in others[: max(len(others) - (self.keep - 1), 0)]:
                    shutil.rmtree(old, ignore_errors=True)
        group.agree(problem, f"saving step {step}")
        return final

    # --------------------------------------------------------------------- load
    def load(
        self,
        model_parts: Sequence[nn.Module] | nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        step: int | None = None,
    ) -> dict[str, Any] | None:
        """Load the newest complete checkpoint (or that of ``step``) into ``model_parts`` and
        ``optimizer``, in place; returns the ``extra`` dict it was saved with, plus
        ``"step"``, or None when ``directory`` holds no complete checkpoint (``step=None``).
        Collective (see the module). Raises CheckpointError on every rank when the
        checkpoint does not fit the model (naming the missing and unexpected keys).
        """
        group = _Group(self.process_group)
        chosen: Path | None = None
        problem = None
        if group.rank == 0:
            _remove_partial(self.path)
            found = dict(_complete(self.path))
            if step is not None and step not in found:
                problem = f"{self.step_path(step)} is not a complete checkpoint; complete steps: {sorted(found)}"
            elif found:
                chosen = found[step if step is not None else max(found)]
        group.agree(problem, "loading")
        chosen_name = group.broadcast(chosen.name if chosen is not None else None)
        if chosen_name is None:
            return None
        path = self.path / chosen_name

        # What this rank needs, against what the checkpoint holds: every rank learns every
        # rank's needs, so that the verdict (and the error) is the same everywhere.
        metadata: Metadata | None = None
        problem = None
        try:
            metadata = FileSystemReader(path).read_metadata()
        except Exception as exc:
            problem = f"cannot read {path}: {_reason(exc)}"
        optimizers = _optimizers(optimizer)
        state: dict[str, Any] = {}
        pieces: dict[str, _Piece] = {}
        scalars: list[tuple[str, dict[str, Any], str]] = []
        created: list[tuple[torch.optim.Optimizer, Tensor]] = []
        if problem is None:
            try:
                slots = _model_slots(_as_list(model_parts))
                created = _materialise_state(optimizers)
                state, pieces, scalars = _save_state(slots, optimizers, group.rank, with_groups=False)
            except Exception as exc:  # on this rank only: agreed on below, so no rank waits alone
                problem = _describe(exc)
        needs = {key: _global_size(value) for key, value in state.items()}
        needs.update({key: tuple(piece.size) for key, piece in pieces.items()})
        answers = group.gather((problem, needs, bool(optimizers)))
        problems = [f"rank {r}: {p}" for r, (p, _, _) in enumerate(answers) if p is not None]
        if not problems:
            assert metadata is not None
            verdict = _compare(path, metadata, [n for _, n, _ in answers], any(o for _, _, o in answers))
            problems = [verdict] if verdict else []
        if problems:
            _forget(created)
            raise CheckpointError(f"loading {path} failed: " + "; ".join(problems))

        assert metadata is not None
        held = metadata.state_dict_metadata
        state[_EXTRA] = None
        if optimizers and _GROUPS in held:
            state[_GROUPS] = None
        world = sum(key.startswith(_RNG) for key in held)
        mine = f"{_RNG}{group.rank}"
        if self.rng and world == group.size and mine in held:
            state[mine] = None
        try:
            with _quiet(group):
                reader = FileSystemReader(path)
                dcp.load(state, storage_reader=reader, planner=_LoadPlanner(pieces), process_group=group.pg)
        except (Exception, CheckpointException) as exc:  # DCP raises the same exception on every rank
            _forget(created)
            raise CheckpointError(f"loading {path} failed: reading it failed: {_reason(exc)}") from None
        # DCP filled the tensors in place; objects it loads by replacing them in the dict.
        _restore_scalars(state, scalars)
        if _GROUPS in state:
            _restore_groups(state[_GROUPS], optimizers, path)
        if mine in state:
            _set_rng_state(state[mine])
        return dict(state[_EXTRA])


# ---------------------------------------------------------------------- slots
@dataclass(frozen=True)
class _Slot:
    """One checkpoint key and where its tensor lives on this rank: ``tensor`` (a parameter or
    buffer), or its row ``index`` (an expert of a GroupedExperts weight), or a chunk of a
    global table at ``offsets`` in ``size`` (a SparseEmbedding shard)."""

    key: str
    tensor: Any
    index: int | None = None
    offsets: tuple[int, ...] | None = None
    size: tuple[int, ...] | None = None

    def view(self, t: Tensor) -> Tensor:
        """The part of ``t`` (shaped like ``tensor``) that this key names."""
        return t[self.index] if self.index is not None else t


@dataclass(frozen=True)
class _Piece:
    """A chunk of a global tensor that this rank writes or reads: ``local`` at ``offsets``."""

    local: Tensor
    offsets: tuple[int, ...]
    size: tuple[int, ...]


def _as_list(model_parts: Sequence[nn.Module] | nn.Module) -> list[nn.Module]:
    parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
    if not parts or not all(isinstance(p, nn.Module) for p in parts):
        raise CheckpointError(
            f"model_parts must be an nn.Module or a non-empty list of them (this rank's stage modules), got {parts!r}"
        )
    return parts


def _optimizers(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise CheckpointError(
                f"optimizer must be a torch.optim.Optimizer or a list of them, got {type(opt).__name__}"
            )
    return optimizers


def _unwrap(module: nn.Module) -> nn.Module:
    """The module under DDP's wrapper (whose state_dict keys start with ``module.``)."""
    while isinstance(module, DistributedDataParallel):
        module = module.module
    return module


def _model_slots(parts: list[nn.Module]) -> list[_Slot]:
    """Every layout-free key of this rank's model parts, in a deterministic order.

    The keys are the parts' own ``state_dict`` keys (so persistent buffers and extra state
    come too), except that a SparseEmbedding's local shard key becomes its table's
    ``weight`` chunk and a GroupedExperts' per-expert keys point at rows of its weights.
    """
    slots: dict[str, _Slot] = {}
    for part in parts:
        root = _unwrap(part)
        for module in root.modules():
            if isinstance(module, FSDPModule):  # FSDP2: parameters back to their sharded DTensors
                module.reshard()
        special: dict[str, _Slot] = {}
        # every path of a shared module (a table tied to a head is under both), as state_dict does
        for path, module in root.named_modules(remove_duplicate=False):
            prefix = f"{path}." if path else ""
            if isinstance(module, VocabParallelHead) and not hasattr(module, "tied"):
                _refuse_dtensor(module.weight, prefix + "weight")
                layout = module.layout
                size = (layout.num_embeddings, layout.embedding_dim)
                offsets = (layout.row_range(layout.rank)[0], 0)
                special[prefix + "weight"] = _Slot(prefix + "weight", module.weight, offsets=offsets, size=size)
            elif isinstance(module, SparseEmbedding):
                _refuse_dtensor(module.weight, prefix + "weight")
                layout = module.layout
                offsets = (layout.row_range(layout.rank)[0], layout.col_range(layout.rank)[0])
                size = (module.num_embeddings, module.embedding_dim)
                own = prefix + module.shard_key()
                special[own] = _Slot(prefix + "weight", module.weight, offsets=offsets, size=size)
            elif isinstance(module, GroupedExperts):
                for name, weight in module.named_weights():
                    _refuse_dtensor(weight, prefix + name)
                    for local in range(module.num_experts):
                        key = f"{prefix}{name}.{module.first_expert + local}"
                        special[key] = _Slot(key, weight, index=local)
        for key, value in root.state_dict(keep_vars=True).items():
            if not isinstance(value, Tensor):
                raise CheckpointError(
                    f"{key} is a module's extra state ({type(value).__name__}), which the checkpointer does not "
                    "save; keep such state in the extra dict of save()"
                )
            slot = special.pop(key, None) or _Slot(key, value)
            other = slots.get(slot.key)
            if other is not None and other.tensor is not slot.tensor:
                raise CheckpointError(
                    f"two model parts of this rank hold different tensors named {slot.key!r}; stage modules "
                    "must each own the modules they keep (a deep copy with the others' modules deleted)"
                )
            slots[slot.key] = slot
        if special:
            raise CheckpointError(
                f"these keys of the model's sharded layers are not in its state_dict: {sorted(special)[:_LISTED]}; "
                "a module overrides state_dict in a way the checkpointer does not know"
            )
    return list(slots.values())


def _refuse_dtensor(tensor: Tensor, name: str) -> None:
    if isinstance(tensor, DTensor):
        raise CheckpointError(
            f"{name} is a DTensor (e.g. wrapped by FSDP2), but the layer is already sharded by its own "
            "communicator: leave its sharded weights out of fully_shard"
        )


def _save_state(
    slots: list[_Slot], optimizers: list[torch.optim.Optimizer], rank: int, with_groups: bool = True
) -> tuple[dict[str, Any], dict[str, _Piece], list[tuple[str, dict[str, Any], str]]]:
    """(DCP state dict, chunks of global tensors, optimizer state that is not a tensor) of
    the model and the optimizers.

    The state dict's tensors share storage with the parameters and optimizer state, so a
    DCP load writes straight into them; the last list says where to put back the values
    that DCP loads by replacing them in the dict: (key, the parameter's state, name).
    """
    state: dict[str, Any] = {}
    pieces: dict[str, _Piece] = {}
    scalars: list[tuple[str, dict[str, Any], str]] = []

    def put(key: str, slot: _Slot, value: Any, like_param: bool) -> None:
        if isinstance(value, Tensor) and like_param:
            if slot.offsets is not None:
                assert slot.size is not None
                pieces[key] = _Piece(value.detach(), slot.offsets, slot.size)
            else:
                state[key] = slot.view(value.detach())
        else:
            state[key] = value.detach() if isinstance(value, Tensor) else value

    by_param: dict[int, list[_Slot]] = {}
    for slot in slots:
        put(_MODEL + slot.key, slot, slot.tensor, True)
        if isinstance(slot.tensor, nn.Parameter):
            by_param.setdefault(id(slot.tensor), []).append(slot)
    for opt in optimizers:
        for group in opt.param_groups:
            for param in group["params"]:
                if id(param) not in by_param:
                    raise CheckpointError(
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
        state[_GROUPS] = [[_hyper(g) for g in opt.param_groups] for opt in optimizers]
    return state, pieces, scalars


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _global_size(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, Tensor) else None


def _materialise_state(optimizers: list[torch.optim.Optimizer]) -> list[tuple[torch.optim.Optimizer, Tensor]]:
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


def _forget(created: list[tuple[torch.optim.Optimizer, Tensor]]) -> None:
    """Drop the state ``_materialise_state`` made, when the load does not happen."""
    for opt, param in created:
        opt.state.pop(param, None)


def _restore_scalars(state: dict[str, Any], scalars: list[tuple[str, dict[str, Any], str]]) -> None:
    """Put back the optimizer state that DCP loads by replacing it in ``state`` (values that
    are not tensors, e.g. a Python step count), rather than by filling a tensor in place."""
    for key, entries, name in scalars:
        entries[name] = state[key]


def _restore_groups(saved: list[list[dict[str, Any]]], optimizers: list[torch.optim.Optimizer], path: Path) -> None:
    for i, opt in enumerate(optimizers):
        groups = saved[min(i, len(saved) - 1)]
        if len(groups) != len(opt.param_groups):
            raise CheckpointError(
                f"{path} holds {len(groups)} parameter groups for optimizer {i}, this one has "
                f"{len(opt.param_groups)}: build the optimizer with the groups it was saved with"
            )
        for group, hyper in zip(opt.param_groups, groups, strict=True):
            group.update(hyper)


def _compare(path: Path, metadata: Metadata, needs: list[dict[str, Any]], with_optimizer: bool) -> str:
    """What does not fit between the checkpoint and every rank's needs ("" when all fits)."""
    held = metadata.state_dict_metadata
    needed: dict[str, Any] = {}
    for rank_needs in needs:
        needed.update(rank_needs)
    missing = sorted(k for k in needed if k not in held)
    counted = (_MODEL, _OPTIM) if with_optimizer else (_MODEL,)
    unexpected = sorted(k for k in held if k.startswith(counted) and k != _GROUPS and k not in needed)
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


# -------------------------------------------------------------------- planners
class _SavePlanner(DefaultSavePlanner):
    """The default planner, plus chunks of global tensors that this rank writes at their
    offsets (SparseEmbedding shards and their optimizer state)."""

    def __init__(self, pieces: dict[str, _Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [
            WriteItem(
                index=MetadataIndex(key, torch.Size(piece.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(piece.offsets), piece.local.shape),
                    properties=TensorProperties.create_from_tensor(piece.local),
                    size=torch.Size(piece.size),
                ),
            )
            for key, piece in self.pieces.items()
        ]
        self.plan = SavePlan([*plan.items, *items], storage_data=plan.storage_data, planner_data=plan.planner_data)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Tensor | io.BytesIO:
        piece = self.pieces.get(write_item.index.fqn)
        if piece is not None:
            return piece.local
        return super().resolve_data(write_item)


class _LoadPlanner(DefaultLoadPlanner):
    """The default planner, plus chunks of global tensors that this rank reads from whatever
    chunks the checkpoint holds (DCP's own resharding of overlapping regions)."""

    def __init__(self, pieces: dict[str, _Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items: list[ReadItem] = []
        for key, piece in self.pieces.items():
            md = self.metadata.state_dict_metadata[key] if self.metadata is not None else None
            assert isinstance(md, TensorStorageMetadata)
            chunk = ChunkStorageMetadata(torch.Size(piece.offsets), piece.local.shape)
            items.extend(create_read_items_for_chunk_list(key, md, [chunk]))
        return LoadPlan([*plan.items, *items], storage_data=plan.storage_data, planner_data=plan.planner_data)

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        piece = self.pieces.get(read_item.dest_index.fqn)
        if piece is None:
            return super().resolve_tensor(read_item)
        region = piece.local
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            region = region.narrow(dim, start, length)
        return region


# ------------------------------------------------------------------- agreement
class _Group:
    """The ranks that save or load together (one process when torch.distributed is off)."""

    def __init__(self, pg: dist.ProcessGroup | None) -> None:
        self.pg = pg
        self.on = dist.is_available() and dist.is_initialized()
        launched = detect().size
        if not self.on and (pg is not None or launched > 1):
            # every rank would take itself for the only one and write the same files
            raise CheckpointError(
                f"this process is one of {launched} launched ranks but torch.distributed is not initialised: "
                "build the layout first (sparta.parallel.build_layout starts it), or "
                "torch.distributed.init_process_group"
            )
        self.rank = dist.get_rank(pg) if self.on else 0
        self.size = dist.get_world_size(pg) if self.on else 1

    def gather(self, obj: Any) -> list[Any]:
        if not self.on:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj: Any) -> Any:
        if not self.on:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.pg, group_src=0)
        return box[0]

    def agree(self, problem: str | None, what: str) -> None:
        """Raise CheckpointError on every rank if any rank has a problem (a collective)."""
        problems = [f"rank {r}: {p}" for r, p in enumerate(self.gather(problem)) if p is not None]
        if problems:
            raise CheckpointError(f"{what} failed: " + "; ".join(problems))


@contextlib.contextmanager
def _quiet(group: _Group) -> Iterator[None]:
    """Silence DCP's warning that it runs in one process, when that is what was meant."""
    with warnings.catch_warnings():
        if not group.on:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _check_step_extra(step: Any, extra: Any) -> str | None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"step={step!r} must be an int >= 0"
    if extra is not None and not isinstance(extra, dict):
        return f"extra must be a dict (or None), got {type(extra).__name__}"
    if extra is not None and "step" in extra and extra["step"] != step:
        return f"extra['step']={extra['step']!r} differs from step={step}; leave 'step' out of extra (load adds it)"
    return None


def _describe(exc: Exception) -> str:
    return str(exc) if isinstance(exc, SpartaError) else f"{type(exc).__name__}: {exc}"


def _reason(exc: BaseException) -> str:
    """What failed, on which ranks: DCP's CheckpointException carries each failing rank's
    exception (the same object reaches every rank)."""
    if isinstance(exc, CheckpointException):
        failures = sorted(exc.failures.items())
        return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in failures)[:2000]
    return f"{type(exc).__name__}: {exc}"[:2000]


# ------------------------------------------------------------------- the disk
def _complete(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match is not None and (entry / ".metadata").is_file():
            found.append((int(match[1]), entry))
    return sorted(found)


def _remove_partial(directory: Path) -> None:
    """Remove what crashed saves left: ``.tmp-*`` (never complete) and ``.old-*`` (a
    checkpoint that a complete one of the same step replaced, or is about to)."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if entry.name.startswith(_OLD_PREFIX):
            step_dir = directory / entry.name.replace(_OLD_PREFIX, STEP_PREFIX, 1)
            if not step_dir.exists():  # the crash came between the two renames: put it back
                os.rename(entry, step_dir)
                continue
        if entry.name.startswith((_TMP_PREFIX, _OLD_PREFIX)):
            try:
                shutil.rmtree(entry)
            except OSError as exc:
                warnings.warn(f"could not remove the partial checkpoint {entry}: {exc}", stacklevel=3)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the written ``tmp`` to ``final`` durably; a complete checkpoint of the same
    step is replaced only once the new one is in place."""
    _fsync_dir(tmp)
    old = final.with_name(final.name.replace(STEP_PREFIX, _OLD_PREFIX, 1))
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------ RNG
def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
