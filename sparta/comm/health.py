"""What a communicator does around each engine collective: refuse once broken, watch each
handle (a failure breaks the communicator; a handle dropped unwaited is waited at the next
call, or at the world's shutdown), and share that state with the groups split from it.

`Watched` is the Communicator's base for this: every collective starts through its `_issue`,
and an engine marks failures found outside a wait with `_break`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from sparta.comm.handle import Handle
from sparta.errors import CollectiveError

T = TypeVar("T")


@dataclass
class Health:
    """Why a communicator is broken, or None; shared by the groups split from one world where
    the engine's failures reach them all (`Communicator.failures_span_world`)."""

    broken: str | None = None


class Family:
    """A communicator and the groups split from it (and from those): `finish_dropped`'s reach.
    Members are held weakly, but one with dropped handles not yet waited strongly (``holding``),
    so that a split the caller let go still completes, or reports, what it started."""

    def __init__(self) -> None:
        self.members: weakref.WeakSet[Watched] = weakref.WeakSet()
        self.holding: set[Watched] = set()
        # a finalizer may run on any thread, at any allocation (the garbage collector's), and
        # again inside these on the same thread
        self._lock = threading.RLock()

    def all(self) -> list[Watched]:
        with self._lock:
            return list({*self.members, *self.holding.copy()})  # (copied whole: a finalizer may add)

    def orphan(self, comm: Watched, raw: Handle[Any]) -> None:
        with self._lock:
            comm._orphans.append(raw)
            self.holding.add(comm)

    def release(self, comm: Watched) -> None:
        """Let go of ``comm`` once it holds no dropped handle."""
        with self._lock:
            if not comm._orphans:
                self.holding.discard(comm)

    def forget(self, comm: Watched) -> None:
        """Let go of ``comm`` and of the dropped handles it still holds (it is broken: they
        are never waited, since its ranks may disagree on them)."""
        with self._lock:
            comm._orphans.clear()
            self.holding.discard(comm)


class Watched:
    """The broken state and the dropped handles of one group (see the module docstring)."""

    def __init__(self) -> None:
        self._health = Health()
        self._orphans: list[Handle[Any]] = []  # engine handles whose watched handle was dropped
        self._family = Family()
        self._family.members.add(self)

    @property
    def broken(self) -> str | None:
        """Why this communicator refuses every collective (the failure that broke it, or its
        world's shutdown), or None."""
        return self._health.broken

    def _issue(self, op: str, start: Callable[[], Handle[T]]) -> Handle[T]:
        """Start one engine collective: refuse if broken, first wait the handles dropped
        unwaited, and watch the new one (its failure breaks the communicator; dropped
        unwaited, it joins the handles to wait)."""
        self._ready(op)
        try:
            raw = start()
        except CollectiveError as exc:
            self._break(str(exc))
            raise

        def wait() -> T:
            watch.detach()
            self._refuse_if_broken(op)
            try:
                return raw.wait()
            except CollectiveError as exc:
                self._break(str(exc))
                raise
            except BaseException as exc:  # Ctrl-C, a SIGTERM handler's SystemExit: the op may still run
                self._break(f"{op} was interrupted ({type(exc).__name__}) before it completed")
                raise

        watched = Handle(wait)
        # dropped unwaited: waited before the next call, this communicator held until then (Family)
        watch = weakref.finalize(watched, self._family.orphan, self, raw)
        watch.atexit = False
        return watched

    def _ready(self, op: str) -> None:
        self._refuse_if_broken(op)
        if self._wait_orphans() is not None:
            self._refuse_if_broken(op)

    def _wait_orphans(self) -> str | None:
        """Wait the dropped handles in order; the first failure breaks this communicator and
        is returned (the rest are never waited: the ranks may disagree on them)."""
        while self._orphans:
            try:
                self._orphans[0].wait()
            except CollectiveError as exc:
                self._break(f"{exc} (its handle was dropped without wait(), and waited at the next call)")
                return str(exc)
            except BaseException as exc:  # Ctrl-C: the op may still run, as in a watched wait
                self._break(f"the wait for a dropped handle's collective was interrupted ({type(exc).__name__})")
                raise
            self._orphans.pop(0)
        self._family.release(self)
        return None

    def finish_dropped(self) -> list[str]:
        """Wait the collectives whose handles were dropped without `wait()`, on this
        communicator and on every group split from it (one the caller has let go included),
        each within its timeout; returns one
        message per communicator where one failed or timed out (that communicator is broken
        after, as at any call). Not collective.

        `World.shutdown` calls it before the engine stops, so that a rank which ends right
        after dropping a handle still completes its part for the peers that join the
        collective later, and so that one its peers never join is reported instead of
        ending the job silently. Communicators already broken are skipped: their failure
        was raised when it happened."""
        failures = []
        for comm in self._family.all():
            failure = comm._wait_orphans() if comm.broken is None else None
            if comm.broken is not None:  # (a failed wait broke it)
                self._family.forget(comm)
            if failure is not None:
                failures.append(failure)
        return failures

    def _break(self, failure: str) -> None:
        """Refuse every later call: a collective failed (`failure`, the engine's error)."""
        self._retire(
            f"an earlier collective failed: {failure}. Its ranks may now disagree on which message comes "
            "next. Rebuild the world: call world.shutdown() and start the job again on every rank "
            "(e.g. torchrun --max-restarts, or your scheduler's retry)"
        )

    def _retire(self, why: str) -> None:
        """Refuse every later call, saying `why` (the first reason given stays)."""
        if self._health.broken is None:
            self._health.broken = why

    def _refuse_if_broken(self, op: str) -> None:
        if self._health.broken is not None:
            why = self._health.broken
            raise CollectiveError(f"{op}: this communicator is broken and refuses every collective: {why}.")
