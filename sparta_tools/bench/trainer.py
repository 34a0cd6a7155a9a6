"""The 3D trainer's benchmark pieces: the models (`SIZES`), the layouts (`LAYOUTS`), the
synthetic batches, one process's oracle, and the candidates' steps (plain eager, plain DDP,
Sparta's trainer). Two benchmarks build on them: `sparta bench trainer` (trainer_suite.py:
the candidates on the ranks of one launch) and benchmarks/trainer.py (the full comparison:
every layout in launches of its own, torchtitan patched for CPU in its own processes, peak
memory per candidate, the co-scheduler on the emulated cluster).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

LR, MAX_NORM, SEED, TOL = 3e-4, 1.0, 0, 1e-5


@dataclass(frozen=True)
class ModelShape:
    """One benchmark model. kind: "llama" (HF Llama through HFLlama; SwiGLU width d_ff) or
    "moe_gpt" (sparta.parallel.Decoder with MoE MLPs, each expert of width d_ff).
    batch: sequences per data-parallel rank per step; seq_len: tokens per sequence."""

    name: str
    kind: str
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    batch: int
    num_experts: int = 0
    top_k: int = 0


SIZES: dict[str, dict[str, ModelShape]] = {
    "debug": {
        # torchtitan's llama3 "debugmodel": dim 256, 6 layers, 16 heads, vocab 2048, ffn 768
        "dense": ModelShape("dense", "llama", 2048, 512, 256, 6, 16, 768, 2),
        "moe": ModelShape("moe", "moe_gpt", 2048, 256, 256, 4, 8, 512, 4, num_experts=8, top_k=2),
    },
    "tiny": {
        # 4 layers: ZBVZeroBubble on 2 ranks runs 4 stages of at least one layer each
        "dense": ModelShape("dense", "llama", 128, 16, 32, 4, 4, 64, 2),
        "moe": ModelShape("moe", "moe_gpt", 128, 16, 32, 4, 4, 32, 2, num_experts=4, top_k=2),
    },
}
# torchtitan's debug model is fixed at dim 256 etc.; at --size tiny it keeps that shape
# (it has no smaller flavour) and only seq_len and batch follow the size.


@dataclass(frozen=True)
class LayoutSpec:
    """A layout: degrees, the pipeline schedule, and Sparta's data-parallel strategy."""

    name: str
    pp: int = 1
    dp: int = 1
    tp: int = 1
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    microbatches: int = 1
    data_parallel: str = "sparta"

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def pure_dp(self) -> bool:
        return self.pp == 1 and self.tp == 1 and self.dp > 1 and self.data_parallel != "fsdp"


LAYOUTS = {
    spec.name: spec
    for spec in (
        LayoutSpec("1"),
        LayoutSpec("dp2", dp=2),
        LayoutSpec("dp4", dp=4),
        LayoutSpec("tp2", tp=2),
        LayoutSpec("pp2_1f1b", pp=2, schedule="1F1B", microbatches=2),
        LayoutSpec("pp2_zbv", pp=2, schedule="ZBVZeroBubble", stages_per_rank=2, microbatches=2),
        LayoutSpec("fsdp4", dp=4, data_parallel="fsdp"),
    )
}
CANDIDATES = (
    "eager", "ddp", "sparta", "sparta_ep", "sparta_experts_whole", "sparta_head_whole", "sparta_ddp", "torchtitan"
)  # fmt: skip
DEFAULT_CANDIDATES = ("eager", "ddp", "sparta", "sparta_ep", "sparta_experts_whole", "sparta_head_whole", "torchtitan")
TORCHTITAN_LAYOUTS = {"1": (1, 1), "tp2": (2, 1), "fsdp4": (1, 4)}  # layout -> (tp, fsdp) degrees
TORCHTITAN_PP_REASON = (
    "torchtitan 0.3.0's pipeline path fails on CPU inside the schedule ('Expecting 2 arg_mbs but got 1', "
    "checked for issue 23) and is driven by its Trainer (data loader, tokenizer files); not run"
)
TORCHTITAN_DP_REASON = (
    "torchtitan is compared at 1 rank, TP 2 and FSDP 4 (issue 23's peers); plain DDP is the floor for pure data "
    "parallel, and torchtitan's replicate path was not tried"
)
TORCHTITAN_MOE_REASON = (
    "torchtitan is compared on the dense Llama only: the MoE GPT is Sparta's reference decoder "
    "(sparta.parallel.Decoder), which torchtitan cannot build; its own MoE models (deepseek_v3, qwen3) are other "
    "models and were not tried on CPU"
)
TORCHTITAN_INSTALL = (  # what its import chain needs here; --no-deps keeps pip from replacing torch
    "pip install --no-deps torchtitan==0.3.0 spmd-types==0.3.1 torchdata==0.11.0 tyro==1.0.16 docstring-parser==0.18.0"
)


def plan_candidates(shape: ModelShape, layout: LayoutSpec, wanted: list[str]) -> tuple[list[str], dict[str, str]]:
    """(candidates to run, {candidate: why it is skipped}) for one model and layout."""
    run: list[str] = []
    skipped: dict[str, str] = {}
    moe = shape.kind == "moe_gpt"
    for name in wanted:
        if name == "eager" and layout.world_size == 1:
            run.append(name)
        elif name == "ddp" and layout.pure_dp:
            run.append(name)
        elif name == "sparta":
            run.append(name)
        elif name == "sparta_ep" and moe and layout.pure_dp:
            run.append(name)
        elif name == "sparta_experts_whole" and moe and layout.tp > 1:
            run.append(name)
        elif name == "sparta_head_whole" and layout.tp > 1:
            run.append(name)
        elif name == "sparta_ddp" and layout.pure_dp:
            run.append(name)
        elif name == "torchtitan":  # a peer: run, or say why not
            if moe:
                skipped[name] = TORCHTITAN_MOE_REASON
            elif layout.name in TORCHTITAN_LAYOUTS:
                run.append(name)
            elif layout.pp > 1:
                skipped[name] = TORCHTITAN_PP_REASON
            else:
                skipped[name] = TORCHTITAN_DP_REASON
    return run, skipped


# ----------------------------------------------------------------------------- data


def global_batch(shape: ModelShape, dp: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: ids and targets [dp * batch, seq_len] (int64)."""
    g = torch.Generator().manual_seed(10_000 + step)
    ids = torch.randint(0, shape.vocab_size, (dp * shape.batch, shape.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def local_batch(shape: ModelShape, dp: int, dp_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``dp_rank``'s rows of step ``step``'s global batch: (ids, targets)."""
    ids, targets = global_batch(shape, dp, step)
    rows = slice(dp_rank * shape.batch, (dp_rank + 1) * shape.batch)
    return ids[rows], targets[rows]


# ----------------------------------------------------------------------------- models


def build_model(shape: ModelShape) -> torch.nn.Module:
    """The full model, initialised from SEED (the same on every rank and candidate). The
    MoE GPT's MLPs are still dense here: `sparta.parallel.moe_layers` (or parallelize's
    MoESpec) turns them into MoE layers with their own seeded experts."""
    torch.manual_seed(SEED)
    if shape.kind == "llama":
        import transformers

        from sparta.parallel.hf import HFLlama

        config = transformers.LlamaConfig(
            vocab_size=shape.vocab_size,
            hidden_size=shape.d_model,
            intermediate_size=shape.d_ff,
            num_hidden_layers=shape.n_layers,
            num_attention_heads=shape.n_heads,
            num_key_value_heads=shape.n_heads,
            max_position_embeddings=shape.seq_len,
            rope_theta=500000.0,  # torchtitan's
            attention_dropout=0.0,
            tie_word_embeddings=False,  # torchtitan's debug model is untied too
        )
        config._attn_implementation = "sdpa"
        return HFLlama(transformers.LlamaForCausalLM(config))
    from sparta.parallel import Decoder, DecoderConfig

    return Decoder(
        DecoderConfig(shape.vocab_size, shape.seq_len, shape.d_model, shape.n_layers, shape.n_heads, shape.d_ff)
    )


def moe_spec(shape: ModelShape, expert_tp: bool = True, pipeline_degree: int | str = 1) -> Any:
    """The MoE GPT's MoESpec (None for a dense model); pipeline_degree is the co-scheduler's
    (1: the flat exchange, nothing overlapped; "auto": tuned at the first step)."""
    from sparta.parallel import MoESpec

    if shape.kind != "moe_gpt":
        return None
    return MoESpec(
        num_experts=shape.num_experts,
        top_k=shape.top_k,
        expert_tp=expert_tp,
        pipeline_degree=pipeline_degree,
    )


def one_process_model(shape: ModelShape) -> torch.nn.Module:
    """The model as one process trains it (MoE layers unsplit)."""
    from sparta.parallel import moe_layers

    model = build_model(shape)
    spec = moe_spec(shape)
    if spec is not None:
        moe_layers(model, spec, None)
    return model


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def oracle(shape: ModelShape, dp: int) -> tuple[float, int]:
    """One process: (the mean loss of the untrained model over step 0's global batch, its
    number of parameters)."""
    ids, targets = global_batch(shape, dp, 0)
    model = one_process_model(shape)
    return float(_loss(model(ids), targets)), sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- candidates

Step = Callable[[torch.Tensor, torch.Tensor], float]  # local ids, targets -> global mean loss


def adamw(params: Iterable[Any]) -> torch.optim.AdamW:
    """Every candidate's optimizer: AdamW at ``LR``, fused (one kernel over all tensors, CPU
    and CUDA), torchtitan's default implementation: the for-loop one dispatches each
    element-wise op per parameter, through DTensor's Python dispatch where FSDP2 or TP
    shard them (Sparta's dense FSDP 4 step: 2.33 s for-loop, 2.29 s fused, one launch). Takes
    parameters or groups (Sparta's: `ParallelModel.param_groups`, one kind of tensor each)."""
    return torch.optim.AdamW(params, lr=LR, fused=True)


def _plain_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """One plain PyTorch step (forward, backward, clip, AdamW); returns the local loss."""
    loss = _loss(model(ids), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    opt.zero_grad()
    return loss.detach()


def build_eager(shape: ModelShape, device: torch.device | str = "cpu") -> Step:
    """Plain one-process PyTorch: the model's forward, backward and AdamW step (the one-rank floor)."""
    model = one_process_model(shape).to(device)
    opt = adamw(model.parameters())

    def step(ids: torch.Tensor, targets: torch.Tensor) -> float:
        return float(_plain_step(model, opt, ids, targets))

    return step


def build_ddp(shape: ModelShape, device: torch.device | str = "cpu") -> Step:
    """A plain DDP script's step over the default process group (the pure data-parallel floor)."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(one_process_model(shape).to(device))
    opt = adamw(model.parameters())

    def step(ids: torch.Tensor, targets: torch.Tensor) -> float:
        mean = _plain_step(model, opt, ids, targets).reshape(1)
        dist.all_reduce(mean)  # the global mean, as Sparta's step returns it (equal local batches)
        return float(mean) / dist.get_world_size()

    return step


class SpartaRun:
    """Sparta's trainer on ``layout``: parallelize, then step / clip / AdamW per step; on
    ``shape``'s model, or on ``model`` (a decoder of the same shape) where given; ``moe``: a
    MoESpec in place of `moe_spec`'s; ``bucket_per_layer``: ParallelConfig's."""

    def __init__(
        self,
        shape: ModelShape,
        spec: LayoutSpec,
        layout: Any,
        data_parallel: str,
        expert_tp: bool = True,
        vocab_parallel_head: bool = True,
        model: torch.nn.Module | None = None,
        moe: Any | None = None,
        bucket_per_layer: bool = True,
    ) -> None:
        from sparta.parallel import ParallelConfig, parallelize

        model = build_model(shape) if model is None else model
        config = ParallelConfig(
            schedule=spec.schedule,
            microbatches=spec.microbatches,
            stages_per_rank=spec.stages_per_rank,
            data_parallel=data_parallel,
            moe=moe_spec(shape, expert_tp) if moe is None else moe,
            vocab_parallel_head=vocab_parallel_head,
            bucket_per_layer=bucket_per_layer,
        )
        stages = spec.pp * spec.stages_per_rank
        # several stages: balanced by measured time on one micro-batch, as a user would run it
        first = local_batch(shape, spec.dp, 0, 0)[0][: shape.batch // spec.microbatches].to(layout.device)
        sample = first if stages > 1 else None
        self.pm = parallelize(model, layout, config, sample=sample)
        self.opt = adamw(self.pm.param_groups())

    def __call__(self, ids: torch.Tensor, targets: torch.Tensor) -> float:
        loss = self.pm.step(ids, targets)
        self.pm.clip_grad_norm_(MAX_NORM)
        self.opt.step()
        self.opt.zero_grad()
        return loss


def build_step(
    name: str, shape: ModelShape, spec: LayoutSpec, layout_for: Callable[[int], Any], device: torch.device | str = "cpu"
) -> Step:
    """Candidate ``name`` (not torchtitan) built on this rank, on ``device`` (Sparta's: its
    layout's); ``layout_for(ep)`` gives the Sparta Layout of ``spec`` with ``ep``
    expert-parallel ranks (collective: every rank builds the same candidates in the same
    order). Each step takes its batch on that device."""
    if name == "eager":
        return build_eager(shape, device)
    if name == "ddp":
        return build_ddp(shape, device)
    strategy = "ddp" if name == "sparta_ddp" else spec.data_parallel
    ep = spec.dp if name == "sparta_ep" else 1
    return SpartaRun(
        shape,
        spec,
        layout_for(ep),
        strategy,
        expert_tp=name != "sparta_experts_whole",
        vocab_parallel_head=name != "sparta_head_whole",
    )
