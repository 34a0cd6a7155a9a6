"""A checkpoint directory on disk: which checkpoints are complete, what crashed saves left,
and the durable rename that makes a written checkpoint complete (see `checkpoint.py`'s
"Atomic writes").

    directory/step_<N>       complete (its DCP ``.metadata`` is in it); the only kind read
    directory/.tmp-step_<N>  being written, or left by a crash; never read, removed
    directory/.old-step_<N>  a complete checkpoint of step N that a new one replaces
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
    """Remove what crashed saves left: ``.tmp-*`` (never complete) and ``.old-*`` (a
    checkpoint that a complete one of the same step replaced, or is about to)."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if entry.name.startswith(OLD_PREFIX):
            step_dir = directory / entry.name.replace(OLD_PREFIX, STEP_PREFIX, 1)
            if not step_dir.exists():  # the crash came between the two renames: put it back
                os.rename(entry, step_dir)
                continue
        if entry.name.startswith((TMP_PREFIX, OLD_PREFIX)):
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
