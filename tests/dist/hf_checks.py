"""Hugging Face Llama and GPT-2 (built from configs, no download) trained through
`sparta.parallel.parallelize` on 4 ranks, against one process on the global batch.

Run by tests/parallel/test_hf.py under torchrun. Each check builds its own layout over the
same 4 ranks. The oracle is the adapter in one process (with the same seeded MoE layers where
asked) accumulating, over the same dp x micro-batch chunks, the gradient of each chunk's
loss (and, through the MoE layers, each chunk's aux loss), then scaling by 1 / chunks: what
the trainer's data-parallel piece leaves in ``.grad``. Losses agree within 1e-5 over the steps
of plain SGD.
"""

from __future__ import annotations

import sys

import torch
import transformers
from runner import finish, raises, run_checks, start
from torch import nn

from sparta.comm import World
from sparta.errors import ConfigError
from sparta.parallel import MoESpec, ParallelConfig, moe_layers, parallelize
from sparta.parallel.dims import ParallelDims, build_layout
from sparta.parallel.hf import HFDecoder, from_hf
from sparta.parallel.pipeline import ModelParts, stage_module

VOCAB, D_MODEL, LAYERS, SEQ, STEPS, LR = 64, 32, 4, 8, 3, 0.5
TOL = 1e-5


def llama() -> HFDecoder:
    """4 query heads over 2 key/value heads: under tp 2 each rank runs 2 and 1."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return from_hf(transformers.LlamaForCausalLM(config))


def gpt2() -> HFDecoder:
    """GPT-2's default tied head, untied by the adapter (dropout 0, so ranks agree)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=D_MODEL,
        n_layer=LAYERS,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return from_hf(transformers.GPT2LMHeadModel(config), untie=True)


def batches(global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS times one global batch of (ids, targets) [global_batch, SEQ], the same on every
    rank: the loss must fall, so a run that does not train cannot pass by matching."""
    ids = torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return [(ids[:, :-1], ids[:, 1:])] * STEPS


def one_process_losses(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], chunks: int) -> list[float]:
    """Mean chunk loss per step; each step's gradient is the mean over ``chunks`` of each
    chunk's (loss + its MoE aux losses) gradient, then one SGD step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids, targets in data:
        total = 0.0
        for x, y in zip(ids.chunk(chunks), targets.chunk(chunks), strict=True):
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            total += loss.item()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(chunks)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / chunks)
    return losses


def compare(world: World, build, dims: ParallelDims, config: ParallelConfig, local_batch: int) -> None:
    """Train ``build()`` through parallelize at ``dims`` and in one process; same losses."""
    layout = build_layout(dims, world)
    data = batches(local_batch * dims.dp)
    model = build()
    reference = stage_module(model, ModelParts.of(model), ModelParts.of(model).layers, True, True)
    if config.moe is not None:
        moe_layers(reference, config.moe, None)
    expected = one_process_losses(reference, data, dims.dp * config.microbatches)
    sample = data[0][0][: local_batch // config.microbatches]
    pm = parallelize(model, layout, config, sample=sample)
    try:
        optimizer = torch.optim.SGD(pm.parameters(), lr=LR)
        got = []
        mine = slice(layout.dp_rank * local_batch, (layout.dp_rank + 1) * local_batch)
        for ids, targets in data:
            got.append(pm.step(ids[mine], targets[mine]))
            optimizer.step()
            optimizer.zero_grad()
    finally:
        pm.close()
    assert expected[-1] < expected[0], f"the one-process run did not learn: {expected}"
    if world.rank == 0:
        print(f"{dims} {config.schedule}: losses {got}, one process {expected}", flush=True)
    gaps = [abs(a - b) for a, b in zip(got, expected, strict=True)]
    assert max(gaps) <= TOL, f"{dims} {config.schedule}: losses {got} vs one process {expected}"


def check_llama_pp2_tp2(world: World) -> None:
    """Pipeline (rotary on both stages) and tensor parallel (local heads, grouped k/v)."""
    config = ParallelConfig(schedule="1F1B", microbatches=2, split_points=("layers.2",), data_parallel="sparta")
    compare(world, llama, ParallelDims(pp=2, tp=2), config, local_batch=4)


def check_llama_dp2_tp2_sparse_embedding(world: World) -> None:
    config = ParallelConfig(schedule="GPipe", microbatches=2, data_parallel="sparta", embedding="sparse")
    compare(world, llama, ParallelDims(dp=2, tp=2), config, local_batch=4)


def check_llama_pp2_dp2_interleaved_balanced(world: World) -> None:
    """Virtual stages cut by measured time (each Llama layer timed with the model's rotary)."""
    config = ParallelConfig(schedule="Interleaved1F1B", microbatches=2, stages_per_rank=2, data_parallel="fsdp")
    compare(world, llama, ParallelDims(pp=2, dp=2), config, local_batch=4)


def check_gpt2_pp2_dp2_moe_ep2(world: World) -> None:
    """GPT-2's MLPs as experts split over the 2 data-parallel ranks of each stage."""
    moe = MoESpec(num_experts=4, top_k=2)
    config = ParallelConfig(
        schedule="1F1B", microbatches=2, split_points=("layers.2",), data_parallel="sparta", moe=moe
    )
    compare(world, gpt2, ParallelDims(pp=2, dp=2, ep=2), config, local_batch=4)


def check_gpt2_tensor_parallel_is_refused_on_every_rank(world: World) -> None:
    layout = build_layout(ParallelDims(dp=2, tp=2), world)
    with raises(ConfigError, r"tp=2 for GPT-2.*Conv1D.*tp=1"):
        parallelize(gpt2(), layout, ParallelConfig(schedule="GPipe", microbatches=1))


CHECKS = [
    check_llama_pp2_tp2,
    check_llama_dp2_tp2_sparse_embedding,
    check_llama_pp2_dp2_interleaved_balanced,
    check_gpt2_pp2_dp2_moe_ep2,
    check_gpt2_tensor_parallel_is_refused_on_every_rank,
]

if __name__ == "__main__":
    # `hf_checks.py check_x check_y` runs only those (for debugging one layout)
    chosen = [c for c in CHECKS if c.__name__ in sys.argv[1:]] or CHECKS
    world, _ = start(timeout_s=120.0)
    finish(world, run_checks(world, chosen))
