"""SparseEmbedding on real processes, checked against one process's nn.Embedding.

Every rank builds the whole global batch from a shared seed, looks up its own part, and
compares with an nn.Embedding trained on all of it (DDP's convention: the loss is the mean
of the ranks' losses). Run by tests/embedding/test_embedding_dist.py under every engine.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from embedding_priority_checks import PRIORITY_CHECKS
from runner import finish, raises, run_checks, start

from sparta.comm import Communicator, World
from sparta.comm.priority import QueueConfig
from sparta.embedding import (
    SparseEmbedding,
    VocabParallelHead,
    full_state_dict,
    swap_embeddings,
    vocab_parallel_cross_entropy,
)
from sparta.errors import ConfigError, InputError
from sparta.parallel import DataParallel, ParallelDims, build_layout

VOCAB, DIM, PAD = 37, 8, 5
TOL = dict(rtol=1e-5, atol=1e-6)


def batches(step: int, world: int, vocab: int = VOCAB) -> list[torch.Tensor]:
    """Each rank's ids for one step: skewed (many repeats), uneven lengths, the padding id."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for r in range(world):
        n = 6 + (r + step) % 4
        ids = (torch.rand(n, 3, generator=gen) ** 3 * vocab).long()  # cubed: low ids repeat a lot
        ids[0, 0] = PAD
        out.append(ids)
    return out


def objective(y: torch.Tensor, step: int, r: int) -> torch.Tensor:
    """A non-linear per-rank loss, so Adam's second moments matter."""
    gen = torch.Generator().manual_seed(10 * step + r)
    target = torch.randn(y.shape, generator=gen)
    return ((y - target) ** 2).sum() + (y.sin() * target).sum()


def table() -> torch.Tensor:
    t = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(7))
    t[PAD] = 0
    return t


def train_against_reference(comm: Communicator, sharding: str, opt: str, steps: int = 3, sparse: bool = False) -> None:
    ref = torch.nn.Embedding.from_pretrained(table(), freeze=False, padding_idx=PAD, sparse=sparse)
    emb = SparseEmbedding.from_pretrained(
        table(), freeze=False, padding_idx=PAD, sharding=sharding, comm=comm, sparse=sparse
    )
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
        "plain_sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
        "sparse_adam": lambda ps: torch.optim.SparseAdam(list(ps), lr=0.01),
    }[opt]
    ref_opt, opt_ = make(ref.parameters()), make(emb.parameters())
    for step in range(steps):
        ids = batches(step, comm.size)
        opt_.zero_grad()
        y = emb(ids[comm.rank])
        torch.testing.assert_close(y, ref(ids[comm.rank]).detach(), **TOL)
        objective(y, step, comm.rank).backward()
        assert emb.weight.grad is not None and emb.weight.grad.is_sparse == sparse
        opt_.step()
        ref_opt.zero_grad()
        ref_loss = sum(objective(ref(ids[r]), step, r) for r in range(comm.size)) / comm.size
        ref_loss.backward()
        ref_opt.step()
    full = emb.full_weight()
    torch.testing.assert_close(full, ref.weight.detach(), **TOL)
    assert torch.equal(full[PAD], torch.zeros(DIM)), "the padding row moved"


def check_row_sgd(world: World) -> None:
    train_against_reference(world.comm, "row", "sgd")


def check_row_adam(world: World) -> None:
    train_against_reference(world.comm, "row", "adam")


def check_column_sgd(world: World) -> None:
    train_against_reference(world.comm, "column", "sgd")


def check_column_adam(world: World) -> None:
    train_against_reference(world.comm, "column", "adam")


def check_sparse_gradients_step_touched_rows_only(world: World) -> None:
    """sparse=True: the shard's gradient holds the touched rows only, and SGD / SparseAdam
    over it train the table as they train nn.Embedding(sparse=True) on the global batch."""
    train_against_reference(world.comm, "row", "plain_sgd", sparse=True)
    train_against_reference(world.comm, "column", "sparse_adam", sparse=True)


def check_forward_matches_and_repeats_summed_once(world: World) -> None:
    comm = world.comm
    for sharding in ("row", "column"):
        emb = SparseEmbedding.from_pretrained(table(), freeze=False, sharding=sharding, comm=comm)
        # every rank looks up id 3 four times and id 0 once: its gradient is 4 * (1/world) per rank
        ids = torch.tensor([[3, 3, 0], [3, 3, comm.rank + 10]])
        y = emb(ids)
        torch.testing.assert_close(y, F.embedding(ids, table()), rtol=0, atol=0)
        y.sum().backward()
        grad = emb.weight.grad
        r0, r1 = emb.layout.row_range(comm.rank)
        c0, c1 = emb.layout.col_range(comm.rank)
        want = torch.zeros(VOCAB, DIM)
        want[3] = 4.0
        want[0] = 1.0
        for r in range(comm.size):
            want[r + 10] += 1.0 / comm.size
        torch.testing.assert_close(grad, want[r0:r1, c0:c1], rtol=0, atol=1e-7)


def check_uneven_and_empty_batches(world: World) -> None:
    comm = world.comm
    emb = SparseEmbedding.from_pretrained(table(), sharding="row", comm=comm)
    ids = torch.arange(comm.rank * 7 % VOCAB, dtype=torch.int32) if comm.rank != 1 else torch.empty(0, 4).long()
    y = emb(ids)
    assert y.shape == (*ids.shape, DIM)
    torch.testing.assert_close(y, F.embedding(ids.long(), table()), rtol=0, atol=0)


def check_from_pretrained_frozen_and_random_init(world: World) -> None:
    comm = world.comm
    emb = SparseEmbedding.from_pretrained(table(), sharding="column", comm=comm)
    assert not emb.weight.requires_grad
    ids = batches(0, comm.size)[comm.rank]
    torch.testing.assert_close(emb(ids), F.embedding(ids, table()), rtol=0, atol=0)
    # a random table is the same for every world size and sharding, and its padding row is zero
    tables = []
    for sharding in ("row", "column"):
        torch.manual_seed(comm.rank)  # the ranks' seeds differ: rank 0's is used by all
        tables.append(SparseEmbedding(VOCAB, DIM, padding_idx=PAD, sharding=sharding, comm=comm).full_weight())
    torch.manual_seed(0)
    single = SparseEmbedding(VOCAB, DIM, padding_idx=PAD).full_weight()
    torch.testing.assert_close(tables[0], tables[1], rtol=0, atol=0)
    torch.testing.assert_close(tables[0], single, rtol=0, atol=0)
    assert torch.equal(single[PAD], torch.zeros(DIM)) and single.std() > 0.5


def check_state_dict_is_local_and_the_full_one_reloads_under_any_world(world: World) -> None:
    """`if rank == 0: torch.save(model.state_dict())` runs on rank 0 alone (no collective to
    hang on) and saves its shard, which a rank needing other rows refuses with the fix;
    full_state_dict, called on every rank and saved from rank 0, reloads on any world size
    and sharding to the same lookups."""
    comm = world.comm
    model = torch.nn.Sequential(SparseEmbedding.from_pretrained(table() * 2, freeze=False, sharding="row", comm=comm))
    emb = model[0]
    folder = Path(tempfile.gettempdir())
    tag = int(comm.broadcast(torch.randint(0, 2**31, (1,))))  # type: ignore[arg-type]
    local_path, full_path = folder / f"sparta-emb-{tag}-local.pt", folder / f"sparta-emb-{tag}-full.pt"
    (r0, r1), (c0, c1) = emb.layout.row_range(comm.rank), emb.layout.col_range(comm.rank)
    if comm.rank == 0:
        local = model.state_dict()
        assert list(local) == [f"0.weight.rows{r0}-{r1}.cols{c0}-{c1}"], list(local)
        torch.save(local, local_path)
    full = full_state_dict(model)
    torch.testing.assert_close(full["0.weight"], table() * 2, rtol=0, atol=0)
    if comm.rank == 0:
        torch.save(full, full_path)
    comm.barrier()
    ids = batches(0, comm.size)[comm.rank]
    want = emb(ids)
    try:
        # load into a table cut over half the ranks, over one process, and with the other sharding
        half = comm.split_groups([list(range(comm.size // 2)), list(range(comm.size // 2, comm.size))])
        assert half is not None
        for target in (
            SparseEmbedding(VOCAB, DIM, sharding="column", comm=half),
            SparseEmbedding(VOCAB, DIM),
            SparseEmbedding(VOCAB, DIM, sharding="column", comm=comm),
        ):
            fresh = torch.nn.Sequential(target)
            fresh.load_state_dict(torch.load(full_path))
            torch.testing.assert_close(target.full_weight(), table() * 2, rtol=0, atol=0)
            if target.comm is comm or target.comm is None:  # lookups of the same ranks' ids
                torch.testing.assert_close(target(ids), want, rtol=0, atol=0)
        # rank 0's shard alone: rank 0 finds its rows, every other rank is told how to save
        same_cut = torch.nn.Sequential(SparseEmbedding(VOCAB, DIM, sharding="row", comm=comm))
        if comm.rank == 0:
            same_cut.load_state_dict(torch.load(local_path))
            torch.testing.assert_close(same_cut[0].weight, emb.weight, rtol=0, atol=0)
        else:
            with raises(RuntimeError, "holds only the pieces 0.weight.rows0-.*save sparta.embedding.full_state_dict"):
                same_cut.load_state_dict(torch.load(local_path))
        # every rank's state_dict() merged (here cut from the full table) covers any cut of it
        merged = {}
        for r in range(comm.size):
            a, b = emb.layout.row_range(r)
            merged[f"0.weight.rows{a}-{b}.cols0-{DIM}"] = full["0.weight"][a:b]
        for target in (SparseEmbedding(VOCAB, DIM), SparseEmbedding(VOCAB, DIM, sharding="column", comm=comm)):
            torch.nn.Sequential(target).load_state_dict(merged)
            torch.testing.assert_close(target.full_weight(), table() * 2, rtol=0, atol=0)
    finally:
        comm.barrier()
        if comm.rank == 0:
            local_path.unlink()
            full_path.unlink()
    wrong = {"weight": torch.zeros(VOCAB + 1, DIM)}
    with raises(RuntimeError, f"shape \\({VOCAB + 1}, {DIM}\\)"):
        emb.load_state_dict(wrong)


def check_bad_ids_raise_on_every_rank(world: World) -> None:
    comm = world.comm
    for sharding in ("row", "column"):
        emb = SparseEmbedding(VOCAB, DIM, sharding=sharding, comm=comm, name="tok_emb")
        good = torch.tensor([1, 2, 3])
        bad_rank = comm.size - 1
        with raises(InputError, f"rank {bad_rank}|this rank.*tok_emb got id {VOCAB}, outside"):
            emb(torch.tensor([1, VOCAB, 2]) if comm.rank == bad_rank else good)
        with raises(InputError, "tok_emb got id -1"):
            emb(torch.tensor([-1]) if comm.rank == 0 else good)
        with raises(InputError, "tok_emb got ids of dtype float32; ids must be integers"):
            emb(good.float() if comm.rank == 1 else good)
        # the ranks are still in step: a normal lookup works
        torch.testing.assert_close(emb(good), emb.full_weight()[good], rtol=0, atol=0)


def check_bad_config_raises_on_every_rank(world: World) -> None:
    comm = world.comm
    odd = 2 * comm.size + 1
    with raises(ConfigError, f"embedding_dim \\({odd}\\) divisible by the world size \\({comm.size}\\)"):
        SparseEmbedding(VOCAB, odd, sharding="column", comm=comm)
    with raises(ConfigError, f"over a world of {comm.size} ranks"):
        SparseEmbedding(comm.size - 1, DIM, comm=comm)
    with raises(ConfigError, "rank 0 built it with embedding_dim=8 but rank 1 with embedding_dim=9"):
        SparseEmbedding(VOCAB, DIM + min(comm.rank, 1), comm=comm)
    with raises(ConfigError, "rank 0: padding_idx=99 is outside|this rank: padding_idx=99 is outside"):
        SparseEmbedding(VOCAB, DIM, padding_idx=99 if comm.rank == 0 else None, comm=comm)


def check_vocab_parallel_cross_entropy_equals_full_logits(world: World) -> None:
    comm = world.comm
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(11, VOCAB, generator=gen) * 3
    targets = torch.randint(0, VOCAB, (11,), generator=gen)
    weights = torch.rand(11, generator=gen)  # a weighted sum, so every token's gradient differs
    ref = full.clone().requires_grad_()
    ref_loss = (F.cross_entropy(ref, targets, reduction="none") * weights).sum()
    ref_loss.backward()
    r0, r1 = SparseEmbedding(VOCAB, DIM, comm=comm).layout.row_range(comm.rank)
    mine = full[:, r0:r1].clone().requires_grad_()
    loss = (vocab_parallel_cross_entropy(mine, targets, r0, comm) * weights).sum()
    loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    torch.testing.assert_close(mine.grad, ref.grad[:, r0:r1], **TOL)


def check_vocab_parallel_head_data_and_tensor_parallel_and_tied(world: World) -> None:
    comm = world.comm
    w = table()
    hidden = [torch.randn(3 + r, 2, DIM, generator=torch.Generator().manual_seed(r)) for r in range(comm.size)]
    targets = [
        (torch.rand(3 + r, 2, generator=torch.Generator().manual_seed(50 + r)) * VOCAB).long() for r in range(comm.size)
    ]
    # reference: one process, the mean of the ranks' losses, like DDP
    ref_w = w.clone().requires_grad_()
    ref_h = [h.clone().requires_grad_() for h in hidden]
    ref_losses = [
        F.cross_entropy((h @ ref_w.t()).flatten(0, 1), t.flatten()) for h, t in zip(ref_h, targets, strict=True)
    ]
    (sum(ref_losses) / comm.size).backward()

    head = VocabParallelHead(DIM, VOCAB, comm)
    with torch.no_grad():
        head.weight.copy_(head.layout.cut(w))
    h = hidden[comm.rank].clone().requires_grad_()
    loss = head(h, targets[comm.rank])
    loss.backward()
    torch.testing.assert_close(loss, ref_losses[comm.rank].detach(), **TOL)
    torch.testing.assert_close(h.grad, ref_h[comm.rank].grad * comm.size, **TOL)  # dL_r/dh_r, unaveraged
    torch.testing.assert_close(head.weight.grad, head.layout.cut(ref_w.grad), **TOL)
    assert head.weight.shape[0] <= VOCAB // comm.size + 1
    # bad targets on one rank raise the same error on every rank, before any logits move
    mine, bad = targets[comm.rank], comm.size - 1
    with raises(InputError, f"(rank {bad}|this rank): VocabParallelHead\\({DIM}, {VOCAB}\\) targets got id {VOCAB}"):
        head(h.detach(), torch.full_like(mine, VOCAB) if comm.rank == bad else mine)
    with raises(InputError, "targets got id -3, outside"):
        head(h.detach(), torch.full_like(mine, -3) if comm.rank == 0 else mine)
    with raises(InputError, f"got hidden states of {targets[0].numel()} tokens but 1 targets"):
        head(h.detach(), mine[:1, :1] if comm.rank == 0 else mine)
    with raises(InputError, "ids of dtype float32; ids must be integers"):
        head(h.detach(), mine.float() if comm.rank == 1 else mine)
    torch.testing.assert_close(head(h.detach(), mine), loss.detach(), **TOL)  # the ranks are still in step

    # the same tokens on every rank (tensor parallel): each computes its columns of the logits
    shared = VocabParallelHead(DIM, VOCAB, comm, gather_tokens=False)
    with torch.no_grad():
        shared.weight.copy_(shared.layout.cut(w))
    h0, ref_w0 = hidden[0].clone().requires_grad_(), w.clone().requires_grad_()
    ref_loss0 = F.cross_entropy((hidden[0] @ ref_w0.t()).flatten(0, 1), targets[0].flatten())
    ref_loss0.backward()
    loss0 = shared(h0, targets[0])
    loss0.backward()
    torch.testing.assert_close(loss0, ref_loss0.detach(), **TOL)
    torch.testing.assert_close(shared.weight.grad, shared.layout.cut(ref_w0.grad), **TOL)
    torch.testing.assert_close(comm.all_reduce(h0.grad), ref_h[0].grad * comm.size, **TOL)  # each rank's columns' part
    with raises(InputError, "gather_tokens=False takes the same tokens on every rank"):
        shared(hidden[comm.rank], targets[comm.rank])  # 3 + r rows on rank r

    # tied to the input embedding: both gradients land in one shard
    emb = SparseEmbedding.from_pretrained(w, freeze=False, sharding="row", comm=comm)
    tied = VocabParallelHead(DIM, VOCAB, comm, tie=emb)
    ids = targets[comm.rank].flip(0)
    tied(emb(ids).tanh(), targets[comm.rank]).backward()
    ref_t = w.clone().requires_grad_()
    ref_tied = [
        F.cross_entropy((F.embedding(t.flip(0), ref_t).tanh() @ ref_t.t()).flatten(0, 1), t.flatten()) for t in targets
    ]
    (sum(ref_tied) / comm.size).backward()
    assert list(tied.parameters()) == [emb.weight]
    torch.testing.assert_close(emb.weight.grad, emb.layout.cut(ref_t.grad), **TOL)


def check_gradient_accumulation_through_the_queue(world: World) -> None:
    """DataParallel("sparta", microbatches=2): two backwards per step (the tables' rows
    exchanged in each, the dense gradients queued once both are in) train like one process
    on every rank's micro-batches; column and row sharding."""
    comm = world.comm
    layout = build_layout(ParallelDims(dp=world.size), world)

    def model() -> torch.nn.Module:
        torch.manual_seed(4)
        return torch.nn.Sequential(torch.nn.Embedding(VOCAB, DIM, padding_idx=PAD), torch.nn.Linear(DIM, 3))

    for sharding in ("column", "row"):
        ref = model()
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
        net = model()
        swap_embeddings(net, layout.dp, sharding)
        dp = DataParallel(layout, "sparta", 2, False, queue_config=QueueConfig(64))
        net = dp.wrap(net)
        assert not dp.tables, "with micro-batches the rows are exchanged in each backward, not queued"
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        for step in range(2):
            micro = [batches(2 * step + m, comm.size) for m in range(2)]
            dp.start()
            for ids in micro:
                net(ids[comm.rank]).sin().sum().backward()
            dp.finish()
            opt.step()
            opt.zero_grad()
            sum(ref(ids[r]).sin().sum() for ids in micro for r in range(comm.size)).div(2 * comm.size).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        dp.close()
        torch.testing.assert_close(net[0].full_weight(), ref[0].weight.detach(), **TOL)
        torch.testing.assert_close(net[1].weight, ref[1].weight, **TOL)


CHECKS = [
    check_forward_matches_and_repeats_summed_once,
    check_row_sgd,
    check_row_adam,
    check_column_sgd,
    check_column_adam,
    check_sparse_gradients_step_touched_rows_only,
    check_uneven_and_empty_batches,
    check_from_pretrained_frozen_and_random_init,
    check_state_dict_is_local_and_the_full_one_reloads_under_any_world,
    check_bad_ids_raise_on_every_rank,
    check_bad_config_raises_on_every_rank,
    check_vocab_parallel_cross_entropy_equals_full_logits,
    check_vocab_parallel_head_data_and_tensor_parallel_and_tied,
    check_gradient_accumulation_through_the_queue,
    *PRIORITY_CHECKS,
]

if __name__ == "__main__":
    world, _ = start()
    finish(world, run_checks(world, CHECKS))
