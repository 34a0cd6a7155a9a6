"""All-to-all through shared memory among the ranks of one host (torch engine, CPU tensors).

gloo moves every byte of a CPU all-to-all through loopback TCP, even between two processes
of one machine: the kernel copies it twice, and gloo's threads and the TCP stack take CPU
from the ranks' compute. On 2 CPU ranks an MoE layer's GEMMs ran 10% slower beside gloo's
exchanges than beside MPI's shared-memory ones (torch.profiler, benchmarks/moe_layer.py's
small config). This is the MPI way: each rank owns a ring of bytes in a file under
/dev/shm that every rank of the group maps. An all-to-all copies this rank's outgoing pieces
into its ring, then all-gathers, over the engine, one small row per rank: where each
destination's piece lies, and how many of the group's all-to-alls the rank has finished.
That all-gather is the only synchronisation: once it completes, every piece is in place and
each rank copies its own out of the others' rings (one copy in, one copy out, on the calling
thread). Either copy can go: a caller may write its rows straight into its ring (a ``Fill``),
and may borrow rows that all come from one peer where they lie in that peer's ring. A region
of a ring is reused once every rank has reported finishing the all-to-all that wrote it; a
ring too full for the next one is replaced by a larger one, and the old one unmapped once
drained. Every rank maps a new ring as soon as the all-to-all that announces it
completes, and its file is removed once every rank has finished that all-to-all: a name
lives in /dev/shm for about one exchange, so even a rank killed outright leaves little.
`World.shutdown` (and `World.exit`, which skips the interpreter's finalizers) closes every
group's rings (`close_all`).

Used only where every rank of the group shares the machine (boot id), the network namespace
(ranks of different emulated nodes, sparta.scheduling.cluster, must cross their shaped link)
and the /dev/shm file system, and by default only where the group has no more ranks than
the host has CPUs (`CommConfig.shared_memory`: "auto", "on", "off").
"""

from __future__ import annotations

import mmap
import os
import secrets
import weakref
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

import torch

from sparta.comm.handle import Handle
from sparta.errors import CollectiveError

SHM_DIR = "/dev/shm"
_MIN_RING_BYTES = 1 << 20
_ALIGN = 64
_OK, _FAILED = 0, 1

Fill = Callable[[torch.Tensor], None]
"""Writes an all-to-all's outgoing bytes into the flat uint8 buffer it is handed."""

AllGather = Callable[[torch.Tensor, str], Handle[torch.Tensor]]
"""Starts an all-gather of one int64 row per rank over the engine (the str names the
operation in errors); the handle gives the rows stacked, ``[size, len(row)]``, in rank order."""


def row_len(size: int) -> int:
    """Length of the int64 row each rank contributes to an all-to-all's gather."""
    return 3 + size


def host_identity() -> list[int]:
    """What two ranks must share to exchange through /dev/shm: the boot (one machine), the
    network namespace and the /dev/shm file system. All zeros where there is no /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = int(f.read().strip().replace("-", "")[:15], 16)
        shm = os.stat(SHM_DIR)
        return [boot, os.stat("/proc/self/ns/net").st_ino, shm.st_dev, shm.st_ino]
    except OSError:
        return [0, 0, 0, 0]


class _Ring:
    """One file of shared bytes, mapped. The owner creates it with its pages reserved, so a
    full /dev/shm fails here (OSError) instead of with SIGBUS at the first write."""

    def __init__(self, path: str, size: int = 0) -> None:
        create = size > 0
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)
            self.size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.path = path
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.live = 0  # regions not yet reclaimed (owner's rings only)

    def close(self) -> None:
        del self.bytes
        self._map.close()


@dataclass
class _Region:
    seq: int
    ring: _Ring
    start: int
    end: int


class SharedMemoryAllToAll:
    """The all-to-all of one communicator's ranks through /dev/shm. Not thread-safe: like
    every collective of a communicator, calls come in the same order on every rank."""

    def __init__(self, rank: int, size: int, token: int, all_gather: AllGather) -> None:
        self.rank, self.size = rank, size
        self._prefix = os.path.join(SHM_DIR, f"sparta-{token:016x}")
        self._all_gather = all_gather
        self._seq = 0  # all-to-alls started
        self._done_upto = 0  # every all-to-all below this one is finished here
        self._finished: set[int] = set()
        self._acked = 0  # every rank has finished every all-to-all below this one
        self._gen = -1
        self._ring: _Ring | None = None
        self._live: deque[_Region] = deque()
        self._owned: dict[str, _Ring] = {}
        self._announced: dict[str, int] = {}  # file -> the all-to-all that announced it
        self._peers: dict[tuple[int, int], _Ring] = {}
        self._finalizer = weakref.finalize(self, _close_all, self._owned, self._peers, os.getpid())
        _OPEN.add(self)

    def _path(self, rank: int, gen: int) -> str:
        return f"{self._prefix}-{rank}-{gen}"

    def files(self) -> list[str]:
        """The file names of this rank's rings (the current one, and older ones not yet
        drained); a name exists in /dev/shm only until every rank has mapped its ring."""
        return sorted(self._owned)

    def close(self) -> None:
        """Unmap every ring and remove this rank's files. Idempotent."""
        self._finalizer()
        self._ring = None
        self._live.clear()

    # ------------------------------------------------------------------ this rank's ring
    def _reclaim(self) -> None:
        while self._live and self._live[0].seq < self._acked:
            ring = self._live.popleft().ring
            ring.live -= 1
            if ring is not self._ring and ring.live == 0:
                _close_owned(self._owned, ring)

    def _fit(self, n: int) -> int | None:
        """Where ``n`` bytes fit in the current ring, after its live regions, or None."""
        assert self._ring is not None
        mine = [r for r in self._live if r.ring is self._ring]
        if not mine:
            return 0 if n <= self._ring.size else None
        # Regions start on cache lines, so that a region viewed as any dtype is aligned.
        first, last = mine[0].start, -(-mine[-1].end // _ALIGN) * _ALIGN
        if mine[-1].start >= first:  # not wrapped: free space after the last and before the first
            if self._ring.size - last >= n:
                return last
            return 0 if first >= n else None
        return last if first - last >= n else None

    def _allocate(self, n: int) -> tuple[_Ring, int]:
        self._reclaim()
        start = self._fit(n) if self._ring is not None else None
        if start is None:
            old = self._ring
            size = max(_MIN_RING_BYTES, 2 * n, 2 * old.size if old is not None else 0)
            self._gen += 1
            ring = _Ring(self._path(self.rank, self._gen), mmap.PAGESIZE * -(-size // mmap.PAGESIZE))
            self._owned[ring.path] = ring
            self._announced[ring.path] = self._seq
            self._ring = ring
            if old is not None and old.live == 0:
                _close_owned(self._owned, old)
            start = 0
        assert self._ring is not None
        self._ring.live += 1
        self._live.append(_Region(self._seq, self._ring, start, start + n))
        return self._ring, start

    # ------------------------------------------------------------------ the collective
    def all_to_all(
        self, buf: torch.Tensor | Fill, send: list[int], recv: list[int], op: str, borrow: bool = False
    ) -> Handle[torch.Tensor]:
        """Flat uint8 CPU ``buf`` cut into ``send`` byte counts per rank; the handle gives the
        ``sum(recv)`` received bytes, ordered by source rank. ``buf`` may instead be a
        ``Fill``, called once (before this returns) with the ``sum(send)`` bytes to write:
        they lie in this rank's ring, so the rows are not copied in. ``borrow``: where the
        bytes come from one rank, the handle gives them where they lie, a view valid until
        this rank's next all-to-all has run its fill (the ring's owner reuses the region
        only once this rank has reported the exchange done, in that all-to-all's row)."""
        seq, self._seq = self._seq, self._seq + 1
        send_at = [sum(send[:d]) for d in range(self.size)]
        row = torch.full((row_len(self.size),), -1, dtype=torch.int64)
        row[0], row[2] = _OK, self._done_upto
        fill = None if isinstance(buf, torch.Tensor) else buf
        # A filled buffer is one region, this rank's own bytes included.
        outgoing = sum(send) if fill is not None else sum(send) - send[self.rank]
        failure = ""
        ring: _Ring | None = None
        if outgoing:
            try:
                ring, at = self._allocate(outgoing)
            except OSError as exc:
                row[0] = _FAILED
                failure = f"{exc} (rank {self.rank} needed {outgoing} bytes under {SHM_DIR})"
            else:
                row[1] = self._gen
        if fill is not None:
            # Filled even when the ring failed: the caller's fill may do work it relies on.
            buf = ring.bytes[at : at + outgoing] if ring is not None else torch.empty(sum(send), dtype=torch.uint8)
            fill(buf)
            if ring is not None:
                for d in range(self.size):
                    if d != self.rank and send[d]:
                        row[3 + d] = at + send_at[d]
        elif ring is not None:
            for d in range(self.size):
                if d != self.rank and send[d]:
                    ring.bytes[at : at + send[d]].copy_(buf[send_at[d] : send_at[d] + send[d]])
                    row[3 + d] = at
                    at += send[d]
        gathered = self._all_gather(row, op)
        own = buf[send_at[self.rank] : send_at[self.rank] + send[self.rank]]

        def finish() -> torch.Tensor:
            rows = gathered.wait()
            failed = (rows[:, 0] == _FAILED).nonzero().flatten().tolist()
            if failed:
                raise CollectiveError(
                    f"{op}: rank(s) {failed} could not map shared memory for the exchange"
                    f"{': ' + failure if failure else ''}; "
                    f"enlarge {SHM_DIR} (docker run --shm-size) or pass CommConfig(shared_memory='off')"
                )

            def piece(src: int) -> torch.Tensor:
                if src == self.rank:
                    return own
                start = int(rows[src, 3 + self.rank])
                return self._peer(src, int(rows[src, 1])).bytes[start : start + recv[src]]

            sources = [src for src in range(self.size) if recv[src]]
            if borrow and len(sources) == 1:
                out = piece(sources[0])
            else:
                out = torch.empty(sum(recv), dtype=torch.uint8)
                at = 0
                for src in range(self.size):
                    if recv[src]:
                        out[at : at + recv[src]].copy_(piece(src))
                    at += recv[src]
            gens = rows[:, 1].tolist()
            for src, gen in enumerate(gens):
                if src != self.rank and gen >= 0:
                    self._peer(src, gen)  # map every announced ring now: its file goes soon
            self._acked = max(self._acked, int(rows[:, 2].min()))
            self._finish(seq, gens)
            return out

        return Handle(finish)

    def _peer(self, rank: int, gen: int) -> _Ring:
        ring = self._peers.get((rank, gen))
        if ring is None:
            ring = self._peers[(rank, gen)] = _Ring(self._path(rank, gen))
        return ring

    def _finish(self, seq: int, gens: list[int]) -> None:
        for path, announced in list(self._announced.items()):
            if announced < self._acked:  # every rank has mapped it
                del self._announced[path]
                _unlink(path)
        self._finished.add(seq)
        while self._done_upto in self._finished:
            self._finished.remove(self._done_upto)
            self._done_upto += 1
        if self._done_upto == self._seq:
            # No all-to-all of this rank is outstanding, and the later ones read each peer's
            # current ring or a newer one: the older rings' mappings can go.
            for rank, gen in list(self._peers):
                if gen < gens[rank]:
                    self._peers.pop((rank, gen)).close()


def _close_owned(owned: dict[str, _Ring], ring: _Ring) -> None:
    owned.pop(ring.path, None)
    ring.close()
    _unlink(ring.path)


def _unlink(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


def _close_all(owned: dict[str, _Ring], peers: dict[tuple[int, int], _Ring], creator: int) -> None:
    if os.getpid() != creator:
        return  # a forked child (a DataLoader worker) must not remove its parent's files
    for ring in list(owned.values()):
        _close_owned(owned, ring)
    for ring in peers.values():
        ring.close()
    peers.clear()


_OPEN: weakref.WeakSet[SharedMemoryAllToAll] = weakref.WeakSet()


def close_all() -> None:
    """Close every group's shared memory in this process (at shutdown)."""
    for exchange in list(_OPEN):
        exchange.close()


def group_token() -> int:
    """A random name for one group's files (rank 0's is used by all)."""
    return secrets.randbits(62)
