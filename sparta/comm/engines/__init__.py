"""The engines under the Communicator interface: torch.distributed, Horovod, MPI."""

from __future__ import annotations

import importlib
from types import ModuleType

from sparta.errors import BackendUnavailableError


def import_engine(module: str, backend: str, needs: str) -> ModuleType:
    """Import an engine's module, or say what to install to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BackendUnavailableError(f"backend={backend!r} needs {needs}; import failed with: {exc}") from exc
