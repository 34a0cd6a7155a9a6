"""`parallelize(model, layout, config)`: an existing model, cut and wrapped for the 3D trainer.

The model is not rewritten; pieces are composed from outside it, in this order, on every
pipeline stage this rank holds:

    cut (deep copy, other stages deleted)           pipeline.py; under vocab_stages /
                                                    embedding_stages the head / token
                                                    embedding as pp stages of rows of their
                                                    own (vocab_stages.py)
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
shape gets its own stages and schedule over the same modules. Causal attention keeps the
real tokens' outputs unchanged; MoE routing sees the padding tokens (they take expert capacity and enter the
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
from sparta.errors import ConfigError, InputError
from sparta.moe import MoELayer
from sparta.parallel.auto_schedule import AutoSchedule
from sparta.parallel.data_parallel import DataParallel
from sparta.parallel.decoder import Block
from sparta.parallel.dims import Layout
from sparta.parallel.dp_rules import ddp_needs_find_unused
from sparta.parallel.experts import (
    check_expert_tp,
    check_overlap_layers,
    hierarchical_ep,
    moe_layers,
    two_level_pays,
)
from sparta.parallel.model import VOCAB_STYLE, ParallelModel, step_loss
from sparta.parallel.parallel_config import ParallelConfig, tunes_blocks
from sparta.parallel.pipeline import (
    ZERO_BUBBLE,
    ModelParts,
    format_actions,
    measure_costs,
    schedule_actions,
    split_by_cost,
    split_by_points,
    stage_ids,
    stage_module,
    tied_across_parts,
)
from sparta.parallel.vocab_stages import (
    HeadStage,
    TakenRows,
    check_embedding,
    check_head,
    embedding_stage,
    head_stage,
    shard_rows,
)

TP_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
# the output head's style: its vocabulary split over tp, the logits left sharded for the
# loss (torch's loss_parallel, in ParallelModel) instead of gathered whole on every tp rank
_ALL_STYLES = {**TP_STYLES, VOCAB_STYLE: partial(ColwiseParallel, output_layouts=Shard(-1), use_local_output=False)}


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
    apart: tuple[str, ...] = (),
) -> list[list[str]]:
    """The layers of each of ``num_stages`` stages, by split points or by ``costs``;
    ``apart``: the first/last stage's extras that run on stages of their own (the head under
    vocab_stages, the token embedding under embedding_stages), charged to no layers' stage. Pure."""
    parts = ModelParts.of(model)
    if split_points is not None:
        return split_by_points(parts, num_stages, split_points)
    costs = dict(costs) if costs is not None else {n: 1.0 for n in (*parts.first, *parts.layers, *parts.last)}
    costs.update(dict.fromkeys(apart, 0.0))
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
    body, first = config.body_stages(dims.pp), config.first_body(dims.pp)  # the stages holding layers
    zero_bubble = config.schedule in ZERO_BUBBLE
    # --- every check first: no collective has run yet
    parts = ModelParts.of(model)
    config.check(dims, len(parts.layers), layout.world.backend)
    num_ids, num_classes = _token_bounds(model, parts)
    apart = _apart(model, parts, config, dims.pp, dims.tp)  # checks the head / table where they split
    stages = plan_stages(model, body, config.split_points, None, apart)  # validates split points / stage count
    tie = tied_across_parts(model, parts) if num_stages > 1 else None
    if tie is not None:
        raise ConfigError(
            f"{tie[1]} is {tie[0]} (a tied weight), but {num_stages} pipeline stages each hold a copy of their own "
            "parts, so the tie would come apart and the two train apart: untie it (e.g. "
            "`model.output.weight = nn.Parameter(model.output.weight.detach().clone())`), or run one stage"
        )
    if config.split_points is None and body > 1:
        if sample is None:
            raise ConfigError(
                "balancing stages by measured time needs sample= (one micro-batch of ids [b, T]); or pass split_points"
            )
        if sample.dim() != 2 or sample.dtype.is_floating_point or sample.dtype.is_complex:
            raise InputError(
                f"sample= is {tuple(sample.shape)} {sample.dtype}: give one micro-batch of integer ids [b, T]"
            )
    # a position past the model's table fails on the first stage alone, at the first step
    limit, longest = getattr(model, "max_length", None), (config.lengths or (config.seq_len,))[-1]
    if limit is not None and longest is not None and longest > limit:
        raise ConfigError(
            f"sequences of {longest} tokens (seq_len / lengths) exceed the {limit} positions "
            f"{type(model).__name__} takes: pad to at most {limit}, or build the model with more positions"
        )
    if config.moe is not None and dims.ep > 1:
        # moe_layers checks this per stage, where a stage of other layers would not raise
        check_overlap_layers(config.moe, dict(model.layers.items()))  # type: ignore[union-attr, operator]
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
        local, problem = dict.fromkeys(names, 0.0), None
        if layout.world.rank == 0:
            try:
                local = measure_costs(model, sample)
            except Exception as exc:  # noqa: BLE001 - rank 0's alone: every rank must raise it, not wait
                problem = InputError(f"sample= did not run through the model: {type(exc).__name__}: {exc}")
        layout.world.comm.agree(problem, "parallelize: timing the layers to balance the stages")
        agreed = layout.world.comm.broadcast(torch.tensor([local[n] for n in names], dtype=torch.float64), src=0)
        costs = dict(zip(names, agreed.tolist(), strict=True))  # type: ignore[union-attr]
        stages = plan_stages(model, body, None, costs, apart)
    mine = stage_ids(config.schedule, dims.pp, layout.pp_rank, config.stages_per_rank)
    # the priority queue orders the dense pieces against the sparse tables' rows, which it takes
    # with one micro-batch a step: without those it only adds its flow control, whose waits
    # stalled the backward hooks (MoE GPT, dp4: 1.071 s a step with it, 1.038 s without, DDP
    # 1.017 s). One dp rank: no queue, so DataParallel sends nothing (see its `_alone`)
    tables = config.embedding == "sparse" and config.microbatches == 1
    queue = config.data_parallel != "sparta" or (dims.dp > 1 and tables)
    layers_here = sum(len(stages[i - first]) for i in mine if first <= i < first + body)
    per_layer = config.bucket_per_layer and config.data_parallel == "sparta"
    ddp_rebuild_fails = ddp_needs_find_unused(config.schedule, dims.pp, config.microbatches, len(mine))
    find_unused = config.find_unused_parameters or (config.data_parallel == "ddp" and ddp_rebuild_fails)
    data_parallel = DataParallel(
        layout,
        config.data_parallel,
        config.microbatches,
        zero_bubble,
        config.bucket_mb,
        queue=queue,
        find_unused_parameters=find_unused,
        bucket_shares=layers_here + 1 if per_layer else 1,
    )
    tp_plan: dict[str, str] = {}
    expert_tp: list[str] = []
    split_experts = layout.tp if config.tensor_parallel and config.moe is not None and config.moe.expert_tp else None
    modules: list[nn.Module] = []
    moe_exchange = None
    if config.moe is not None and layout.ep is not None:
        if config.moe.hierarchical or config.moe.dedup or (config.moe.auto and two_level_pays(layout)):
            moe_exchange = hierarchical_ep(layout)  # under "auto" a candidate
    # the layers start on it only when asked; under "auto" the tuner may move them to it
    layer_exchange = moe_exchange if config.moe is not None and config.moe.hierarchical else None
    head_stages: list[HeadStage] = []
    # the vocabulary stages' rows split over tp as the tp head's are (vocab_parallel_head)
    rows_tp = layout.tp if config.tensor_parallel and config.vocab_parallel_head and dims.tp > 1 else None
    for index in mine:
        if not first <= index < first + body:  # an embedding or head stage: dense rows, replicated over tp
            vocab = (
                embedding_stage(model, parts, index, dims.pp, rows_tp)
                if index < first
                else head_stage(model, parts, index - first - body, dims.pp, rows_tp)
            ).to(layout.device)
            head_stages += [vocab] if isinstance(vocab, HeadStage) else []
            modules.append(data_parallel.wrap(vocab))
            continue
        module = stage_module(model, parts, stages[index - first], index == first, index == num_stages - 1)
        module = module.to(layout.device)
        if config.embedding_stages and index == first:  # the embedding stages looked the ids up
            table = model.get_submodule(parts.first[0])
            module.set_submodule(parts.first[0], TakenRows(table.weight.dtype))  # type: ignore[union-attr, arg-type]
        if config.moe is not None:
            replaced = moe_layers(module, config.moe, layout.ep, layer_exchange, split_experts, moe_exchange, layout.dp)
            expert_tp += replaced if split_experts is not None else []
        if config.embedding == "sparse" and index == first:
            swap_embeddings(module, layout.dp)
        if config.tensor_parallel and dims.tp > 1:
            plan = tp_plan_of(module, dims.tp, config.vocab_parallel_head)
            parallelize_module(module, layout.tp_mesh, {p: _ALL_STYLES[s]() for p, s in plan.items()})
            tp_plan.update(plan)
        if index in config.recompute:  # inside the data-parallel wrapper, as torchtitan orders them
            recompute_layers(module)
        modules.append(data_parallel.wrap(module))
    plan = ParallelPlan(
        stages=_stage_names(model, parts, config, dims.pp, stages),
        first=() if config.embedding_stages else parts.first,
        last=() if config.vocab_stages else parts.last,
        stage_ids=tuple(mine),
        tp_plan=tp_plan,
        actions=schedule_actions(config.schedule, dims.pp, config.microbatches, config.stages_per_rank),
        costs=costs,
        recompute=config.recompute,
        expert_tp=tuple(expert_tp),
    )
    schedule = partial(_schedule, config, layout, dict(zip(mine, modules, strict=True)), num_stages)
    auto = None
    if config.moe is not None and config.moe.auto:
        named = [(n, m) for module in modules for n, m in module.named_modules()]
        layers = {n: m for n, m in named if isinstance(m, MoELayer)}
        overlap = tunes_blocks(config, dims)  # else the layers keep the chunked exchange alone
        blocks = {n: m for n, m in named if overlap and isinstance(m, Block) and isinstance(m.mlp, MoELayer)}
        auto = AutoSchedule(layers, moe_exchange, blocks=blocks)
    return ParallelModel(layout, config, modules, schedule, data_parallel, plan, has_first=0 in mine,
                         has_last=num_stages - 1 in mine, heads=head_stages, auto=auto, num_ids=num_ids,
                         num_classes=num_classes)  # fmt: skip


def _token_bounds(model: nn.Module, parts: ModelParts) -> tuple[int | None, int | None]:
    """The rows of ``model``'s token embedding (its first child before ``layers``, where it
    has ``num_embeddings``) and the classes of its output head (its last child, where an
    ``nn.Linear``): what a batch's ids and targets must stay below (None: unknown). Pure."""
    table = model.get_submodule(parts.first[0]) if parts.first else None
    head = model.get_submodule(parts.last[-1]) if parts.last else None
    rows = getattr(table, "num_embeddings", None)
    return rows if isinstance(rows, int) else None, head.out_features if isinstance(head, nn.Linear) else None


def _apart(model: nn.Module, parts: ModelParts, config: ParallelConfig, pp: int, tp: int) -> tuple[str, ...]:
    """The extras that run on stages of their own (vocab_stages.py), checked. Pure."""
    apart: tuple[str, ...] = ()
    split = pp * (tp if config.tensor_parallel and config.vocab_parallel_head else 1)
    if config.embedding_stages:
        apart += (check_embedding(model, parts),)
        shard_rows(model.get_submodule(apart[-1]).num_embeddings, split)  # type: ignore[arg-type]
    if config.vocab_stages:
        check_head(model, parts)
        shard_rows(model.get_submodule(parts.last[-1]).out_features, split)  # type: ignore[arg-type]
        apart += parts.last
    return apart


def _stage_names(
    model: nn.Module, parts: ModelParts, config: ParallelConfig, pp: int, stages: list[list[str]]
) -> tuple[tuple[str, ...], ...]:
    """What every stage holds, for the plan: the embedding stages' rows ("tok_emb[0:2048]"),
    the layers' stages, the head stages' ("norm", "output[0:2048]")."""
    named = [tuple(s) for s in stages]
    front: list[tuple[str, ...]] = []
    if config.embedding_stages:
        table = parts.first[0]
        rows = shard_rows(model.get_submodule(table).num_embeddings, pp)  # type: ignore[arg-type]
        front = [(f"{table}[{a}:{b}]",) for a, b in rows]
        named[0] += parts.first[1:]  # the position embedding and the like stay with the layers
    back: list[tuple[str, ...]] = []
    if config.vocab_stages:
        rows = shard_rows(model.get_submodule(parts.last[-1]).out_features, pp)  # type: ignore[arg-type]
        back = [(*(parts.last[:-1] if k == 0 else ()), f"{parts.last[-1]}[{a}:{b}]") for k, (a, b) in enumerate(rows)]
    return tuple(front + named + back)


def _schedule(config: ParallelConfig, layout: Layout, modules: dict[int, nn.Module], num_stages: int) -> Any:
    """A fresh torch schedule over fresh PipelineStages of this rank's ``modules`` (global
    stage index -> module): one per padded length, since a stage fixes its shapes at its first
    step. Builds no communicator: the stages' first step does."""
    stages = [PipelineStage(m, i, num_stages, layout.device, group=layout.pp_group) for i, m in modules.items()]
    cls = get_schedule_class(config.schedule)
    loss = step_loss(config)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], config.microbatches, loss_fn=loss, scale_grads=False)
    return cls(stages, config.microbatches, loss_fn=loss, scale_grads=False)
