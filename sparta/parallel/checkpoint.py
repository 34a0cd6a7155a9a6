"""Checkpoints of the 3D trainer that load under any other layout, written atomically.

``Checkpointer(directory).save(step, model_parts, optimizer, extra)`` writes one
``torch.distributed.checkpoint`` (DCP) checkpoint of every rank's model parts (this rank's
pipeline stage modules, bare or wrapped by DDP/FSDP2), the optimizer state and ``extra`` (the
data position, LR scheduler state, ...); ``load(model_parts, optimizer)`` reads the newest one
back into whatever layout the job now has, or returns None when there is none.

Layout-free keys. A checkpoint names every tensor by what it is in the full model, never by
which rank held it (``sparta.parallel.checkpoint_state`` has the scheme), so pp x dp x tp
with experts on 8 ranks, 4 ranks and one process (with or without a process group) all read
and write the same checkpoint. The optimizer's hyperparameters are restored as
``Optimizer.load_state_dict`` does; a fresh optimizer's state is created by ``load`` itself
(one step at zero learning rate: the parameters do not move), so build it before loading.
``extra`` is saved from rank 0, so it must be the same on every rank. Each rank's torch RNG
state (CPU, and CUDA where initialised) is restored when the world size is the one that saved
(another layout reseeds nothing: the trainer's model and data draw no random numbers once
built).

Atomic writes. DCP writes into ``directory/.tmp-step_<N>`` (each file fsynced, the metadata
last); after every rank has written, rank 0 fsyncs that directory and renames it to
``step_<N>`` (one ``rename``, atomic on POSIX), fsyncs ``directory``, then removes the oldest
complete checkpoints beyond ``keep`` (each renamed to ``.del-*`` first, so a half-removed one
is never read). A crash at any point leaves the previous ``step_*`` directories whole: a
partial ``.tmp-*`` or ``.del-*`` directory is never read, and rank 0 removes it at the next
``save`` or ``load``. Saving a step below complete checkpoints already there (a run that went
back, or started afresh in the same directory) sets those aside as ``later-step_<N>``: kept,
but never what a later ``load`` resumes. Every rank must see the same ``directory`` (a
shared filesystem).

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

import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from sparta.errors import ConfigError, SpartaError
from sparta.parallel.checkpoint_files import (
    STEP_PREFIX,
    TMP_PREFIX,
    complete_checkpoints,
    prune,
    publish,
    remove_partial,
    set_aside_later,
)
from sparta.parallel.checkpoint_group import CheckpointError, CheckpointGroup
from sparta.parallel.checkpoint_planners import Piece, PieceLoadPlanner, PieceSavePlanner
from sparta.parallel.checkpoint_state import (
    PARAM_GROUPS,
    ScalarRef,
    StateError,
    compare,
    dcp_state_dict,
    forget_optimizer_state,
    key_sizes,
    materialise_optimizer_state,
    model_slots,
    never_stepped,
    restore_param_groups,
    restore_scalars,
)

_EXTRA, _RNG = "extra", "rng."

log = logging.getLogger("sparta.parallel.checkpoint")


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
        """The checkpoint directory."""
        assert isinstance(self.directory, Path)
        return self.directory

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints in ``directory``, oldest first (local; no collective)."""
        return [step for step, _ in complete_checkpoints(self.path)]

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
        group = CheckpointGroup(self.process_group)
        problem = _check_step_extra(step, extra)
        state: dict[str, Any] = {}
        pieces: dict[str, Piece] = {}
        if problem is None:
            try:
                slots = model_slots(_as_list(model_parts))
                state, pieces, _ = dcp_state_dict(slots, _optimizers(optimizer), group.rank)
            except Exception as exc:  # on this rank only: agreed on below, so no rank waits alone
                problem = _describe(exc)
        if problem is None and group.rank == 0:
            state[_EXTRA] = {**(extra or {}), "step": step}
        if problem is None and self.rng:
            state[f"{_RNG}{group.rank}"] = _rng_state()
        group.agree(problem, f"saving step {step}")

        tmp = self.path / f"{TMP_PREFIX}{step}"
        problem = None
        if group.rank == 0:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                remove_partial(self.path)
                tmp.mkdir()
            except OSError as exc:
                problem = f"cannot create {tmp}: {exc}"
        group.agree(problem, f"saving step {step}")

        try:
            with group.quiet():
                dcp.save(
                    state,
                    storage_writer=FileSystemWriter(tmp, sync_files=True),
                    planner=PieceSavePlanner(pieces),
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
                # before the new step appears: a crash between the two must not leave a later
                # step that a load would resume instead of this one
                for aside in set_aside_later(self.path, step):
                    log.warning("a checkpoint past step %d, saved again now: set aside as %s", step, aside)
            except OSError as exc:
                problem = f"cannot set aside the checkpoints past step {step} in {self.path}: {exc}"
            if problem is None:
                try:
                    publish(tmp, final)
                except OSError as exc:
                    problem = f"cannot move the complete checkpoint {tmp} to {final}: {exc}"
            if problem is None:
                try:
                    if self.keep is not None:
                        prune(self.path, self.keep, final)
                except OSError as exc:  # the new checkpoint stands; only the tidying failed
                    problem = f"step {step} was saved to {final}, but tidying {self.path} failed: {exc}"
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
        group = CheckpointGroup(self.process_group)
        chosen: Path | None = None
        problem = None
        if group.rank == 0:
            try:
                remove_partial(self.path)
                found = dict(complete_checkpoints(self.path))
            except OSError as exc:  # on rank 0 only: agreed on below, so no rank waits alone
                problem = f"cannot read {self.path}: {exc}; give a directory this job may read and write"
            else:
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
        pieces: dict[str, Piece] = {}
        scalars: list[ScalarRef] = []
        created: list[tuple[torch.optim.Optimizer, Tensor]] = []
        if problem is None:
            try:
                slots = model_slots(_as_list(model_parts))
                created = materialise_optimizer_state(optimizers)
                assert metadata is not None
                unstepped = never_stepped(created, slots, metadata.state_dict_metadata)
                forget_optimizer_state(unstepped)  # left without state, as when it was saved
                gone = {id(param) for _, param in unstepped}
                created = [(opt, param) for opt, param in created if id(param) not in gone]
                state, pieces, scalars = dcp_state_dict(slots, optimizers, group.rank, with_groups=False)
            except Exception as exc:  # on this rank only: agreed on below, so no rank waits alone
                problem = _describe(exc)
        needs = key_sizes(state, pieces)
        answers = group.gather((problem, needs, bool(optimizers)))
        problems = [f"rank {r}: {p}" for r, (p, _, _) in enumerate(answers) if p is not None]
        if not problems:
            assert metadata is not None
            verdict = compare(metadata, [n for _, n, _ in answers], any(o for _, _, o in answers))
            problems = [verdict] if verdict else []
        if problems:
            forget_optimizer_state(created)
            raise CheckpointError(f"loading {path} failed: " + "; ".join(problems))

        assert metadata is not None
        held = metadata.state_dict_metadata
        state[_EXTRA] = None
        if optimizers and PARAM_GROUPS in held:
            state[PARAM_GROUPS] = None
        world = sum(key.startswith(_RNG) for key in held)
        mine = f"{_RNG}{group.rank}"
        if self.rng and world == group.size and mine in held:
            state[mine] = None
        try:
            with group.quiet():
                reader = FileSystemReader(path)
                dcp.load(state, storage_reader=reader, planner=PieceLoadPlanner(pieces), process_group=group.pg)
        except (Exception, CheckpointException) as exc:  # DCP raises the same exception on every rank
            forget_optimizer_state(created)
            raise CheckpointError(f"loading {path} failed: reading it failed: {_reason(exc)}") from None
        # DCP filled the tensors in place; objects it loads by replacing them in the dict.
        restore_scalars(state, scalars)
        problem = None
        if PARAM_GROUPS in state:
            try:
                restore_param_groups(state[PARAM_GROUPS], optimizers, path)
            except StateError as exc:  # this rank's optimizers alone may differ: agreed on below
                problem = str(exc)
        group.agree(problem, f"loading {path}")
        if mine in state:
            _set_rng_state(state[mine])
        return dict(state[_EXTRA])


# ------------------------------------------------------------------ arguments
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
