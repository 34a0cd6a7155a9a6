"""A peer stage's failure as `ParallelModel.step` reports it.

When a stage fails inside torch's schedule, its pipeline peers wait in torch's
point-to-point until a receive times out or the failed process closes its connection. What
torch raises then names neither the rank nor the pipeline; `lost_peer_stage` tells that
failure apart from the stage's own errors and `peer_stage_failure` restates it naming this
rank, its stages and its pipeline. (The forward-only pass of `evaluate` hands failures down
the pipeline itself: forward_only.py.)
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence

from sparta.errors import CollectiveError, CollectiveTimeoutError, SpartaError

# gloo's words for a receive that timed out and for a connection its peer closed
_LOST_PEER_WORDS = ("timed out", "connection closed", "connection reset", "broken pipe")


def lost_peer_stage(exc: BaseException) -> bool:
    """Whether torch's schedule failed in its point-to-point with a peer stage (a receive
    that timed out, a connection the peer closed), not in the stage's own compute nor in
    its FSDP2 or TP collectives: those fail with the same words on other groups, so only
    the frame of the schedule's send/receive wait (`_wait_batch_p2p`) tells them apart."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, SpartaError):  # a SpartaError names its group
        return False
    text = str(exc).lower()
    in_p2p = any(frame.name == "_wait_batch_p2p" for frame in traceback.extract_tb(exc.__traceback__))
    return in_p2p and any(word in text for word in _LOST_PEER_WORDS)


def peer_stage_failure(
    exc: BaseException, rank: int, stage_ids: Sequence[int], pp_ranks: Sequence[int], timeout_s: float
) -> CollectiveError:
    """``exc`` (a `lost_peer_stage`) as an error naming world ``rank``, its pipeline
    ``stage_ids`` and the world ranks of its pipeline; ``timeout_s``: the world
    communicator's `CommConfig.timeout_s` (seconds), which the mesh's groups take. A
    timeout gives CollectiveTimeoutError, a closed connection CollectiveError."""
    kind = CollectiveTimeoutError if "timed out" in str(exc).lower() else CollectiveError
    return kind(
        f"rank {rank} (pipeline stage(s) {list(stage_ids)} of the pipeline over ranks {list(pp_ranks)}): torch's "
        f"schedule stopped waiting for a peer stage: {exc}. A peer stage failed (its rank's own error says why) or "
        f"stalled past CommConfig.timeout_s = {timeout_s:g} s; the pipeline's messages are lost: restart the job on "
        "every rank (from the last checkpoint)"
    )
