"""Hybrid data parallelism: a small transformer LM trained 20 steps with nn.Embedding under
plain DDP (or Horovod; one process on the global batch under MPI) and with SparseEmbedding
via `parallelize` (DDP / Horovod, and the PriorityQueue's "sparta" mode) gives the same losses,
also with the output projection tied to the token embedding (`tie_output=True`), and with the
dense step deferred into the next forward (`defer_dense_step=True`: exactly the same losses).

Run under torchrun, horovodrun and mpirun by tests/embedding/test_hybrid_dist.py.
"""

from __future__ import annotations

import gc
import zlib

import torch
import torch.nn.functional as F
from runner import finish, run_checks, start
from torch import nn

from sparta.comm import QueueConfig, World
from sparta.comm.priority import TaskKey
from sparta.embedding import HybridOptimizer, QueuedGradients, SparseEmbedding, VocabParallelHead, parallelize

VOCAB, DIM, SEQ, BATCH, STEPS = 96, 16, 10, 3, 20


class TinyLM(nn.Module):
    """Token + position embeddings, one causal transformer block, a linear head (tied: the
    token table, which `tie_output=True` turns into a VocabParallelHead)."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.pos = nn.Embedding(SEQ, DIM)
        self.block = nn.TransformerEncoderLayer(DIM, 2, 32, dropout=0.0, batch_first=True)
        self.head: nn.Module = nn.Linear(DIM, VOCAB, bias=not tied)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        hidden = self.block(x, src_mask=mask, is_causal=True)
        if isinstance(self.head, VocabParallelHead):  # the one line a tied model changes
            return self.head(hidden, targets)
        return F.cross_entropy(self.head(hidden).flatten(0, 1), targets.flatten())


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    seq = (torch.rand(BATCH, SEQ + 1, generator=gen) ** 2 * VOCAB).long()  # skewed: low ids repeat
    return seq[:, :-1], seq[:, 1:]


def train(model: nn.Module, opt: object, rank: int) -> list[float]:
    losses = []
    for step in range(STEPS):
        ids, targets = batch(step, rank)
        loss = model(ids, targets)
        loss.backward()
        opt.step()  # type: ignore[attr-defined]
        opt.zero_grad()  # type: ignore[attr-defined]
        losses.append(loss.item())
    return losses


def adam(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)  # type: ignore[arg-type]


def single_process(world: World, tied: bool) -> list[float]:
    """One process, the mean of every rank's loss (what data parallelism computes)."""
    torch.manual_seed(0)
    model = TinyLM(tied)
    opt = adam(model.parameters())
    losses = []
    for step in range(STEPS):
        per_rank = [model(*batch(step, r)) for r in range(world.size)]
        (sum(per_rank) / world.size).backward()
        opt.step()
        opt.zero_grad()
        losses.append(per_rank[world.rank].item())
    return losses


def baseline(world: World, tied: bool = False) -> list[float]:
    """nn.Embedding and the engine's own data parallelism (dense gradients)."""
    if world.backend == "mpi":
        return single_process(world, tied)
    torch.manual_seed(0)
    model = TinyLM(tied)
    if world.backend == "torch":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return train(DDP(model, process_group=world.comm.pg), adam(model.parameters()), world.rank)
    import horovod.torch as hvd

    opt = hvd.DistributedOptimizer(adam(model.parameters()), named_parameters=list(model.named_parameters()))
    return train(model, opt, world.rank)


def check_lm_losses_match_dense_data_parallel(world: World) -> None:
    want = {tied: baseline(world, tied) for tied in (False, True)}
    queue = QueueConfig(chunk_bytes=1024, max_in_flight=3)  # several chunks per weight matrix
    runs = [("row", "auto", False), ("column", "auto", False), ("row", "sparta", False), ("row", "sparta", True)]
    queued_losses = {}
    for sharding, mode, tied, defer in [(*run, False) for run in runs] + [("row", "sparta", True, True)]:
        torch.manual_seed(0)
        model = TinyLM(tied)
        wrapped, opt = parallelize(
            model, world.comm, adam, mode, sharding, queue, tie_output=tied, defer_dense_step=defer
        )
        assert isinstance(model.tok, SparseEmbedding) and isinstance(model.pos, SparseEmbedding)
        assert isinstance(model.head, VocabParallelHead) == tied
        overlapped = watch_lookups(model, opt) if defer else []
        got = train(wrapped, opt, world.rank)
        if mode == "sparta":
            queued_losses[tied, defer] = got
        if defer:
            if world.backend != "horovod":  # whose timing-dependent fusion changes last bits (embedding_checks.py)
                assert got == queued_losses[tied, False], "the deferred dense step changed the numerics"
            assert overlapped == [False] + [True] * (STEPS - 1), overlapped
        torch.testing.assert_close(
            torch.tensor(got), torch.tensor(want[tied]), rtol=2e-4, atol=2e-5, msg=f"{sharding} {mode} tied={tied}"
        )
        mean = world.comm.all_reduce(torch.tensor(got), op="avg")  # one rank's 30 tokens are noisy
        first, last = float(mean[:5].mean()), float(mean[-5:].mean())
        assert last < first - 0.1, f"the LM did not learn: {first:.3f} -> {last:.3f}"
        if mode == "sparta":
            queued = opt.deferred.queued if defer else opt.before_step["dense"].__self__  # type: ignore[attr-defined]
            check_queue_schedule(world, queued)


def watch_lookups(model: nn.Module, opt: HybridOptimizer) -> list[bool]:
    """Per forward: whether the last dense all-reduce the queue issued in the step before was
    still unwaited (its parameter not stepped) when the token table's lookup was issued.
    Each forward must also end with every dense parameter stepped."""
    deferred = opt.deferred
    assert deferred is not None
    queue, keys = deferred.queued.queue, deferred.queued.dense
    dense_keys = set(keys.values())
    last: list[TaskKey | None] = []
    seen: list[bool] = []

    def before_round(module: nn.Module, args: object) -> None:  # before the round's expect() resets the log
        dense = [key for key, _ in queue.issue_log if key in dense_keys]
        last.append(dense[-1] if dense else None)

    def after(module: nn.Module, args: object, out: object) -> None:
        assert not deferred.pending, f"the forward left {[keys[p].name for p in deferred.pending]} unstepped"

    model.register_forward_pre_hook(before_round, prepend=True)
    model.tok.register_forward_pre_hook(lambda m, a: seen.append(last[-1] in {keys[p] for p in deferred.pending}))
    model.register_forward_hook(after)
    return seen


def check_queue_schedule(world: World, queued: QueuedGradients) -> None:
    """The last round's issue order is the same on every rank; it starts with the gradient
    backward makes first, and the position table's all-to-all, ready late but of high
    priority, overtook the remaining chunks of a task ready before it."""
    log = [(key.name, chunk) for key, chunk in queued.queue.issue_log]
    everyone = world.comm.all_gather(torch.tensor([zlib.crc32(repr(log).encode())]))
    assert len({int(h) for h in everyone}) == 1, f"ranks issued in different orders: {log[:6]}"
    names = [name for name, _ in log]
    assert names[0] == queued.ready_order[0].name, (names[:3], queued.ready_order[:3])
    assert {"tok.weight", "pos.weight"} <= set(names), names
    last_chunk = {name: i for i, name in enumerate(names)}
    pos = names.index("pos.weight")
    assert any(last_chunk[n] > pos for n in names[:pos]), f"pos.weight overtook nothing: {names}"


CHECKS = [check_lm_losses_match_dense_data_parallel]

if __name__ == "__main__":
    world, _ = start()
    failures = run_checks(world, CHECKS)
    gc.collect()  # DDP's reducer must go before its process group, or the exit aborts
    finish(world, failures)
