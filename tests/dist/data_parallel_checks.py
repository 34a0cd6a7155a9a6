"""DataParallel in a plain training loop (no pipeline): our two drop-in layers combined in a
Hugging Face model train like one process, or are refused.

The model: a GPT-2 built from a tiny config (no download), its MLPs expert-parallel
(`sparta.moe.moeify` over ``layout.ep``), its embeddings SparseEmbeddings
(`sparta.embedding.swap_embeddings` over ``layout.dp``; the tied head untied by
`sparta.parallel.hf.from_hf(untie=True)`, as the one-process model is). 4 ranks, each with 2
of the global batch's 8 sequences, 5 SGD steps; the one-process oracle trains the same model
with every expert on the whole global batch. This is what issue 23 saw go 2.6e-3 apart,
silently, when the expert weights were treated as dense; that path is checked to be both
still wrong (so the parity check can fail) and refused by DataParallel.

Run by tests/parallel/test_data_parallel.py under torchrun and horovodrun.
"""

from __future__ import annotations

import gc

import torch
import transformers
from runner import finish, raises, run_checks, start
from torch import nn

from sparta.comm import World
from sparta.embedding import SparseEmbedding, sharded_parameter_names, swap_embeddings
from sparta.errors import ConfigError, InputError
from sparta.moe import MoELayer, moeify
from sparta.parallel import DataParallel, Layout, ParallelDims, build_layout
from sparta.parallel.hf import HFDecoder, from_hf

VOCAB, SEQ, D_MODEL, EXPERTS, LOCAL_BATCH, STEPS, LR = 64, 8, 32, 8, 2, 5, 0.5
TOL = 1e-5


def gpt2(ep: int, comm: object = None) -> HFDecoder:
    """The same GPT-2 with MoE MLPs on every rank and in the oracle (experts upcycled from the
    seeded MLPs, routers seeded alike; no balance loss, which is per batch and nonlinear)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=D_MODEL, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = from_hf(transformers.GPT2LMHeadModel(config), untie=True)
    moeify(model, EXPERTS, 2, match=model.mlp_class, comm=comm, ep_size=ep, capacity_factor=None, aux_loss_coef=0.0)
    return model


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches (ids, targets) [world * LOCAL_BATCH, SEQ], the same on every rank:
    counting up from random starts, so that there is something to learn in 5 steps."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        start = torch.randint(0, VOCAB, (4 * LOCAL_BATCH, 1), generator=gen)
        ids = (start + torch.arange(SEQ + 1)) % VOCAB
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def loss_of(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


_ORACLE: list[list[float]] = []


def one_process() -> list[float]:
    """The global batch's mean loss at each step of one process holding every expert."""
    if not _ORACLE:
        model = gpt2(1)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses = []
        for ids, targets in data():
            loss = loss_of(model, ids, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0] - 0.05, f"the one-process model did not learn: {losses}"
        _ORACLE.append(losses)
    return _ORACLE[0]


def train(world: World, model: nn.Module, dp: DataParallel | None) -> list[float]:
    """This rank's share of each global batch; the global mean loss per step."""
    net = dp.wrap(model) if dp is not None else model
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    mine = slice(world.rank * LOCAL_BATCH, (world.rank + 1) * LOCAL_BATCH)
    losses = []
    for ids, targets in data():
        if dp is not None:
            dp.start()
        loss = loss_of(net, ids[mine], targets[mine])
        loss.backward()
        if dp is not None:
            dp.finish()
        opt.step()
        opt.zero_grad()
        losses.append(float(world.comm.all_reduce(loss.detach().reshape(1), op="avg")))  # type: ignore[arg-type]
    if dp is not None:
        dp.close()
    return losses


_LAYOUTS: dict[int, Layout] = {}


def layout(world: World, ep: int) -> Layout:
    if ep not in _LAYOUTS:
        _LAYOUTS[ep] = build_layout(ParallelDims(dp=world.size, ep=ep), world)
    return _LAYOUTS[ep]


def sharded_gpt2(world: World, ep: int) -> nn.Module:
    lay = layout(world, ep)
    model = gpt2(ep, lay.ep)
    swap_embeddings(model, lay.dp)
    assert isinstance(model.tok_emb, SparseEmbedding) and isinstance(model.pos_emb, SparseEmbedding)
    assert sum(isinstance(m, MoELayer) and m.comm is not None for m in model.modules()) == 2
    return model


def check_gpt2_experts_and_sparse_embeddings_equal_one_process(world: World) -> None:
    """ep 4 (every expert once over the 4 ranks) under the engine's own strategy and "sparta"
    with and without its queue; ep 2 (two replicas of each expert, summed over those only)."""
    assert world.size == 4, "the oracle's global batch is 4 ranks' shares"
    want = one_process()
    native = {"torch": "ddp", "horovod": "horovod"}.get(world.backend)
    runs = [(4, "sparta", True), (4, "sparta", False), (2, "sparta", True)]
    runs += [(4, native, True)] if native else []
    for ep, strategy, queue in runs:
        model = sharded_gpt2(world, ep)
        options = {"queue": queue} if strategy == "sparta" else {}
        dp = DataParallel(layout(world, ep), strategy, microbatches=1, zero_bubble=False, **options)  # type: ignore[arg-type]
        got = train(world, model, dp)
        gaps = [abs(a - b) for a, b in zip(got, want, strict=True)]
        assert max(gaps) <= TOL, f"ep={ep} {strategy} queue={queue}: losses {got} vs one process {want}"
        if world.rank == 0:
            print(f"ep={ep} {strategy} queue={queue}: largest loss gap to one process {max(gaps):.1e}", flush=True)
        gc.collect()  # a DDP reducer goes before the next one is built


def check_expert_weights_treated_as_dense_are_wrong_and_refused(world: World) -> None:
    """The path issue 23 saw: DDP over every parameter but the embedding shards, experts
    included (rank 0's experts broadcast to all, then averaged with other experts'). Its
    losses leave one process's, so the parity check above can fail; DataParallel refuses a
    layout whose expert group is not the layers' instead of doing the same."""
    if world.backend == "torch":
        from torch.nn.parallel import DistributedDataParallel

        model = sharded_gpt2(world, 4)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sharded_parameter_names(model))
        wrapped = DistributedDataParallel(model, process_group=layout(world, 4).mesh.get_group("dp"))
        got = train(world, wrapped, None)
        gap = max(abs(a - b) for a, b in zip(got, one_process(), strict=True))
        assert gap > 100 * TOL, f"averaging experts as dense weights stayed within {gap:.1e} of one process"
        if world.rank == 0:
            print(f"experts averaged as dense weights: loss gap to one process {gap:.1e}", flush=True)
        del wrapped
        gc.collect()
    # experts over all 4 ranks, while the layout says ep=1 (or ep=2): refused before any collective
    for ep in (1, 2):
        model = gpt2(4, layout(world, 4).ep)
        with raises(ConfigError, r"splits its experts over world ranks \[0, 1, 2, 3\], but the layout's"):
            DataParallel(layout(world, ep), "sparta", 1, False).wrap(model)


def check_a_parameter_no_loss_reaches(world: World) -> None:
    """A dense parameter outside the forward (a head left over from fine-tuning, say): under
    "sparta" and the engine's own strategy the losses still equal one process and the unused
    weights stay equal on every rank. torch DDP needs its own flag for it, passed through as
    ``find_unused_parameters``; without it torch refuses the next step, naming the flag."""
    want = one_process()
    native = {"torch": "ddp", "horovod": "horovod"}.get(world.backend)
    runs = [("sparta", False)] + ([(native, native == "ddp")] if native else [])
    for strategy, find_unused in runs:
        model = sharded_gpt2(world, 4)
        model.unused = nn.Linear(3, 3)  # seeded alike by the last torch.manual_seed (gpt2's)
        options = {"find_unused_parameters": True} if find_unused else {}
        dp = DataParallel(layout(world, 4), strategy, 1, False, **options)  # type: ignore[arg-type]
        got = train(world, model, dp)
        gaps = [abs(a - b) for a, b in zip(got, want, strict=True)]
        assert max(gaps) <= TOL, f"{strategy} with an unused parameter: losses {got} vs one process {want}"
        weights = world.comm.all_gather(model.unused.weight.detach())
        assert all(torch.equal(w, weights[0]) for w in weights), f"{strategy}: the unused weights differ across ranks"
        gc.collect()
    if world.backend == "torch":
        model = sharded_gpt2(world, 4)
        model.unused = nn.Linear(3, 3)
        with raises(RuntimeError, "find_unused_parameters=True"):
            train(world, model, DataParallel(layout(world, 4), "ddp", 1, False))
        gc.collect()
    with raises(ConfigError, r"find_unused_parameters=True\) is torch DDP's flag; 'sparta' counts"):
        DataParallel(layout(world, 4), "sparta", 1, False, find_unused_parameters=True)


def check_gradient_pieces_that_differ_across_ranks_are_refused(world: World) -> None:
    """The "sparta" strategy compares its pieces' sizes across the dp ranks once, at the first
    step of a plan, so that every step's reductions skip the per-call check: models that differ
    (here 30 parameters each, cut 4 x 6 + 6 on even ranks and 5 x 5 + 5 on odd ones, so even
    the broadcast at wrap, one flat tensor, passes) are refused on every rank before any piece
    moves, by name."""
    shape = (6, 4) if world.rank % 2 == 0 else (5, 5)
    dp = DataParallel(layout(world, 1), "sparta", 1, False, bucket_mb=1e-5, queue=False)  # a piece per parameter
    model = dp.wrap(nn.Linear(shape[1], shape[0]))
    with raises(InputError, r"data-parallel gradient pieces differ across the dp ranks .*\[6, 24\].*\[5, 25\]"):
        dp.start()
    dp.close()
    del model


CHECKS = [
    check_gpt2_experts_and_sparse_embeddings_equal_one_process,
    check_expert_weights_treated_as_dense_are_wrong_and_refused,
    check_a_parameter_no_loss_reaches,
    check_gradient_pieces_that_differ_across_ranks_are_refused,
]

if __name__ == "__main__":
    world, _ = start(timeout_s=120.0)
    failures = run_checks(world, CHECKS)
    gc.collect()  # DDP's reducers must go before their process groups, or the exit aborts
    finish(world, failures)
