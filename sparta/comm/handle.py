"""Handles of asynchronous collectives, and the bounded wait every engine shares."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

from sparta.errors import CollectiveError, CollectiveTimeoutError

T = TypeVar("T")
U = TypeVar("U")


class Handle(Generic[T]):
    """The pending result of a collective. `wait()` blocks until it is done and returns it.

    A handle is waited at most once for real; later calls return the cached result.
    """

    def __init__(self, wait: Callable[[], T]) -> None:
        self._wait = wait
        self._done = False
        self._result: T | None = None

    @classmethod
    def completed(cls, value: T) -> Handle[T]:
        handle: Handle[T] = cls(lambda: value)
        return handle

    def wait(self) -> T:
        if not self._done:
            self._result = self._wait()
            self._done = True
            self._wait = _spent
        return self._result  # type: ignore[return-value]

    def then(self, fn: Callable[[T], U]) -> Handle[U]:
        """A handle whose result is `fn` of this one's (for unpacking bytes into a tensor)."""
        return Handle(lambda: fn(self.wait()))


def _spent() -> None:
    raise AssertionError("unreachable: a handle's wait function runs once")


def poll_until_done(
    test: Callable[[], bool], timeout_s: float, what: Callable[[], str]
) -> None:
    """Wait for `test()` to turn true, or raise CollectiveTimeoutError after `timeout_s`.

    For engines whose blocking wait cannot be interrupted (MPI, Horovod): polling is the
    only way to turn a hang into an exception. It spins briefly (small messages finish in
    microseconds), then sleeps with backoff so that waiting ranks leave the cores to the
    ranks doing work (four ranks on two cores is normal in tests).
    """
    if test():
        return
    deadline = time.monotonic() + timeout_s
    for _ in range(200):
        if test():
            return
    pause = 1e-5
    while not test():
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(f"{what()} did not complete within {timeout_s:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)


def engine_failure(exc: BaseException, what: str) -> CollectiveError:
    """Wrap an engine's exception so it names the rank, the operation and the group."""
    text = str(exc)
    cls = CollectiveTimeoutError if "timed out" in text.lower() or "timeout" in text.lower() else CollectiveError
    return cls(f"{what} failed: {text}")
