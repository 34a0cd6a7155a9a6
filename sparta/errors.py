"""Sparta's exceptions: every one names the bad value and says how to fix it."""

from __future__ import annotations


class SpartaError(Exception):
    """Base class of every error Sparta raises on purpose."""


class ConfigError(SpartaError, ValueError):
    """A configuration value is out of range or inconsistent with another."""


class InputError(SpartaError, ValueError):
    """A tensor or argument passed to an operation is invalid (shape, dtype, splits)."""


class BackendUnavailableError(SpartaError, ImportError):
    """The requested communication engine is not installed or cannot start."""


class CollectiveError(SpartaError, RuntimeError):
    """A collective failed inside the engine; the message names rank, op and group."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within the communicator's timeout."""
