"""All-gather of one small int64 row per rank through /dev/shm, for the shared-memory all-to-all.

`sparta.comm.shm` copies an all-to-all's rows through shared memory but needs every rank to
learn where the others put theirs: one small row per rank, all-gathered. Through gloo that
gather costs 0.25 ms on an idle 2-CPU machine and 1-3 ms beside compute, the wake-ups of
gloo's threads and the waiting rank's on both sides (`benchmarks/moe_layer.py`, 2 ranks: an
MoE layer's step ran six of them). Here each rank owns a small file of `SLOTS` slots; the
gather of sequence number `s` writes this rank's row into slot `s % SLOTS` of its own file,
stamps it `s + 1`, and the wait polls the peers' stamps (`poll_until_done`: a short spin,
then sleeps with backoff, and `CollectiveTimeoutError` after the communicator's timeout).
Nothing runs in the background: a row is published when its gather starts.

A slot is rewritten only once every peer has read its last row: each file's header holds how
many gathers its owner has read completely (in order), and a writer `SLOTS` gathers ahead
waits for it. The stamp is written after the row, and x86's ordering of stores (and of loads)
makes a reader that sees the stamp see the row; other CPUs can reorder them, so elsewhere the
all-to-all keeps gloo's gather (`ordered_stores()`).

The files are made before the group's shared-memory set-up (a gloo collective), mapped by
every rank after it, and unlinked by their owner once every rank has mapped them (after one
more gloo collective), so that nothing stays in /dev/shm while the group lives.
"""

from __future__ import annotations

import mmap
import os
import platform

import torch

from sparta.comm.handle import Handle, poll_until_done
from sparta.comm.shm import SHM_DIR

SLOTS = 64
_HEADER = 8  # int64 words before the slots; word 0: gathers this rank has read, in order


def ordered_stores() -> bool:
    """Whether this CPU orders the stores and loads that the stamps rely on (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def control_path(token: int) -> str:
    """The name of the control file of the rank that drew ``token``."""
    return os.path.join(SHM_DIR, f"sparta-rows-{token:016x}")


class _Mapped:
    """One control file, mapped: ``words`` (int64, for polling from Python) and ``rows``
    (a ``[SLOTS, 1 + row_len]`` tensor view: stamp, then the row)."""

    def __init__(self, path: str, row_len: int, create: bool) -> None:
        size = 8 * (_HEADER + SLOTS * (1 + row_len))
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.words = memoryview(self._map).cast("q")
        flat = torch.frombuffer(self._map, dtype=torch.int64)
        self.rows = flat[_HEADER:].view(SLOTS, 1 + row_len)

    def close(self) -> None:
        del self.rows
        self.words.release()
        self._map.close()


class SharedRowGather:
    """The all-gather `sparta.comm.shm.SharedMemoryAllToAll` synchronises with: every rank's
    int64 row of ``row_len``, ``[size, row_len]`` in rank order. Calls come in the same order
    on every rank (like every collective of a communicator); handles may be waited in any
    order. ``paths[r]`` is rank ``r``'s control file; this rank's must exist (``create``)."""

    def __init__(self, rank: int, paths: list[str], row_len: int, timeout_s: float) -> None:
        self.rank, self.size, self.row_len, self.timeout_s = rank, len(paths), row_len, timeout_s
        self._files = [_Mapped(p, row_len, create=False) for p in paths]
        self._started = 0  # gathers started here
        self._read: set[int] = set()  # gathers read here, above the in-order count
        self._read_upto = 0

    @staticmethod
    def create(path: str, row_len: int) -> None:
        """Make (zeroed) and close this rank's control file, before the peers map it."""
        _Mapped(path, row_len, create=True).close()

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files = []

    def _slot_word(self, seq: int) -> int:
        return _HEADER + (seq % SLOTS) * (1 + self.row_len)

    def gather(self, row: torch.Tensor, op: str) -> Handle[torch.Tensor]:
        seq, self._started = self._started, self._started + 1
        files = self._files

        def peers_done_reading() -> bool:
            return all(f.words[0] > seq - SLOTS for f in files)

        if seq >= SLOTS and not peers_done_reading():
            poll_until_done(peers_done_reading, self.timeout_s, lambda: self._late(op, seq - SLOTS + 1, header=True))
        mine = files[self.rank]
        mine.rows[seq % SLOTS, 1:].copy_(row)
        mine.words[self._slot_word(seq)] = seq + 1  # after the row: a reader that sees it sees the row

        def arrived() -> bool:
            word = self._slot_word(seq)
            return all(f.words[word] == seq + 1 for f in files)

        def wait() -> torch.Tensor:
            if not arrived():
                poll_until_done(arrived, self.timeout_s, lambda: self._late(op, seq + 1))
            out = torch.stack([f.rows[seq % SLOTS, 1:] for f in files])
            self._mark_read(seq)
            return out

        return Handle(wait)

    def _mark_read(self, seq: int) -> None:
        self._read.add(seq)
        while self._read_upto in self._read:
            self._read.remove(self._read_upto)
            self._read_upto += 1
        self._files[self.rank].words[0] = self._read_upto

    def _late(self, op: str, stamp: int, header: bool = False) -> str:
        if header:
            late = [r for r, f in enumerate(self._files) if f.words[0] < stamp]
            return f"{op}: rank(s) {late} have not read this rank's earlier rows (shared-memory sync)"
        word = self._slot_word(stamp - 1)
        late = [r for r, f in enumerate(self._files) if f.words[word] != stamp]
        return f"{op}: rank(s) {late} never joined (shared-memory sync, rank {self.rank} waited)"
