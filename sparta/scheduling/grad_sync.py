"""Adaptive gradient partitioning, released: when each of the dense all-reduce's pieces may
leave during an MoE layer's pipelined backward.

`partition_gradients` (partition.py) sizes the pieces from the cost model's network gaps;
`GapRelease` decides the moment each one goes. It owns no gradient hook and sends nothing:
the data-parallel piece that owns the hooks (`sparta.parallel.DataParallel(...,
partition=part, openings=...)`, strategy "sparta") tells it which gradients are in
(`ready`) and gets each released piece through the `send` callback it passed to `start`,
which it puts on its priority queue. One owner of hooks, one queue; this module is the policy.

The dense gradients are laid end to end in the order they become ready in backward (the
layers after the MoE layer first) and cut at the partition's byte boundaries. A piece is
released once its gradients are all in and the transfers before its gap are issued: the
pipeline tells the watched exchange (`watch`) of each transfer it issues, and gap g opens
after `openings[g]` backward transfers (`Timeline.gap_openings`). A released piece is sent
once the last of those transfers has completed, not at once: the cost model's link carries
one transfer at a time, but gloo would run the piece's all-reduce beside the chunk still in
flight and slow it, delaying the whole pipeline. Completion is seen where the pipeline waits
for that transfer (it waits for every one, in order), so pieces go from the thread running
backward, at the same point of every rank's program: nothing waits on another thread, and
a backward that raises leaves nothing behind. Pieces planned for no gap (-1), and any whose
gap never came (a backward with fewer chunks than planned), go at `finish`.

    release = GapRelease(part, openings=timeline.gap_openings())
    release.bind([p.numel() for p in ready_order], element_size=4)
    exchange = release.watch(hier)            # give the MoE layer / pipeline this exchange
    release.start(send)                       # send(k) puts piece k on the wire
    ... release.ready(i) as each gradient arrives (ready order) ...; release.finish()
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from sparta.comm.exchange import Exchange, PendingAllToAll
from sparta.comm.handle import Handle
from sparta.errors import ConfigError, InputError
from sparta.scheduling.partition import GradientPartition
from sparta.scheduling.trace import ObservedExchange


class GapRelease:
    """When piece k of `partition` may leave (see the module docstring).

    openings: for each gap index, the backward transfers after which it opens. `bind` gives
    the gradients' sizes before the first `start`.
    `released` counts the pieces sent this step. Not thread-safe: one training loop drives it.
    """

    def __init__(self, partition: GradientPartition, openings: Sequence[int]) -> None:
        if len(partition.gaps) != len(partition.pieces) or any(g >= len(openings) for g in partition.gaps):
            raise ConfigError(
                f"the gradient pieces use gaps {sorted(set(partition.gaps))} but openings has {len(openings)} "
                "entries; pass Timeline.gap_openings() of the timeline the gaps came from"
            )
        self.partition, self.openings = partition, tuple(openings)
        self.numels: list[int] = []
        self.ends: list[int] = []
        self.bounds: list[int] = []
        self.released = 0
        self._send: Callable[[int], None] | None = None
        self._ready: list[bool] = []
        self._prefix = 0
        self._transfers: list[_Transfer] = []

    def bind(self, numels: Sequence[int], element_size: int) -> None:
        """The gradients the pieces cut: elements of each, in the order backward makes them
        (the same on every rank), and bytes per element (one dtype for all). ConfigError
        unless the pieces cover them exactly in whole elements."""
        total = sum(numels) * element_size
        pieces = self.partition.pieces
        if not numels or sum(pieces) != total or any(n % element_size for n in pieces):
            raise ConfigError(
                f"the gradient pieces {list(pieces)} must sum to the dense parameters' {total} bytes in whole "
                f"{element_size}-byte elements; partition_gradients(total_bytes={total}, ..., "
                f"element_bytes={element_size})"
            )
        self.numels = [int(n) for n in numels]
        self.ends = torch.cumsum(torch.tensor(self.numels), 0).tolist()  # flat end of each gradient
        self.bounds = [0, *torch.cumsum(torch.tensor(pieces) // element_size, 0).tolist()]

    def __len__(self) -> int:
        return len(self.partition.pieces)

    def spans(self, k: int) -> list[tuple[int, int, int]]:
        """Piece k as (gradient index, first element, end element) slices, in order."""
        lo, hi = self.bounds[k], self.bounds[k + 1]
        out = []
        for i in range(bisect.bisect_right(self.ends, lo), len(self.numels)):
            start = self.ends[i] - self.numels[i]
            out.append((i, max(lo, start) - start, min(hi, self.ends[i]) - start))
            if self.ends[i] >= hi:
                break
        return out

    def watch(self, exchange: Exchange) -> ObservedExchange:
        """`exchange` (a Communicator, HierarchicalAllToAll, TracedExchange...) as the pipeline
        should get it: the same transfers, with this object told of each."""
        return _Watched(exchange, self)

    @property
    def active(self) -> bool:
        """Whether a step is under way (between `start` and its end)."""
        return self._send is not None

    def start(self, send: Callable[[int], None]) -> None:
        """Begin a step (before its backward, on every rank); `send(k)` puts piece k on the
        wire, called in piece order. A step whose backward raised starts over here."""
        if not self.bounds:
            raise InputError("GapRelease.start before bind(); give it the gradients' sizes first")
        self._send = send
        self._ready = [False] * len(self.numels)
        self._prefix = 0  # leading gradients (ready order) that are in
        self._transfers = []  # this backward's transfers, in issue order
        self.released = 0

    def ready(self, index: int) -> None:
        """Gradient `index` (ready order) is complete for this step."""
        if not self.active:
            return
        self._ready[index] = True
        while self._prefix < len(self._ready) and self._ready[self._prefix]:
            self._prefix += 1
        self._pump(final=False)

    def issued(self, name: str, transfer: _Transfer) -> None:
        """The pipeline issued `transfer`, named `name` ("bwd out 2", ...)."""
        if self.active and name.startswith("bwd"):
            self._transfers.append(transfer)
            self._pump(final=False)

    def completed(self) -> None:
        """A watched transfer's wait returned: pieces waiting behind it may go."""
        if self.active:
            self._pump(final=False)

    def finish(self) -> None:
        """Release every piece not released yet (each after the transfer before its gap);
        the gradients must all be `ready` (InputError otherwise) or made so by the caller."""
        if not self.active:
            raise InputError("GapRelease.finish without start(); call start() before backward")
        try:
            self._pump(final=True)
        finally:
            self._send, self._transfers = None, []

    def _pump(self, final: bool) -> None:
        assert self._send is not None
        ready_elems = self.ends[self._prefix - 1] if self._prefix else 0
        while self.released < len(self):
            k = self.released
            gap = self.partition.gaps[k]
            if self.bounds[k + 1] > ready_elems:
                if final:
                    missing = [i for i, r in enumerate(self._ready) if not r]
                    raise InputError(
                        f"gradients {missing} (ready order) are not in at the end of the step; every rank must "
                        "back-propagate into every dense parameter"
                    )
                return
            if not final and (gap < 0 or len(self._transfers) < self.openings[gap]):
                return
            opened = gap >= 0 and 0 < self.openings[gap] <= len(self._transfers)
            after = self._transfers[self.openings[gap] - 1] if opened else None
            if after is not None and not after.done:
                if not final:
                    return  # completed() comes back here once the pipeline has waited for it
                after.handle.wait()
            self.released += 1
            self._send(k)


class _Transfer:
    """A pipeline transfer's handle, and whether its wait has returned."""

    def __init__(self, handle: Handle[torch.Tensor]) -> None:
        self.handle, self.done = handle, False


class _Watched(ObservedExchange):
    """`inner` (any Exchange, e.g. a TracedExchange, which still traces) whose transfers are
    reported to a GapRelease: each one as it is issued, and when its wait returns."""

    def __init__(self, inner: Exchange, release: GapRelease) -> None:
        self.inner, self.release = inner, release
        self.size, self.rank, self.ranks = inner.size, inner.rank, inner.ranks
        self.tracer = inner.tracer if isinstance(inner, ObservedExchange) else None
        self._last: _Transfer | None = None

    @property
    def where(self) -> str:
        return self.inner.where

    def start_all_to_all(
        self,
        x: torch.Tensor,
        send_splits: Sequence[int] | None = None,
        recv_splits: Sequence[int] | None = None,
        check: bool | None = None,
    ) -> PendingAllToAll:
        started = self.inner.start_all_to_all(x, send_splits, recv_splits, check)
        transfer = self._last = _Transfer(started.handle)

        def wait() -> torch.Tensor:
            got = transfer.handle.wait()
            transfer.done = True
            self.release.completed()
            return got

        return PendingAllToAll(Handle(wait), started.send_splits, started.recv_splits)

    def issued(self, name: str) -> None:
        if isinstance(self.inner, ObservedExchange):
            self.inner.issued(name)
        assert self._last is not None, "the pipeline reports only transfers it started on this exchange"
        self.release.issued(name, self._last)
