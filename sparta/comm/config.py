"""`CommConfig`: how a communicator behaves (its timeout, and whether it checks inputs on every rank)."""

from __future__ import annotations

from dataclasses import dataclass

from sparta.errors import ConfigError


@dataclass(frozen=True)
class CommConfig:
    """How a communicator behaves.

    timeout_s: a collective that has not completed this many seconds after it started (its
        issue; on MPI, when its communicator's call thread began it) raises
        CollectiveTimeoutError naming the rank, the operation and the group (and leaves the
        communicator broken: see `Communicator.broken`). The world's is also the timeout of
        the 3D trainer's mesh groups (`sparta.parallel.build_layout`: pipeline send and
        receive, FSDP2, TP; on CUDA, that of NCCL's watchdog, which aborts the process).
    check_inputs: before a collective moves data, every rank learns every other rank's dtype,
        shape and verdict on its own arguments, so that bad input raises the same error on
        every rank instead of hanging or pairing messages wrongly. The all-to-all carries
        this on the split exchange it makes anyway when `recv_splits` is None, and the
        all-gather on its size exchange: free. An all-to-all given `recv_splits`, an
        all-reduce, reduce-scatter or broadcast pays one small blocking all-gather first
        (so `async_op=True` returns only after that round trip). A group of one checks
        locally, with no round trip. Measured on the torch engine (gloo, 2 CPU ranks on 2
        cores, 1 KiB, median of 2000 calls alternating with and without:
        `python benchmarks/collectives.py --engines torch --nprocs 2 --ops
        all_reduce,all_to_all -b 1K -e 1K -n 2000 --variants sparta,sparta+check`, two runs):
        all_reduce 0.85 ms without, 1.64-1.74 ms with; all_to_all 1.14 and 1.12-1.13 ms
        (no round of its own). Turn it off in tuned runs, or pass `check=False` to one call.
    """

    timeout_s: float = 300.0
    check_inputs: bool = True

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"CommConfig.timeout_s = {self.timeout_s} must be > 0 seconds")
