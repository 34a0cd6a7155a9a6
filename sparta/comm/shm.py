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
thread). A region of a ring is reused once every rank has reported finishing the all-to-all
that wrote it; a ring too full for the next one is replaced by a larger one, and the old one
unmapped once drained. Every rank maps a new ring as soon as the all-to-all that announces it
completes, and its file is removed once every rank has finished that all-to-all: a name
lives in /dev/shm for about one exchange, so even a rank killed outright leaves little.
`World.shutdown` (and `World.exit`, which skips the interpreter's finalizers) closes every
group's rings (`close_all`).

Peers are local when they share the machine (boot id), the network namespace (ranks of
different emulated nodes, sparta.scheduling.cluster, must cross their shaped link) and the
/dev/shm file system. In a group that spans several hosts, rows for local peers go through
shared memory and the rest through the engine's own all-to-all (gloo), started together, as
NCCL and MPI mix their shared-memory and network transports. `CommConfig(shared_memory=False)`
turns it off.
"""

from __future__ import annotations

import mmap
import os
import secrets
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass

import torch

from sparta.comm.handle import Handle
from sparta.errors import CollectiveError

SHM_DIR = "/dev/shm"
_MIN_RING_BYTES = 1 << 20
_OK, _FAILED = 0, 1

AllGather = Callable[[torch.Tensor, str], Handle[list[torch.Tensor]]]
"""Starts an all-gather of one int64 row per rank over the engine (the str names the
operation in errors); the handle gives the rows, in rank order."""
EngineAllToAll = Callable[[torch.Tensor, torch.Tensor, list[int], list[int], str], Handle[torch.Tensor]]
"""Starts the engine's all-to-all of flat uint8 bytes: (send, out, send counts, recv counts, op)."""


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
    """The all-to-all of one communicator's ranks, through /dev/shm between ``local`` peers
    (a bool per rank) and through ``engine`` between the others (None when all are local).
    Not thread-safe: like every collective of a communicator, calls come in the same order
    on every rank."""

    def __init__(
        self,
        rank: int,
        size: int,
        token: int,
        all_gather: AllGather,
        local: Sequence[bool] | None = None,
        engine: EngineAllToAll | None = None,
    ) -> None:
        self.rank, self.size = rank, size
        self.local = tuple(local) if local is not None else (True,) * size
        if not all(self.local) and engine is None:
            raise ValueError("peers outside this host need the engine's all-to-all")
        self._engine = engine if not all(self.local) else None
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
        self._finalizer = weakref.finalize(self, _close_all, self._owned, self._peers)
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
        first, last = mine[0].start, mine[-1].end
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
    def all_to_all(self, buf: torch.Tensor, send: list[int], recv: list[int], op: str) -> Handle[torch.Tensor]:
        """Flat uint8 CPU ``buf`` cut into ``send`` byte counts per rank; the handle gives the
        ``sum(recv)`` received bytes, ordered by source rank."""
        seq, self._seq = self._seq, self._seq + 1
        send_at = [sum(send[:d]) for d in range(self.size)]
        recv_at = [sum(recv[:s]) for s in range(self.size)]
        shared = [d for d in range(self.size) if self.local[d] and d != self.rank]
        row = torch.full((3 + self.size,), -1, dtype=torch.int64)
        row[0], row[2] = _OK, self._done_upto
        outgoing = sum(send[d] for d in shared)
        failure = ""
        if outgoing:
            try:
                ring, at = self._allocate(outgoing)
            except OSError as exc:
                row[0] = _FAILED
                failure = f"{exc} (rank {self.rank} needed {outgoing} bytes under {SHM_DIR})"
            else:
                row[1] = self._gen
                for d in shared:
                    if send[d]:
                        ring.bytes[at : at + send[d]].copy_(buf[send_at[d] : send_at[d] + send[d]])
                        row[3 + d] = at
                        at += send[d]
        gathered = self._all_gather(row, op)
        out = torch.empty(sum(recv), dtype=torch.uint8)
        networked = self._start_engine(buf, out, send, recv, op)

        def finish() -> torch.Tensor:
            rows = torch.stack(gathered.wait())
            if networked is not None:
                networked.wait()
            failed = (rows[:, 0] == _FAILED).nonzero().flatten().tolist()
            if failed:
                raise CollectiveError(
                    f"{op}: rank(s) {failed} could not map shared memory for the exchange"
                    f"{': ' + failure if failure else ''}; "
                    f"enlarge {SHM_DIR} (docker run --shm-size) or pass CommConfig(shared_memory=False)"
                )
            at, n = recv_at[self.rank], recv[self.rank]
            out[at : at + n].copy_(buf[send_at[self.rank] : send_at[self.rank] + n])
            for src in shared:
                if recv[src]:
                    gen, start = int(rows[src, 1]), int(rows[src, 3 + self.rank])
                    ring = self._peer(src, gen)
                    out[recv_at[src] : recv_at[src] + recv[src]].copy_(ring.bytes[start : start + recv[src]])
            gens = rows[:, 1].tolist()
            for src in shared:
                if gens[src] >= 0:
                    self._peer(src, gens[src])  # map every announced ring now: its file goes soon
            self._acked = max(self._acked, int(rows[:, 2].min()))
            self._finish(seq, gens)
            return out

        return Handle(finish)

    def _start_engine(
        self, buf: torch.Tensor, out: torch.Tensor, send: list[int], recv: list[int], op: str
    ) -> Handle[None] | None:
        """The rows for peers on other hosts, through the engine (zero counts for the local
        ones). Nodes hold consecutive ranks, so those rows are usually one run of ``buf`` and
        of ``out``; otherwise they are packed and unpacked around the engine."""
        if self._engine is None:
            return None
        remote = [not local for local in self.local]
        send_remote = [n if far else 0 for n, far in zip(send, remote, strict=True)]
        recv_remote = [n if far else 0 for n, far in zip(recv, remote, strict=True)]
        packed = _run(buf, send, remote)
        unpacked = _run(out, recv, remote)
        landing = unpacked if unpacked is not None else torch.empty(sum(recv_remote), dtype=torch.uint8)
        handle = self._engine(
            packed if packed is not None else _pack(buf, send, remote), landing, send_remote, recv_remote, op
        )

        def wait() -> None:
            handle.wait()
            if unpacked is None:
                _unpack(landing, out, recv, remote)

        return Handle(wait)

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


def _close_all(owned: dict[str, _Ring], peers: dict[tuple[int, int], _Ring]) -> None:
    for ring in list(owned.values()):
        _close_owned(owned, ring)
    for ring in peers.values():
        ring.close()
    peers.clear()


def _pieces(counts: list[int], chosen: list[bool]) -> list[tuple[int, int]]:
    """(offset, length) of the chosen ranks' non-empty pieces in a buffer cut by ``counts``."""
    offsets = [sum(counts[:r]) for r in range(len(counts))]
    return [(offsets[r], counts[r]) for r in range(len(counts)) if chosen[r] and counts[r]]


def _run(buf: torch.Tensor, counts: list[int], chosen: list[bool]) -> torch.Tensor | None:
    """The chosen ranks' pieces as a view of ``buf`` where they are one run, else None."""
    pieces = _pieces(counts, chosen)
    if not pieces:
        return buf[:0]
    first, (last, length) = pieces[0][0], pieces[-1]
    return buf[first : last + length] if last + length - first == sum(n for _, n in pieces) else None


def _pack(buf: torch.Tensor, counts: list[int], chosen: list[bool]) -> torch.Tensor:
    return torch.cat([buf[at : at + n] for at, n in _pieces(counts, chosen)])


def _unpack(packed: torch.Tensor, out: torch.Tensor, counts: list[int], chosen: list[bool]) -> None:
    at_packed = 0
    for at, n in _pieces(counts, chosen):
        out[at : at + n].copy_(packed[at_packed : at_packed + n])
        at_packed += n


_OPEN: weakref.WeakSet[SharedMemoryAllToAll] = weakref.WeakSet()


def close_all() -> None:
    """Close every group's shared memory in this process (at shutdown)."""
    for exchange in list(_OPEN):
        exchange.close()


def group_token() -> int:
    """A random name for one group's files (rank 0's is used by all)."""
    return secrets.randbits(62)
