"""The one-process oracle of the 3D trainer's checks (tests/dist/parallel_checks.py): the
small decoder every check builds, its MoE variants, each step's global batch, and the losses
one process gets on it in the trainer's chunks (dp ranks x micro-batches)."""

from __future__ import annotations

import torch
from torch import nn

from sparta.parallel import Decoder, DecoderConfig, MoESpec, moe_layers

MODEL = DecoderConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=4, n_heads=4, d_ff=32)
MOE = MoESpec(num_experts=4, top_k=2, aux_loss_coef=1e-2)
# the co-scheduler on: rows pipelined in 2 chunks over the two-level all-to-all (nodes of 2 ranks)
COSCHEDULED = MoESpec(num_experts=4, top_k=2, aux_loss_coef=1e-2, pipeline_degree=2, hierarchical=True)
# the co-scheduler tuned on the first step's inputs: the degrees it finds, and the two-level
# exchange weighed against flat where the ep groups span nodes (the "coscheduled" launch's 2)
AUTO = MoESpec(num_experts=4, top_k=2, aux_loss_coef=1e-2, pipeline_degree="auto")
# each block's batch cut into 2 micro-batches, one's attention beside the other's exchange
OVERLAPPED = MoESpec(num_experts=4, top_k=2, aux_loss_coef=1e-2, overlap=2)
# and each token sent to each node once, whose relay sums its experts' outputs (2 nodes of 2)
DEDUPLICATED = MoESpec(num_experts=4, top_k=2, aux_loss_coef=1e-2, overlap=2, dedup=True)
# under tp, whole experts on every tp rank (MOE splits their hidden units over tp)
REPLICATED = MoESpec(num_experts=4, top_k=2, aux_loss_coef=1e-2, expert_tp=False)
# a router that balances by load (its bias moved by each forward's counts), without the aux
# loss, whose balance term is per rank's tokens: one process runs each micro-batch of every
# dp rank at once, whose load the trainer sums over dp
SIGMOID = MoESpec(num_experts=4, top_k=2, router="sigmoid", aux_loss_coef=0.0)
STEPS, BATCH, LR, TOL = 10, 4, 0.05, 1e-5  # BATCH: sequences per dp rank per step
# the lengths of ragged batches (seq_len - step * 3 % 4 over the steps)
LENGTHS_SEEN = (MODEL.seq_len, MODEL.seq_len - 3, MODEL.seq_len - 2, MODEL.seq_len - 1)
NORM_CAP = 0.5  # gradients are clipped to this global norm: clipping must agree too


def batches(dp: int, step: int, ragged: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ids and targets [dp * BATCH, T], T = seq_len, or with
    ``ragged`` a length that changes from step to step."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, MODEL.vocab_size, (dp * BATCH, MODEL.seq_len + 1), generator=g)
    length = MODEL.seq_len - (step * 3 % 4) if ragged else MODEL.seq_len
    return ids[:, :length], ids[:, 1 : length + 1]


def rank_batches(dp: int, step: int, ragged: bool, uneven: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each dp rank's (ids, targets) of ``step``: its BATCH rows of `batches`; with ``uneven``
    rank d's cut d tokens shorter, so that the dp ranks of one step take different lengths."""
    ids, targets = batches(dp, step, ragged)
    out = []
    for d in range(dp):
        rows, cut = slice(d * BATCH, (d + 1) * BATCH), ids.shape[1] - (d if uneven else 0)
        out.append((ids[rows, :cut], targets[rows, :cut]))
    return out


def padded(
    ids: torch.Tensor, targets: torch.Tensor, lengths: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the trainer documents it does to a short batch: pad ids with 0, targets with -100,
    to seq_len, or to the smallest of ``lengths`` that holds it."""
    pad = min((n for n in lengths if n >= ids.shape[1]), default=MODEL.seq_len) - ids.shape[1]
    return nn.functional.pad(ids, (0, pad), value=0), nn.functional.pad(targets, (0, pad), value=-100)


def reference_losses(
    dp: int,
    microbatches: int,
    moe: MoESpec | None,
    ragged: bool = False,
    lengths: tuple[int, ...] = (),
    uneven: bool = False,
) -> tuple[list[tuple[float, float]], float]:
    """One process, the global batch in dp x microbatches chunks, SGD on the chunks' mean,
    gradients clipped to NORM_CAP. Returns (loss, gradient norm before clipping) per step, and
    the trained model's loss on the next batch, forward only. A router that balances by load
    runs the dp ranks' chunks of one micro-batch as one (the same mean over equal chunks)."""
    torch.manual_seed(0)
    model = Decoder(MODEL)
    if moe is not None:
        moe_layers(model, moe, None)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        chunks = _chunks(dp, step, microbatches, ragged, lengths, uneven, _merged(moe))
        total = 0.0
        for x, y in chunks:
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            total += float(loss.detach())
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= len(chunks)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), NORM_CAP))
        opt.step()
        opt.zero_grad()
        losses.append((total / len(chunks), norm))
    return losses, _probe(model, dp, microbatches, ragged, lengths, uneven, _merged(moe))


def _merged(moe: MoESpec | None) -> bool:
    return moe is not None and moe.balances_by_load


def _chunks(
    dp: int, step: int, microbatches: int, ragged: bool, lengths: tuple[int, ...], uneven: bool, merged: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches the dp ranks run at ``step``, each rank's padded as the trainer pads;
    ``merged``: the dp ranks' m-th chunks as one, for each m."""
    chunks = []
    for ids, targets in rank_batches(dp, step, ragged, uneven):
        ids, targets = padded(ids, targets, lengths)
        chunks += list(zip(ids.chunk(microbatches), targets.chunk(microbatches), strict=True))
    if merged:  # one micro-batch's mean over its dp chunks only where they hold equal targets
        assert not (ragged or uneven or lengths), "merged chunks of unequal lengths"
        return [(torch.cat([c[0] for c in chunks[m::microbatches]]), torch.cat([c[1] for c in chunks[m::microbatches]]))
                for m in range(microbatches)]  # fmt: skip
    return chunks


@torch.no_grad()
def _probe(
    model: nn.Module, dp: int, microbatches: int, ragged: bool, lengths: tuple[int, ...], uneven: bool, merged: bool
) -> float:
    """The trained model's forward loss on the batch after the last step, in the same chunks."""
    chunks = _chunks(dp, STEPS, microbatches, ragged, lengths, uneven, merged)
    losses = [float(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())) for x, y in chunks]
    return sum(losses) / len(losses)


def even_split(stages: int) -> tuple[str, ...]:
    per = MODEL.n_layers // stages
    return tuple(f"layers.{per * s}" for s in range(1, stages))
