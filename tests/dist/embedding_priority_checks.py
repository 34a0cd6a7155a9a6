"""sparta.comm.priority on real processes: the same issue order on every rank whatever the
submission order and timing (in key order, and by the readiness schedule), and chunks that
reassemble exactly. Imported into the checks
of dist/embedding_checks.py, so they run in its launches on every engine."""

from __future__ import annotations

import random
import time

import torch
from runner import raises

from sparta.comm import World
from sparta.comm.priority import PriorityQueue, QueueConfig, TaskKey
from sparta.errors import InputError

KEYS = [TaskKey(0, "embedding"), TaskKey(1, "block.0"), TaskKey(1, "block.1"), TaskKey(2, "head"), TaskKey(3, "big")]
BIG, HEAD, BLOCK0, BLOCK1, EMB = KEYS[4], KEYS[3], KEYS[1], KEYS[2], KEYS[0]
# backward readiness: the huge low-priority task first, the embedding last. With 2 chunks
# placed per readiness, every later task overtakes the rest of "big" (20 chunks), waiting
# behind at most 2 of them; once all are ready, "big" finishes.
READY = [BIG, HEAD, BLOCK1, BLOCK0, EMB]
READY_LOG = [
    (BIG, 0), (BIG, 1), (HEAD, 0), (BIG, 2), (BLOCK1, 0), (BIG, 3), (BLOCK0, 0), (BIG, 4), (EMB, 0), (BIG, 5),
    *[(BIG, c) for c in range(6, 20)],
]  # fmt: skip


def payload(key: TaskKey, rank: int) -> torch.Tensor:
    n = 2500 if key.name == "big" else 7 + key.priority
    return torch.arange(n, dtype=torch.float64).view(-1, 1 if n % 2 else 2) * (rank + 1) + key.priority


def check_priority_queue_order_and_reassembly(world: World) -> None:
    comm = world.comm
    config = QueueConfig(chunk_bytes=1024, max_in_flight=3, chunks_per_ready=2)  # "big": 20 chunks of 128
    queue = PriorityQueue(comm, config)
    for round_, ready, want_log in ((0, None, None), (1, READY, READY_LOG), (2, READY, READY_LOG)):
        queue.expect(reversed(KEYS), ready)
        order = KEYS[:]
        random.Random(comm.rank * 10 + round_).shuffle(order)  # each rank its own order and pace
        handles = {}
        for key in order:
            time.sleep(random.Random(comm.rank + round_).random() * 0.01)
            reduce = "avg" if key.name == "head" else "sum"
            handles[key] = queue.submit(key, payload(key, comm.rank), reduce=reduce)
        for key, handle in handles.items():
            want = sum(payload(key, r) for r in range(comm.size)) / (comm.size if key.name == "head" else 1)
            torch.testing.assert_close(handle.wait(), want, rtol=0, atol=1e-9)
        want_log = want_log or [(k, c) for k in KEYS for c in range(20 if k.name == "big" else 1)]
        assert queue.issue_log == want_log, (round_, queue.issue_log[:12])
    # a donated task: summed in place, chunk by chunk, where the engine can (torch): no copy back
    queue.expect([TaskKey(0, "donated")])
    scratch = payload(BIG, comm.rank).clone()  # 20 chunks
    got = queue.submit(TaskKey(0, "donated"), scratch, check=False, donate=True).wait()
    torch.testing.assert_close(got, sum(payload(BIG, r) for r in range(comm.size)), rtol=0, atol=1e-9)
    assert (got is scratch) == (comm.backend == "torch"), comm.backend
    # a strided one (a transposed view) is summed into a copy and comes back as the sum all the same
    queue.expect([TaskKey(0, "strided")])
    strided = torch.arange(12.0).view(3, 4).t() * (comm.rank + 1)
    got = queue.submit(TaskKey(0, "strided"), strided, check=False, donate=True).wait()
    torch.testing.assert_close(got, torch.arange(12.0).view(3, 4).t() * sum(range(1, comm.size + 1)), rtol=0, atol=0)
    # an all-to-all task: rank r sends s + 1 rows to rank s
    queue.expect([TaskKey(0, "rows")])
    rows = torch.cat([torch.full((s + 1, 2), float(comm.rank)) for s in range(comm.size)])
    send, recv = [s + 1 for s in range(comm.size)], [comm.rank + 1] * comm.size
    got = queue.submit(TaskKey(0, "rows"), rows, op="all_to_all", send_splits=send, recv_splits=recv).wait()
    want = torch.arange(comm.size, dtype=torch.float32).repeat_interleave(comm.rank + 1).unsqueeze(1).expand(-1, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def check_priority_queue_misuse_raises_before_issuing(world: World) -> None:
    queue = PriorityQueue(world.comm)
    queue.expect(KEYS[:2])
    late = queue.submit(KEYS[1], torch.ones(3))  # its predecessor is missing: nothing is issued
    assert queue.issue_log == []
    with raises(InputError, "waits behind unsubmitted \\[TaskKey\\(priority=0, name='embedding'\\)\\]"):
        late.wait()
    with raises(InputError, "is not in this round"):
        queue.submit(TaskKey(9, "stranger"), torch.ones(1))
    with raises(InputError, "still waits for"):
        queue.expect(KEYS)
    queue.submit(KEYS[0], torch.ones(2))
    torch.testing.assert_close(late.wait(), torch.full((3,), float(world.size)))
    with raises(InputError, "must list exactly the round's keys"):
        queue.expect(KEYS[:2], KEYS[:1])


PRIORITY_CHECKS = [check_priority_queue_order_and_reassembly, check_priority_queue_misuse_raises_before_issuing]
