"""A checkpoint directory on disk: which checkpoints are complete, what crashed saves left,
and the durable rename that makes a written checkpoint complete (see `checkpoint.py`'s
"Atomic writes").

    directory/step_<N>       complete (its DCP ``.metadata`` is in it); the only kind read
    directory/.tmp-step_<N>  being written, or left by a crash; never read, removed
    directory/.old-step_<N>  a complete checkpoint of step N that a new one replaces
    directory/.del-step_<N>  a checkpoint being pruned; never read, removed
    directory/later-step_<N> a checkpoint past the step a run went back to and saved again
                             (kept, never read: a later load would resume the abandoned run)
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

STEP_PREFIX = "step_"  # a complete checkpoint: directory/step_<N>
TMP_PREFIX = ".tmp-step_"  # being written; never read
OLD_PREFIX = ".old-step_"  # a complete checkpoint of the same step being replaced
DEL_PREFIX = ".del-step_"  # being pruned: renamed first, so a half-removed one is never read
LATER_PREFIX = "later-step_"  # set aside: past the step a run went back to
STEP_DIR = re.compile(r"step_(\d+)")


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = STEP_DIR.fullmatch(entry.name)
        if match is not None and (entry / ".metadata").is_file():
            found.append((int(match[1]), entry))
    return sorted(found)


def remove_partial(directory: Path) -> None:
    """Remove what crashed saves left: ``.tmp-*`` (never complete), ``.del-*`` (being pruned)
    and ``.old-*`` (a checkpoint that a complete one of the same step replaced, or is about to)."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if entry.name.startswith(OLD_PREFIX):
            step_dir = directory / entry.name.replace(OLD_PREFIX, STEP_PREFIX, 1)
            if not step_dir.exists():  # the crash came between the two renames: put it back
                os.rename(entry, step_dir)
                continue
        if entry.name.startswith((TMP_PREFIX, OLD_PREFIX, DEL_PREFIX)):
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


def publish(tmp: Path, final: Path) -> None:
    """Rename the written ``tmp`` to ``final`` durably; a complete checkpoint of the same
    step is replaced only once the new one is in place."""
    _fsync_dir(tmp)
    old = final.with_name(final.name.replace(STEP_PREFIX, OLD_PREFIX, 1))
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def prune(directory: Path, keep: int, new: Path) -> None:
    """Leave ``keep`` complete checkpoints: ``new`` and the newest others. Each one removed is
    renamed out of the complete ones first (atomic), then deleted."""
    others = [old for _, old in complete_checkpoints(directory) if old != new]
    for old in others[: max(len(others) - (keep - 1), 0)]:
        doomed = old.with_name(old.name.replace(STEP_PREFIX, DEL_PREFIX, 1))
        os.rename(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def set_aside_later(directory: Path, step: int) -> list[Path]:
    """Rename every complete checkpoint past ``step`` to ``later-step_<N>``: a run that went
    back to an earlier step and saved again has abandoned them, and a later load must not
    resume them. Kept, not deleted (a name taken by an earlier set-aside gets a suffix,
    ``later-step_<N>.2``...); returns where they went."""
    moved = []
    for n, path in complete_checkpoints(directory):
        if n > step:
            aside, copy = path.with_name(f"{LATER_PREFIX}{n}"), 1
            while aside.exists():
                copy += 1
                aside = path.with_name(f"{LATER_PREFIX}{n}.{copy}")
            os.rename(path, aside)
            moved.append(aside)
    return moved
