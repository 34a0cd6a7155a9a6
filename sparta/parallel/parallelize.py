"""`parallelize(model, layout, config)`: an existing model, cut and wrapped for the 3D trainer.

The model is not rewritten; pieces are composed from outside it, in this order, on every
pipeline stage this rank holds:

    cut (deep copy, other stages deleted)           pipeline.py
    MLPs -> expert-parallel MoELayers (moeify)      over layout.ep, each layer seeded alike
    embeddings -> SparseEmbedding                   over layout.dp (rows by all-to-all)
    tensor parallel (model.tp_plan, as data)        DTensor over layout.tp_mesh; the head
                                                    by vocabulary, its loss on the shards
    recomputation (config.recompute)                each layers.* block checkpointed
    data parallel (ddp | fsdp | horovod | sparta)   data_parallel.py
    torch PipelineStage, then the schedule by name

Every check runs before the first collective and depends only on the arguments, so a bad
configuration fails with the same ConfigError on every rank instead of hanging.

Variable sequence lengths: torch's PipelineStage fixes the shapes it sends at the first
step, so `ParallelModel.step` pads each batch on the right to ``seq_len`` (ids with 0,
targets with -100, which the loss ignores), or to the smallest of ``lengths``; each batch
shape gets its own stages and schedule over the same modules. Causal attention keeps the real tokens' outputs
unchanged; MoE routing sees the padding tokens (they take expert capacity and enter the
aux loss), so prefer batches of the full length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

from sparta.embedding import swap_embeddings
from sparta.errors import ConfigError
from sparta.moe import MoELayer
from sparta.parallel.data_parallel import DataParallel, check_strategy
from sparta.parallel.dims import Layout, ParallelDims
from sparta.parallel.experts import MoESpec, check_expert_tp, hierarchical_ep, moe_layers
from sparta.parallel.model import VOCAB_STYLE, ParallelModel, loss_fn
from sparta.parallel.pipeline import (
    ZERO_BUBBLE,
    ModelParts,
    check_schedule,
    format_actions,
    measure_costs,
    schedule_actions,
    split_by_cost,
    split_by_points,
    stage_ids,
    stage_module,
)
from sparta.parallel.vocab_stages import HeadStage, check_head, head_stage, shard_rows, token_loss

EMBEDDINGS = ("dense", "sparse")
TP_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
# the output head's style: its vocabulary split over tp, the logits left sharded for the
# loss (torch's loss_parallel, in ParallelModel) instead of gathered whole on every tp rank
_ALL_STYLES = {**TP_STYLES, VOCAB_STYLE: partial(ColwiseParallel, output_layouts=Shard(-1), use_local_output=False)}


@dataclass(frozen=True)
class ParallelConfig:
    """How `parallelize` cuts and wraps the model (the degrees are the Layout's).

    schedule: a torch.distributed.pipelining schedule (pipeline.SCHEDULES).
    microbatches: micro-batches per step; each rank's batch must divide by it.
    stages_per_rank: pipeline stages per rank (virtual stages; 2 for V schedules).
    split_points: layer names where stages 1.. begin, or None to balance by measured time.
    data_parallel: "ddp" | "fsdp" | "horovod" | "sparta" (see data_parallel.py).
    embedding: "dense" keeps nn.Embedding (replicated, all-reduced); "sparse" makes each a
        row-sharded SparseEmbedding over the data-parallel group.
    moe: MoESpec to turn MLPs into expert-parallel MoE layers, or None.
    tensor_parallel: apply the model's ``tp_plan`` when tp > 1.
    vocab_parallel_head: with tensor_parallel and tp > 1, split the output head by vocabulary
        over tp and compute the loss on the shards (see `tp_plan_of`); False keeps the head
        whole on every tp rank.
    seq_len: pad batches to this length (None: the first batch's length).
    lengths: the padded lengths the pipeline takes, instead of one ``seq_len``: a batch is
        padded to the smallest that holds it. torch's PipelineStage fixes its shapes at its
        first step, so each batch shape [B, length] gets its own stages and schedule over the
        same modules, built at its first batch, each with its own receive buffers (memory):
        keep the shapes few (`sparta.planner.bucketed_steps` makes a few per length).
    bucket_mb: bucket size of the "sparta" data-parallel strategy, MiB.
    vocab_stages: vocabulary parallelism over the pipeline ranks (vocab_stages.py): the
        output head split by vocabulary rows into pp stages, one per pipeline rank (the last
        round of a looped schedule, the second arm of a V), so the last stage stops carrying
        the whole head; the layers fill the other ``pp * (stages_per_rank - 1)`` stages.
        Needs stages_per_rank >= 2 and an untied bias-free head.
    recompute: global indices (0 .. pp * stages_per_rank - 1) of the stages whose ``layers.*``
        blocks keep only their inputs in forward and recompute the rest in backward
        (activation checkpointing, chosen per stage as Merak's stage-aware recomputation:
        stages with spare memory recompute less). Losses and gradients are unchanged; each
        recomputed block costs one more forward per micro-batch, but many more under the
        zero-bubble schedules: torch's weight-gradient pass runs one autograd.grad per
        parameter group, each recomputing the block (torch 2.13: 1 + 8 forwards per Decoder
        block, 1 + 9 with an MoE MLP). MoE layers re-issue their all-to-alls in each
        recomputation, in the same order on every rank; not with the "sigmoid" router,
        whose forward moves its balancing bias.
    """

    schedule: str = "1F1B"
    microbatches: int = 1
    stages_per_rank: int = 1
    split_points: tuple[str, ...] | None = None
    data_parallel: str = "sparta"
    embedding: str = "dense"
    moe: MoESpec | None = None
    tensor_parallel: bool = True
    vocab_parallel_head: bool = True
    seq_len: int | None = None
    lengths: tuple[int, ...] = ()
    bucket_mb: float = 25.0
    vocab_stages: bool = False
    recompute: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.split_points is not None:
            object.__setattr__(self, "split_points", tuple(self.split_points))
        if not isinstance(self.recompute, (tuple, list)):
            raise ConfigError(f"recompute={self.recompute!r} must be a list of stage indices, e.g. [0] or []")
        for index in self.recompute:
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise ConfigError(f"recompute={list(self.recompute)} holds {index!r}: stage indices are integers >= 0")
        if len(set(self.recompute)) != len(self.recompute):
            raise ConfigError(f"recompute={list(self.recompute)} names a stage twice: list each stage once")
        object.__setattr__(self, "recompute", tuple(sorted(self.recompute)))
        if self.embedding not in EMBEDDINGS:
            raise ConfigError(f"embedding={self.embedding!r} is unknown; choose one of {', '.join(EMBEDDINGS)}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise ConfigError(f"seq_len={self.seq_len!r} must be a positive integer or None")
        self._check_lengths()
        if not self.bucket_mb > 0:
            raise ConfigError(f"bucket_mb={self.bucket_mb} must be > 0")
        check_schedule(self.schedule, 1, self.microbatches, self.stages_per_rank)

    def _check_lengths(self) -> None:
        if not isinstance(self.lengths, (tuple, list)):
            raise ConfigError(f"lengths={self.lengths!r} must be a list of sequence lengths, e.g. [128, 256, 512]")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.lengths):
            raise ConfigError(f"lengths={list(self.lengths)}: every length must be a positive integer")
        if len(set(self.lengths)) != len(self.lengths):
            raise ConfigError(f"lengths={list(self.lengths)} names a length twice: list each once")
        if self.lengths and self.seq_len is not None:
            raise ConfigError(
                f"seq_len={self.seq_len} and lengths={list(self.lengths)} both set: give seq_len for one padded "
                "length, or lengths for several"
            )
        object.__setattr__(self, "lengths", tuple(sorted(self.lengths)))

    def check(self, dims: ParallelDims, n_layers: int | None = None, backend: str | None = None) -> None:
        """ConfigError unless this configuration can run ``dims`` (and a model of ``n_layers``
        layers, on the world engine ``backend``, where given). Pure: call it on every rank
        before any collective; `parallelize` calls it too."""
        check_schedule(self.schedule, dims.pp, self.microbatches, self.stages_per_rank)
        check_strategy(self.data_parallel, self.schedule in ZERO_BUBBLE, dims.tp, backend)
        if self.data_parallel == "ddp" and self.schedule != "1F1B" and self.microbatches > 1:
            # torch 2.13: under GPipe and the interleaved schedules DDP's first-step bucket rebuild
            # counts every micro-batch's hooks (reducer.cpp: "rebuilt parameter indices size is not
            # same as original"); 1F1B, checked here with 4 micro-batches over 2 stages, runs
            raise ConfigError(
                f"data_parallel='ddp' under {self.schedule} with {self.microbatches} micro-batches fails inside torch "
                "DDP; use schedule='1F1B', or data_parallel='fsdp' or 'sparta'"
            )
        if self.moe is not None and self.moe.num_experts % dims.ep:
            raise ConfigError(
                f"MoESpec.num_experts={self.moe.num_experts} does not divide over ep={dims.ep} ranks: pick a multiple"
            )
        if dims.ep > 1 and self.moe is None:
            raise ConfigError(f"ep={dims.ep} but ParallelConfig.moe is None: there are no experts to split; set ep=1")
        stages = dims.pp * self.stages_per_rank
        body = self.body_stages(dims.pp)
        if self.vocab_stages and self.stages_per_rank < 2:
            raise ConfigError(
                f"vocab_stages puts one head stage on each pipeline rank beside its layers' stages: it needs "
                f"stages_per_rank >= 2 (got {self.stages_per_rank}) and a multi-stage schedule (Interleaved1F1B, "
                "ZBVZeroBubble, ...)"
            )
        if self.vocab_stages and self.recompute and self.recompute[-1] >= body:
            raise ConfigError(
                f"recompute={list(self.recompute)} names stage {self.recompute[-1]}, one of the head stages "
                f"{body}..{stages - 1} (vocab_stages), which have no layers to recompute: use indices 0..{body - 1}"
            )
        if self.recompute and self.recompute[-1] >= stages:
            raise ConfigError(
                f"recompute={list(self.recompute)} names stage {self.recompute[-1]}, but the pipeline has {stages} "
                f"stage(s) (pp={dims.pp} x stages_per_rank={self.stages_per_rank}): use indices 0..{stages - 1}"
            )
        if self.recompute and self.moe is not None and self.moe.router == "sigmoid":
            # its forward moves the balancing bias in place: a recomputation would route with
            # the moved bias (other experts than the forward chose) and move it a second time
            raise ConfigError(
                f"recompute={list(self.recompute)} with MoESpec.router='sigmoid' would route the recomputation "
                "with a bias its forward already moved: set recompute=[] or pick another router"
            )
        if n_layers is not None and body > n_layers:
            heads = f", {dims.pp} of them the head's (vocab_stages)" if self.vocab_stages else ""
            rest = f" for the other {body}" if self.vocab_stages else ""
            raise ConfigError(
                f"{stages} pipeline stages (pp={dims.pp} x stages_per_rank={self.stages_per_rank}{heads}) but the model "
                f"has {n_layers} layers{rest}: every stage needs one; lower pp or stages_per_rank"
            )

    def body_stages(self, pp: int) -> int:
        """The stages holding the model's layers: all ``pp * stages_per_rank`` of them, less
        the ``pp`` head stages under ``vocab_stages``."""
        return pp * (self.stages_per_rank - 1 if self.vocab_stages else self.stages_per_rank)


@dataclass(frozen=True)
class ParallelPlan:
    """What `parallelize` decided, as data: the layers of every stage, this rank's stages,
    the tensor-parallel styles it applied (module path -> style; ``"output": "vocab"`` is
    the head split by vocabulary), the MoE layers whose experts' hidden units it split over
    tp (``expert_tp``) and every pipeline rank's action list. ``str(plan)`` prints it."""

    stages: tuple[tuple[str, ...], ...]
    first: tuple[str, ...]
    last: tuple[str, ...]
    stage_ids: tuple[int, ...]
    tp_plan: dict[str, str]
    actions: dict[int, list[str]]
    costs: dict[str, float] = field(default_factory=dict)
    recompute: tuple[int, ...] = ()
    expert_tp: tuple[str, ...] = ()

    def __str__(self) -> str:
        lines = []
        for index, layers in enumerate(self.stages):
            extras = (self.first if index == 0 else ()) + (self.last if index == len(self.stages) - 1 else ())
            mark = " (recomputed)" if index in self.recompute else ""
            lines.append(f"stage {index}{mark}: {', '.join((*layers, *extras))}")
        lines += [f"tensor parallel: {path} {style}" for path, style in self.tp_plan.items()]
        lines += [f"tensor parallel: {path} experts (d_ff split)" for path in self.expert_tp]
        return "\n".join([*lines, format_actions(self.actions)])


def plan_stages(
    model: nn.Module,
    num_stages: int,
    split_points: tuple[str, ...] | None,
    costs: dict[str, float] | None,
    head_apart: bool = False,
) -> list[list[str]]:
    """The layers of each of ``num_stages`` stages, by split points or by ``costs``;
    ``head_apart``: the children after the layers (norm, head) run on stages of their own
    (vocab_stages), so the last stage is not charged for them. Pure."""
    parts = ModelParts.of(model)
    if split_points is not None:
        return split_by_points(parts, num_stages, split_points)
    costs = dict(costs) if costs is not None else {n: 1.0 for n in (*parts.first, *parts.layers, *parts.last)}
    if head_apart:
        costs.update(dict.fromkeys(parts.last, 0.0))
    return split_by_cost(parts, num_stages, costs)


def tp_plan_of(module: nn.Module, tp: int, vocab_head: bool = True) -> dict[str, str]:
    """The model's per-layer ``tp_plan`` expanded to this module's linear layers (those not
    inside an MoE layer), checked to divide by ``tp``; plus ``"output": "vocab"`` where the
    module has the model's output head (an untied ``nn.Linear`` named ``output``),
    ``vocab_head`` is set and tp divides its vocabulary: its columns split over tp, the loss
    computed on the shards (Megatron's vocab-parallel cross-entropy, torch's
    ``loss_parallel``), so no tp rank holds or computes the whole head. Pure."""
    per_layer: dict[str, str] = getattr(module, "tp_plan", None) or {}
    if not per_layer:
        raise ConfigError(
            f"{type(module).__name__} has no tp_plan (module path inside a layer -> 'colwise'|'rowwise'); give it "
            "one, or pass tensor_parallel=False / tp=1"
        )
    plan: dict[str, str] = {}
    for key, layer in module.layers.items():  # type: ignore[union-attr, operator]
        experts = {p for p, m in layer.named_modules() if isinstance(m, MoELayer)}
        for path, style in per_layer.items():
            if style not in TP_STYLES:
                raise ConfigError(f"tp_plan[{path!r}]={style!r}: styles are {', '.join(TP_STYLES)}")
            if any(path == e or path.startswith(e + ".") for e in experts):
                continue
            try:
                linear = layer.get_submodule(path)
            except AttributeError:
                continue  # e.g. an MLP that became an MoE layer
            if not isinstance(linear, nn.Linear):
                raise ConfigError(f"tp_plan names layers.{key}.{path}, a {type(linear).__name__}; it must be nn.Linear")
            width = linear.out_features if style == "colwise" else linear.in_features
            if width % tp:
                raise ConfigError(
                    f"layers.{key}.{path} ({style}) splits {width} features over tp={tp}: pick tp dividing {width}"
                )
            plan[f"layers.{key}.{path}"] = style
    head = getattr(module, "output", None)
    tied = head is not None and head.weight is getattr(getattr(module, "tok_emb", None), "weight", None)
    if vocab_head and isinstance(head, nn.Linear) and head.out_features % tp == 0 and not tied:
        plan["output"] = VOCAB_STYLE
    return plan


def recompute_layers(module: nn.Module) -> None:
    """Make every ``layers.*`` block of ``module`` recompute its activations in backward
    (torch's non-reentrant checkpoint around the block's own forward), in place. The
    block's forward is replaced on the instance, not wrapped in another module, so
    parameter and checkpoint names stay as they were and any layout loads them."""
    for layer in module.layers.values():  # type: ignore[union-attr, operator]
        layer.forward = partial(_recomputed, layer.forward)


def _recomputed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    # early_stop=False: the recomputation runs the whole forward, so every rank of a tp or ep
    # group re-issues all the block's collectives; early stop ends it after the last saved
    # tensor, and data-dependent code (routing) could save different numbers on different ranks
    return checkpoint(forward, *args, use_reentrant=False, early_stop=False, **kwargs)


def parallelize(
    model: nn.Module, layout: Layout, config: ParallelConfig, sample: Tensor | None = None
) -> ParallelModel:
    """Cut, convert and wrap ``model`` (the same full model on every rank, e.g. built after
    the same seed) for ``layout``; returns what the training loop calls.

    sample: one micro-batch of ids [b, T], needed to balance stages by measured time when
    ``config.split_points`` is None and there are several stages.
    Collective over the world: every rank calls it with the same model and config.
    """
    dims = layout.dims
    num_stages = dims.pp * config.stages_per_rank
    body = config.body_stages(dims.pp)  # the stages holding layers; the rest are head stages
    heads = config.vocab_stages
    zero_bubble = config.schedule in ZERO_BUBBLE
    # --- every check first: no collective has run yet
    parts = ModelParts.of(model)
    config.check(dims, len(parts.layers), layout.world.backend)
    stages = plan_stages(model, body, config.split_points, None, heads)  # validates split points / stage count
    if heads:
        check_head(model, parts)
        shard_rows(model.get_submodule(parts.last[-1]).out_features, dims.pp)  # type: ignore[arg-type]
    if config.split_points is None and body > 1 and sample is None:
        raise ConfigError(
            "balancing stages by measured time needs sample= (one micro-batch of ids [b, T]); or pass split_points"
        )
    check_tp = getattr(model, "check_tp", None)  # adapters that know their own limits (sparta.parallel.hf)
    if config.tensor_parallel and check_tp is not None:
        check_tp(dims.tp)
    if config.tensor_parallel and dims.tp > 1:
        probe = stage_module(model, parts, parts.layers, True, True)
        if config.moe is not None:
            moe_layers(probe, config.moe, None)
            if config.moe.expert_tp:
                check_expert_tp(probe, dims.tp)
        tp_plan_of(probe, dims.tp)
    # --- collectives from here on
    costs: dict[str, float] = {}
    if config.split_points is None and body > 1:
        assert sample is not None
        names = [*parts.first, *parts.layers, *parts.last]
        local = measure_costs(model, sample) if layout.world.rank == 0 else dict.fromkeys(names, 0.0)
        agreed = layout.world.comm.broadcast(torch.tensor([local[n] for n in names], dtype=torch.float64), src=0)
        costs = dict(zip(names, agreed.tolist(), strict=True))  # type: ignore[union-attr]
        stages = plan_stages(model, body, None, costs, heads)
    mine = stage_ids(config.schedule, dims.pp, layout.pp_rank, config.stages_per_rank)
    # one dp rank: no queue, so DataParallel sends nothing (see its `_alone`)
    queue = config.data_parallel != "sparta" or dims.dp > 1
    data_parallel = DataParallel(
        layout, config.data_parallel, config.microbatches, zero_bubble, config.bucket_mb, queue=queue
    )
    tp_plan: dict[str, str] = {}
    expert_tp: list[str] = []
    split_experts = layout.tp if config.tensor_parallel and config.moe is not None and config.moe.expert_tp else None
    modules: list[nn.Module] = []
    moe_exchange = hierarchical_ep(layout) if config.moe is not None and config.moe.hierarchical and layout.ep else None
    head_stages: list[HeadStage] = []
    for index in mine:
        if index >= body:  # a head stage: plain dense parameters, replicated over tp
            head_stages.append(head_stage(model, parts, index - body, dims.pp).to(layout.device))
            modules.append(data_parallel.wrap(head_stages[-1]))
            continue
        module = stage_module(model, parts, stages[index], index == 0, index == num_stages - 1).to(layout.device)
        if config.moe is not None:
            replaced = moe_layers(module, config.moe, layout.ep, moe_exchange, split_experts)
            expert_tp += replaced if split_experts is not None else []
        if config.embedding == "sparse" and index == 0:
            swap_embeddings(module, layout.dp)
        if config.tensor_parallel and dims.tp > 1:
            plan = tp_plan_of(module, dims.tp, config.vocab_parallel_head)
            parallelize_module(module, layout.tp_mesh, {p: _ALL_STYLES[s]() for p, s in plan.items()})
            tp_plan.update(plan)
        if index in config.recompute:  # inside the data-parallel wrapper, as torchtitan orders them
            recompute_layers(module)
        modules.append(data_parallel.wrap(module))
    plan = ParallelPlan(
        stages=tuple(tuple(s) for s in stages) + tuple(_head_names(model, parts, dims.pp) if heads else ()),
        first=parts.first,
        last=() if heads else parts.last,
        stage_ids=tuple(mine),
        tp_plan=tp_plan,
        actions=schedule_actions(config.schedule, dims.pp, config.microbatches, config.stages_per_rank),
        costs=costs,
        recompute=config.recompute,
        expert_tp=tuple(expert_tp),
    )
    schedule = partial(_schedule, config, layout, dict(zip(mine, modules, strict=True)), num_stages)
    return ParallelModel(layout, config, modules, schedule, data_parallel, plan, has_first=0 in mine,
                         has_last=num_stages - 1 in mine, heads=head_stages)  # fmt: skip


def _head_names(model: nn.Module, parts: ModelParts, pp: int) -> list[tuple[str, ...]]:
    """What each head stage holds, for the plan: ("norm", "output[0:2048]"), ("output[2048:4096]",), ..."""
    rows = shard_rows(model.get_submodule(parts.last[-1]).out_features, pp)  # type: ignore[arg-type]
    extras = parts.last[:-1]
    return [(*(extras if k == 0 else ()), f"{parts.last[-1]}[{a}:{b}]") for k, (a, b) in enumerate(rows)]


def _schedule(config: ParallelConfig, layout: Layout, modules: dict[int, nn.Module], num_stages: int) -> Any:
    """A fresh torch schedule over fresh PipelineStages of this rank's ``modules`` (global
    stage index -> module): one per padded length, since a stage fixes its shapes at its first
    step. Builds no communicator: the stages' first step does."""
    stages = [PipelineStage(m, i, num_stages, layout.device, group=layout.pp_group) for i, m in modules.items()]
    cls = get_schedule_class(config.schedule)
    loss = token_loss if config.vocab_stages else loss_fn
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], config.microbatches, loss_fn=loss, scale_grads=False)
    return cls(stages, config.microbatches, loss_fn=loss, scale_grads=False)
