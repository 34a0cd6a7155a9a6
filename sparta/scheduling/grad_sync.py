"""Adaptive gradient partitioning, issued: the dense gradients' all-reduce in pieces that travel
in the network gaps of an MoE layer's pipelined backward.

`partition_gradients` (partition.py) sizes the pieces from the cost model's gaps; this sends
them. The dense gradients are laid end to end in the order they become ready in backward
(the layers after the MoE layer first), cut at the partition's byte boundaries, and each piece
is a task of a sparta.comm PriorityQueue. A piece is released once its gradients are all
accumulated and the transfers before its gap are issued: the pipeline tells the exchange of
each transfer it issues (`issued`), and gap g opens after `openings[g]` backward transfers
(Timeline.gap_openings). A released piece is sent once the last of those transfers has
completed, not at once: the cost model's link carries one transfer at a time, but gloo would
run the piece's all-reduce beside the chunk still in flight and slow it, delaying the whole
pipeline. Completion is seen where the pipeline waits for that transfer (it waits for every
one, in order), so pieces go from the thread running backward and nothing waits on another
thread: a piece may leave later than the transfer's true end, by the compute the pipeline
does before it waits. Pieces planned for no gap (-1), and any whose gap never came (a
backward with fewer chunks than planned), go at `finish()`.

The pieces travel on their own communicator (a split of `comm` over all its ranks): the
helper thread's issue time depends on this rank's timing, and collectives on one
communicator must come in the same order on every rank. On their own one they do (the plan
fixes the pieces' order), whatever the interleaving with the exchange's transfers.

    sync = PartitionedAllReduce(world.comm, dense_params_in_ready_order, part, model_tl.gap_openings())
    exchange = sync.watch(hier)                  # give the MoE layer / pipeline this exchange
    sync.start(); loss.backward(); sync.finish() # p.grad now holds the average over ranks
    sync.close()                                 # at the end of training: the gradient hooks go
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from sparta.comm.communicator import Communicator
from sparta.comm.exchange import Exchange, PendingAllToAll
from sparta.comm.handle import Handle
from sparta.comm.priority import PriorityQueue, QueueConfig, TaskKey
from sparta.errors import ConfigError, InputError
from sparta.scheduling.partition import GradientPartition
from sparta.scheduling.trace import ObservedExchange


class PartitionedAllReduce:
    """Averages the gradients of `params` over `comm` in the pieces of `partition`.

    params: the dense parameters in the order their gradients become ready in backward (the
        same on every rank); one dtype. partition: pieces in bytes summing to their size.
    openings: for each gap index, the backward transfers after which it opens.
    Not thread-safe: one training loop drives it (a context manager: `close()` at exit).
    """

    def __init__(
        self,
        comm: Communicator,
        params: Sequence[torch.Tensor],
        partition: GradientPartition,
        openings: Sequence[int] = (),
    ) -> None:
        dtypes = {p.dtype for p in params}
        if not params or len(dtypes) != 1:
            raise ConfigError(f"PartitionedAllReduce: give one or more parameters of one dtype, got dtypes {dtypes}")
        size = next(iter(dtypes)).itemsize
        total = sum(p.numel() for p in params) * size
        if sum(partition.pieces) != total or any(n % size for n in partition.pieces):
            raise ConfigError(
                f"PartitionedAllReduce: the pieces {list(partition.pieces)} must sum to the parameters' "
                f"{total} bytes in whole {size}-byte elements; partition_gradients(total_bytes={total}, ...)"
            )
        if any(g >= len(openings) for g in partition.gaps):
            raise ConfigError(
                f"PartitionedAllReduce: pieces use gaps {sorted(set(partition.gaps))} but openings has "
                f"{len(openings)}; pass Timeline.gap_openings() of the timeline the gaps came from"
            )
        pieces_comm = comm.split(list(range(comm.size)))
        assert pieces_comm is not None  # every rank is in it
        self.comm, self.params, self.partition = pieces_comm, list(params), partition
        self.openings = tuple(openings)
        ends = torch.cumsum(torch.tensor([p.numel() for p in params]), 0).tolist()
        self._param_ends = ends  # flat end of each parameter, in ready order
        self._bounds = [0, *torch.cumsum(torch.tensor(partition.pieces) // size, 0).tolist()]
        self._keys = [TaskKey(k, f"dense.{k}") for k in range(len(partition.pieces))]
        # one piece per queue chunk: the partition already sized them
        self.queue = PriorityQueue(pieces_comm, QueueConfig(chunk_bytes=max(partition.pieces), chunks_per_ready=1))
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]
        self._started = False

    def __enter__(self) -> PartitionedAllReduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def watch(self, exchange: Exchange) -> ObservedExchange:
        """`exchange` (a Communicator, HierarchicalAllToAll, TracedExchange...) as the pipeline
        should get it: the same transfers, with this object told of each."""
        return _Watched(exchange, self)

    def start(self) -> None:
        """Begin a step: call before its backward, on every rank. A step whose backward
        raised before any piece left starts over here."""
        self.queue.expect(self._keys, ready_order=self._keys)
        self._ready = [False] * len(self.params)
        self._prefix = 0  # leading parameters (ready order) whose gradients are in
        self._transfers: list[_Transfer] = []  # this backward's transfers, in issue order
        self._next = 0  # pieces sent
        self._handles: list[Handle[torch.Tensor]] = []
        self._started = True

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self._started:
            return
        self._ready[self._index[id(p)]] = True
        while self._prefix < len(self._ready) and self._ready[self._prefix]:
            self._prefix += 1
        self._pump(final=False)

    def issued(self, name: str, transfer: _Transfer) -> None:
        """The pipeline issued `transfer`, named `name` ("bwd out 2", ...)."""
        if self._started and name.startswith("bwd"):
            self._transfers.append(transfer)
            self._pump(final=False)

    def completed(self) -> None:
        """A watched transfer's wait returned: pieces waiting behind it may go."""
        if self._started:
            self._pump(final=False)

    def _pump(self, final: bool) -> None:
        ready_elems = self._param_ends[self._prefix - 1] if self._prefix else 0
        while self._next < len(self._keys):
            k = self._next
            gap = self.partition.gaps[k]
            if self._bounds[k + 1] > ready_elems:
                if final:
                    missing = [i for i, r in enumerate(self._ready) if not r]
                    raise InputError(
                        f"PartitionedAllReduce.finish: parameters {missing} (ready order) got no gradient "
                        "this step; every rank must back-propagate into every dense parameter"
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
            self._handles.append(self.queue.submit(self._keys[k], self._piece(k), reduce="avg"))
            self._next += 1

    def _piece(self, k: int) -> torch.Tensor:
        """Elements [bounds[k], bounds[k+1]) of the gradients laid end to end."""
        lo, hi = self._bounds[k], self._bounds[k + 1]
        first = bisect.bisect_right(self._param_ends, lo)
        parts, at = [], lo
        for i in range(first, len(self.params)):
            start = self._param_ends[i] - self.params[i].numel()
            grad = self.params[i].grad
            assert grad is not None
            parts.append(grad.reshape(-1)[at - start : min(hi, self._param_ends[i]) - start])
            at = min(hi, self._param_ends[i])
            if at == hi:
                break
        return torch.cat(parts)

    def finish(self) -> None:
        """Send what is left, wait for every piece, write the averages into the gradients."""
        if not self._started:
            raise InputError("PartitionedAllReduce.finish without start(); call start() before backward")
        try:
            self._pump(final=True)
        finally:
            self._transfers = []
        flat = torch.cat([h.wait() for h in self._handles])
        for p, end in zip(self.params, self._param_ends, strict=True):
            assert p.grad is not None
            p.grad.copy_(flat[end - p.numel() : end].view_as(p.grad))
        self._started = False

    def close(self) -> None:
        """Remove the gradient hooks (idempotent); the parameters train on without it."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._started = False


class _Transfer:
    """A pipeline transfer's handle, and whether its wait has returned."""

    def __init__(self, handle: Handle[torch.Tensor]) -> None:
        self.handle, self.done = handle, False


class _Watched(ObservedExchange):
    """`inner` (any Exchange, e.g. a TracedExchange, which still traces) whose transfers are
    reported to a PartitionedAllReduce: each one as it is issued, and when its wait returns."""

    def __init__(self, inner: Exchange, sync: PartitionedAllReduce) -> None:
        self.inner, self.sync = inner, sync
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
            self.sync.completed()
            return got

        return PendingAllToAll(Handle(wait), started.send_splits, started.recv_splits)

    def issued(self, name: str) -> None:
        if isinstance(self.inner, ObservedExchange):
            self.inner.issued(name)
        assert self._last is not None, "the pipeline reports only transfers it started on this exchange"
        self.sync.issued(name, self._last)
