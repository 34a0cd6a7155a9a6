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
        """A handle whose result is ``value`` already."""
        handle: Handle[T] = cls(lambda: value)
        return handle

    def wait(self) -> T:
        """Block until the collective is done and return its result (again on later calls)."""
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


def poll_until_done(test: Callable[[], bool], timeout_s: float, what: Callable[[], str], since: float) -> None:
    """Wait for `test()` to turn true, or raise CollectiveTimeoutError `timeout_s` after
    `since` (`time.monotonic()` when the collective was issued: k collectives that peers
    never join then time out together, not one timeout after another).

    For engines whose blocking wait cannot be interrupted (MPI, Horovod): polling is the
    only way to turn a hang into an exception. MPI progresses non-blocking collectives only
    inside MPI calls, so the first milliseconds spin on `test` as a blocking call would.
    Yielding the core while spinning was measured to cost a scheduler timeslice per turn on
    a loaded machine (0.2 ms became 3 ms), so the spin is pure; after it the wait sleeps with
    backoff, leaving the cores to the ranks that still have work.
    """
    start = time.monotonic()
    spin_until, deadline = start + _SPIN_S, since + timeout_s
    while not test():
        now = time.monotonic()
        if now < spin_until:
            continue
        if now > deadline:
            raise CollectiveTimeoutError(f"{what()} did not complete within {timeout_s:g} s")
        time.sleep(min(_MAX_SLEEP_S, (now - start) / 50))


_SPIN_S = 0.002
_MAX_SLEEP_S = 1e-3


def engine_failure(exc: BaseException, what: str) -> CollectiveError:
    """Wrap an engine's exception so it names the rank, the operation and the group."""
    text = str(exc)
    cls = CollectiveTimeoutError if "timed out" in text.lower() or "timeout" in text.lower() else CollectiveError
    return cls(f"{what} failed: {text}")
