"""Hybrid data parallelism: a small transformer LM trained 20 steps with nn.Embedding under
plain DDP (or Horovod; one process on the global batch under MPI) and with SparseEmbedding
via `parallelize` (DDP / Horovod, and the PriorityQueue's "sparta" mode) gives the same losses.

Run under torchrun, horovodrun and mpirun by tests/embedding/test_hybrid_dist.py.
"""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from runner import finish, run_checks, start
from torch import nn

from sparta.comm import QueueConfig, World
from sparta.embedding import SparseEmbedding, parallelize

VOCAB, DIM, SEQ, BATCH, STEPS = 96, 16, 10, 3, 20


class TinyLM(nn.Module):
    """Token + position embeddings, one causal transformer block, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.pos = nn.Embedding(SEQ, DIM)
        self.block = nn.TransformerEncoderLayer(DIM, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        logits = self.head(self.block(x, src_mask=mask, is_causal=True))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


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


def single_process(world: World) -> list[float]:
    """One process, the mean of every rank's loss (what data parallelism computes)."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = adam(model.parameters())
    losses = []
    for step in range(STEPS):
        per_rank = [model(*batch(step, r)) for r in range(world.size)]
        (sum(per_rank) / world.size).backward()
        opt.step()
        opt.zero_grad()
        losses.append(per_rank[world.rank].item())
    return losses


def baseline(world: World) -> list[float]:
    """nn.Embedding and the engine's own data parallelism (dense gradients)."""
    if world.backend == "mpi":
        return single_process(world)
    torch.manual_seed(0)
    model = TinyLM()
    if world.backend == "torch":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return train(DDP(model, process_group=world.comm.pg), adam(model.parameters()), world.rank)
    import horovod.torch as hvd

    opt = hvd.DistributedOptimizer(adam(model.parameters()), named_parameters=list(model.named_parameters()))
    return train(model, opt, world.rank)


def check_lm_losses_match_dense_data_parallel(world: World) -> None:
    want = baseline(world)
    queue = QueueConfig(chunk_bytes=1024, max_in_flight=3)  # several chunks per weight matrix
    for sharding, mode in (("row", "auto"), ("column", "auto"), ("row", "sparta")):
        torch.manual_seed(0)
        model = TinyLM()
        wrapped, opt = parallelize(model, world.comm, adam, mode, sharding, queue)
        assert isinstance(model.tok, SparseEmbedding) and isinstance(model.pos, SparseEmbedding)
        got = train(wrapped, opt, world.rank)
        torch.testing.assert_close(
            torch.tensor(got), torch.tensor(want), rtol=2e-4, atol=2e-5, msg=f"{sharding} {mode}"
        )
        mean = world.comm.all_reduce(torch.tensor(got), op="avg")  # one rank's 30 tokens are noisy
        first, last = float(mean[:5].mean()), float(mean[-5:].mean())
        assert last < first - 0.1, f"the LM did not learn: {first:.3f} -> {last:.3f}"


CHECKS = [check_lm_losses_match_dense_data_parallel]

if __name__ == "__main__":
    world, _ = start()
    failures = run_checks(world, CHECKS)
    gc.collect()  # DDP's reducer must go before its process group, or the exit aborts
    finish(world, failures)
