"""The model, data and training every phase of `checkpoint_checks.py` shares: one decoder (MoE
MLPs, sharded embeddings) with AdamW on a global batch of 8 sequences cut into the same 4
chunks in every layout, and the largest gap each comparison saw."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from sparta.parallel import (
    Decoder,
    DecoderConfig,
    Layout,
    MoESpec,
    ParallelConfig,
    ParallelDims,
    ParallelModel,
    parallelize,
)

MODEL = DecoderConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=4, n_heads=4, d_ff=32)
MOE = MoESpec(num_experts=4, top_k=2, aux_loss_coef=1e-2)
GLOBAL_BATCH, CHUNKS, LR = 8, 4, 1e-2
SAME = 1e-6  # the probe loss after loading: the same model, other layouts
STEPS_TOL = 1e-5  # losses of further AdamW steps: the same arithmetic in another order (as the parity tests)
LAYOUTS = {
    "eight": ParallelDims(pp=2, dp=2, tp=2, ep=2),
    "crash": ParallelDims(dp=4, ep=4),
    "four": ParallelDims(dp=4, ep=4),
}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (ids, targets [8, T]): the data position is the step."""
    ids = torch.randint(
        0, MODEL.vocab_size, (GLOBAL_BATCH, MODEL.seq_len + 1), generator=torch.Generator().manual_seed(step)
    )
    return ids[:, :-1], ids[:, 1:]


PROBE = 10_000  # the probe batch's step number: never trained on


def build(
    layout: Layout, strategy: str, seed: int = 0, vocab_stages: bool = False
) -> tuple[ParallelModel, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    dims = layout.dims
    config = ParallelConfig(
        schedule="Interleaved1F1B" if vocab_stages else "1F1B",
        microbatches=CHUNKS // dims.dp,
        stages_per_rank=3 if vocab_stages else 1,
        split_points=("layers.2",) if dims.pp == 2 else None,
        data_parallel=strategy,
        embedding="sparse",
        moe=MOE,
        seq_len=MODEL.seq_len,
        vocab_stages=vocab_stages,
        embedding_stages=vocab_stages,
    )
    pm = parallelize(Decoder(MODEL), layout, config)
    return pm, torch.optim.AdamW(pm.parameters(), lr=LR)


def mine(layout: Layout, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, targets = batch(step)
    per = GLOBAL_BATCH // layout.dims.dp
    return ids[layout.dp_rank * per : (layout.dp_rank + 1) * per], targets[
        layout.dp_rank * per : (layout.dp_rank + 1) * per
    ]


def train(
    pm: ParallelModel, opt: torch.optim.Optimizer, steps: range, log: Callable[[int, float], None] | None = None
) -> list[float]:
    losses = []
    for step in steps:
        losses.append(pm.step(*mine(pm.layout, step)))
        opt.step()
        opt.zero_grad()
        if log is not None:
            log(step, losses[-1])
    return losses


GAPS: dict[str, float] = {}  # what -> largest gap seen, written to gaps-<phase>.json by rank 0


def close(values: list[float], want: list[float], tol: float, what: str) -> None:
    gaps = [abs(a - b) for a, b in zip(values, want, strict=True)]
    GAPS[what] = max(gaps)
    assert max(gaps) <= tol, f"{what}: {values} vs {want} (gaps {gaps})"


def write_gaps(base: Path, phase: str) -> None:
    (base / f"gaps-{phase}.json").write_text(json.dumps(GAPS))
