"""`parallelize(model, layout, config)`: an existing model, cut and wrapped for the 3D trainer.

The model is not rewritten; pieces are composed from outside it, in this order, on every
pipeline stage this rank holds:

    cut (deep copy, other stages deleted)           pipeline.py
    MLPs -> expert-parallel MoELayers (moeify)      over layout.ep, each layer seeded alike
    embeddings -> SparseEmbedding                   over layout.dp (rows by all-to-all)
    tensor parallel (model.tp_plan, as data)        DTensor over layout.tp_mesh
    data parallel (ddp | fsdp | horovod | sparta)   data_parallel.py
    torch PipelineStage, then the schedule by name

Every check runs before the first collective and depends only on the arguments, so a bad
configuration fails with the same ConfigError on every rank instead of hanging.

Variable sequence lengths: torch's PipelineStage fixes the shapes it sends at the first
step, so `ParallelModel.step` pads each batch on the right to ``seq_len`` (ids with 0,
targets with -100, which the loss ignores). Causal attention keeps the real tokens' outputs
unchanged; MoE routing sees the padding tokens (they take expert capacity and enter the
aux loss), so prefer batches of the full length.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from sparta.comm import HierarchicalAllToAll
from sparta.embedding import swap_embeddings
from sparta.errors import ConfigError, InputError
from sparta.moe import ROUTERS, MoELayer, moeify
from sparta.parallel.data_parallel import DataParallel, check_strategy
from sparta.parallel.dims import Layout, ParallelDims
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

EMBEDDINGS = ("dense", "sparse")
TP_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
IGNORE_INDEX = -100


@dataclass(frozen=True)
class MoESpec:
    """Which MLPs become MoE layers and how: every layer's (``every=1``) or every k-th one's.
    The new experts start from their own seeded initialisation (not copies of the MLP)."""

    num_experts: int = 8
    top_k: int = 2
    router: str = "topk"
    capacity_factor: float | None = None
    aux_loss_coef: float = 1e-2
    every: int = 1
    seed: int = 0
    # the co-scheduler: row exchanges cut into chunks that overlap the experts' compute
    # (an int, or (forward, backward) degrees), and the two-level all-to-all over the
    # world's nodes (intra-node first, one message per node across)
    pipeline_degree: int | tuple[int, ...] = 1
    hierarchical: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.pipeline_degree, list):
            object.__setattr__(self, "pipeline_degree", tuple(self.pipeline_degree))
        for name in ("num_experts", "top_k", "every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"MoESpec.{name}={value!r} must be a positive integer")
        if self.top_k > self.num_experts:
            raise ConfigError(f"MoESpec.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.router not in ROUTERS:
            raise ConfigError(f"MoESpec.router={self.router!r} is unknown: choose one of {', '.join(ROUTERS)}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(f"MoESpec.capacity_factor={self.capacity_factor} must be > 0, or None for dropless")


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
    seq_len: pad batches to this length (None: the first batch's length).
    bucket_mb: bucket size of the "sparta" data-parallel strategy, MiB.
    """

    schedule: str = "1F1B"
    microbatches: int = 1
    stages_per_rank: int = 1
    split_points: tuple[str, ...] | None = None
    data_parallel: str = "sparta"
    embedding: str = "dense"
    moe: MoESpec | None = None
    tensor_parallel: bool = True
    seq_len: int | None = None
    bucket_mb: float = 25.0

    def __post_init__(self) -> None:
        if self.split_points is not None:
            object.__setattr__(self, "split_points", tuple(self.split_points))
        if self.embedding not in EMBEDDINGS:
            raise ConfigError(f"embedding={self.embedding!r} is unknown; choose one of {', '.join(EMBEDDINGS)}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise ConfigError(f"seq_len={self.seq_len!r} must be a positive integer or None")
        if not self.bucket_mb > 0:
            raise ConfigError(f"bucket_mb={self.bucket_mb} must be > 0")
        check_schedule(self.schedule, 1, self.microbatches, self.stages_per_rank)

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
        if n_layers is not None and stages > n_layers:
            raise ConfigError(
                f"{stages} pipeline stages (pp={dims.pp} x stages_per_rank={self.stages_per_rank}) but the model has "
                f"{n_layers} layers: every stage needs one; lower pp or stages_per_rank"
            )


@dataclass(frozen=True)
class ParallelPlan:
    """What `parallelize` decided, as data: the layers of every stage, this rank's stages,
    the tensor-parallel styles it applied (module path -> style) and every pipeline rank's
    action list. ``str(plan)`` prints it."""

    stages: tuple[tuple[str, ...], ...]
    first: tuple[str, ...]
    last: tuple[str, ...]
    stage_ids: tuple[int, ...]
    tp_plan: dict[str, str]
    actions: dict[int, list[str]]
    costs: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = []
        for index, layers in enumerate(self.stages):
            extras = (self.first if index == 0 else ()) + (self.last if index == len(self.stages) - 1 else ())
            lines.append(f"stage {index}: {', '.join((*layers, *extras))}")
        lines += [f"tensor parallel: {path} {style}" for path, style in self.tp_plan.items()]
        return "\n".join([*lines, format_actions(self.actions)])


def plan_stages(
    model: nn.Module, num_stages: int, split_points: tuple[str, ...] | None, costs: dict[str, float] | None
) -> list[list[str]]:
    """The layers of each of ``num_stages`` stages, by split points or by ``costs``. Pure."""
    parts = ModelParts.of(model)
    if split_points is not None:
        return split_by_points(parts, num_stages, split_points)
    if costs is None:
        costs = {name: 1.0 for name in (*parts.first, *parts.layers, *parts.last)}
    return split_by_cost(parts, num_stages, costs)


def moe_layers(
    module: nn.Module, spec: MoESpec, layout: Layout | None, exchange: HierarchicalAllToAll | None = None
) -> list[str]:
    """Turn the MLP of every ``spec.every``-th layer of ``module.layers`` into an MoELayer,
    in place; each is seeded from ``spec.seed`` and the layer's name, so any stage cut and
    the one-process model (``layout=None``) build equal experts and routers. ``exchange``:
    the rows' two-level all-to-all over ``layout.ep`` (see `hierarchical_ep`), or None (flat)."""
    ep = layout.ep if layout is not None else None
    replaced = []
    for key, layer in module.layers.items():  # type: ignore[union-attr, operator]
        if int(key) % spec.every:
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed * 1_000_003 + int(key))
            paths = moeify(
                layer,
                spec.num_experts,
                spec.top_k,
                upcycle=False,
                comm=ep,
                ep_size=ep.size if ep is not None else 1,
                router=spec.router,
                capacity_factor=spec.capacity_factor,
                aux_loss_coef=spec.aux_loss_coef,
                pipeline_degree=spec.pipeline_degree,
            )
        for path in paths:
            layer.get_submodule(path).set_exchange(exchange)
        replaced += [f"layers.{key}.{p}" for p in paths]
    return replaced


def hierarchical_ep(layout: Layout) -> HierarchicalAllToAll:
    """A two-level all-to-all over this rank's expert-parallel group, nodes as the world's.
    Collective over the world (every rank builds its group's)."""
    world, dims = layout.world, layout.dims
    intra_groups, inter_groups = [], []
    for group in dims.ep_groups():
        by_node = [[r for r in group if r in node] for node in world.node_ranks]
        by_node = [ranks for ranks in by_node if ranks]
        if len({len(ranks) for ranks in by_node}) != 1:
            raise ConfigError(
                f"MoESpec.hierarchical: the expert-parallel group {group} has {[len(r) for r in by_node]} ranks on its "
                "nodes; the two-level all-to-all needs as many on each (launch equal ranks per node, or set it False)"
            )
        intra_groups += by_node
        inter_groups += [list(column) for column in zip(*by_node, strict=True)]
    intra = world.comm.split_groups(intra_groups)
    inter = world.comm.split_groups(inter_groups)
    assert layout.ep is not None and intra is not None and inter is not None
    return HierarchicalAllToAll(layout.ep, intra, inter)


def tp_plan_of(module: nn.Module, tp: int) -> dict[str, str]:
    """The model's per-layer ``tp_plan`` expanded to this module's linear layers (those not
    inside an MoE layer), checked to divide by ``tp``. Pure."""
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
    return plan


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
    zero_bubble = config.schedule in ZERO_BUBBLE
    # --- every check first: no collective has run yet
    parts = ModelParts.of(model)
    config.check(dims, len(parts.layers), layout.world.backend)
    stages = plan_stages(model, num_stages, config.split_points, None)  # validates split points / stage count
    if config.split_points is None and num_stages > 1 and sample is None:
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
        tp_plan_of(probe, dims.tp)
    # --- collectives from here on
    costs: dict[str, float] = {}
    if config.split_points is None and num_stages > 1:
        assert sample is not None
        names = [*parts.first, *parts.layers, *parts.last]
        local = measure_costs(model, sample) if layout.world.rank == 0 else dict.fromkeys(names, 0.0)
        agreed = layout.world.comm.broadcast(torch.tensor([local[n] for n in names], dtype=torch.float64), src=0)
        costs = dict(zip(names, agreed.tolist(), strict=True))  # type: ignore[union-attr]
        stages = plan_stages(model, num_stages, None, costs)
    mine = stage_ids(config.schedule, dims.pp, layout.pp_rank, config.stages_per_rank)
    data_parallel = DataParallel(layout, config.data_parallel, config.microbatches, zero_bubble, config.bucket_mb)
    tp_plan: dict[str, str] = {}
    modules, pipeline_stages = [], []
    moe_exchange = hierarchical_ep(layout) if config.moe is not None and config.moe.hierarchical and layout.ep else None
    for index in mine:
        module = stage_module(model, parts, stages[index], index == 0, index == num_stages - 1).to(layout.device)
        if config.moe is not None:
            moe_layers(module, config.moe, layout, moe_exchange)
        if config.embedding == "sparse" and index == 0:
            swap_embeddings(module, layout.dp)
        if config.tensor_parallel and dims.tp > 1:
            plan = tp_plan_of(module, dims.tp)
            parallelize_module(module, layout.tp_mesh, {p: TP_STYLES[s]() for p, s in plan.items()})
            tp_plan.update(plan)
        module = data_parallel.wrap(module)
        modules.append(module)
        pipeline_stages.append(PipelineStage(module, index, num_stages, layout.device, group=layout.pp_group))
    cls = get_schedule_class(config.schedule)
    if issubclass(cls, PipelineScheduleSingle):
        schedule = cls(pipeline_stages[0], config.microbatches, loss_fn=_loss, scale_grads=False)
    else:
        schedule = cls(pipeline_stages, config.microbatches, loss_fn=_loss, scale_grads=False)
    plan = ParallelPlan(
        stages=tuple(tuple(s) for s in stages),
        first=parts.first,
        last=parts.last,
        stage_ids=tuple(mine),
        tp_plan=tp_plan,
        actions=schedule_actions(config.schedule, dims.pp, config.microbatches, config.stages_per_rank),
        costs=costs,
    )
    return ParallelModel(layout, config, modules, schedule, data_parallel, plan, has_first=0 in mine,
                         has_last=num_stages - 1 in mine)  # fmt: skip


def _loss(logits: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


def _replicas(p: nn.Parameter, dims: ParallelDims, experts: set[nn.Parameter], shards: set[nn.Parameter]) -> int:
    """How many ranks of one stage hold the same values as this rank's ``p`` (dp x tp of them
    hold copies of a replicated value)."""
    if p in experts:
        split = dims.ep
    elif p in shards:
        split = dims.dp
    elif isinstance(p, DTensor):
        split = 1
        for size, placement in zip(p.device_mesh.shape, p.placements, strict=True):
            # any placement but Replicate splits (Shard, and FSDP2's _StridedShard under TP)
            split *= 1 if placement.is_replicate() else size
    else:
        split = 1
    return dims.dp * dims.tp // split


class ParallelModel:
    """This rank's part of the model and the step that trains it (built by `parallelize`).

    parts: this rank's stage modules (names as in the full model; possibly DDP/FSDP-wrapped).
    plan: the ParallelPlan (data). schedule: the torch pipelining schedule.
    """

    def __init__(
        self,
        layout: Layout,
        config: ParallelConfig,
        parts: list[nn.Module],
        schedule: object,
        data_parallel: DataParallel,
        plan: ParallelPlan,
        has_first: bool,
        has_last: bool,
    ) -> None:
        self.layout, self.config, self.parts, self.schedule = layout, config, parts, schedule
        self.data_parallel, self.plan = data_parallel, plan
        self.has_first, self.has_last = has_first, has_last
        self.seq_len = config.seq_len

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, each once (for the optimizer)."""
        seen: set[nn.Parameter] = set()
        for module in self.parts:
            for p in module.parameters():
                if p not in seen:
                    seen.add(p)
                    yield p

    def moe_layers(self) -> list[MoELayer]:
        """This rank's MoE layers (for expert-load logging)."""
        return [m for module in self.parts for m in module.modules() if isinstance(m, MoELayer)]

    def train(self, mode: bool = True) -> ParallelModel:
        for module in self.parts:
            module.train(mode)
        return self

    def step(self, ids: Tensor, targets: Tensor) -> float:
        """Forward and backward over this rank's batch: ids, targets [B, T] int64, the same on
        the ranks of one data-parallel rank (pp and tp peers). Leaves in ``.grad`` the
        gradient of the mean loss over the global batch (every dp rank's B sequences) and
        returns that loss, from the last stage, on every rank. Does not step an optimizer."""
        ids, targets = self._padded(ids, targets)
        self.data_parallel.start()
        losses: list[Tensor] = []
        args = (ids.to(self.layout.device),) if self.has_first else ()
        kwargs = {"target": targets.to(self.layout.device), "losses": losses} if self.has_last else {}
        self.schedule.step(*args, **kwargs)  # type: ignore[attr-defined]
        self.data_parallel.finish()
        return self._global_mean(losses)

    @torch.no_grad()
    def evaluate(self, ids: Tensor, targets: Tensor) -> float:
        """Forward only over this rank's batch (as `step` takes it); the mean loss over the
        global batch, from the last stage, on every rank. Touches no gradient."""
        ids, targets = self._padded(ids, targets)
        losses: list[Tensor] = []
        args = (ids.to(self.layout.device),) if self.has_first else ()
        kwargs = {"target": targets.to(self.layout.device), "losses": losses} if self.has_last else {}
        self.schedule.eval(*args, **kwargs)  # type: ignore[attr-defined]
        return self._global_mean(losses)

    def _global_mean(self, losses: list[Tensor]) -> float:
        """The mean over the global batch of the last stage's micro-batch losses (one all-reduce)."""
        local = torch.stack(losses).detach().float().mean() if losses else torch.zeros((), device=self.layout.device)
        total = self.layout.world.comm.all_reduce(local.reshape(1), op="sum")
        dims = self.layout.dims
        return float(total) / (dims.dp * dims.tp)  # type: ignore[arg-type]

    def _padded(self, ids: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        if ids.dim() != 2 or ids.shape != targets.shape:
            raise InputError(f"ids {tuple(ids.shape)} and targets {tuple(targets.shape)} must both be [B, T]")
        batch, length = ids.shape
        if batch % self.config.microbatches:
            raise InputError(
                f"a batch of {batch} sequences does not divide into microbatches={self.config.microbatches}: "
                f"give each rank a multiple of {self.config.microbatches}"
            )
        if self.seq_len is None:
            self.seq_len = length
        if length > self.seq_len:
            raise InputError(
                f"a batch of length {length} exceeds the pipeline's sequence length {self.seq_len} (fixed at the "
                "first step, or by ParallelConfig.seq_len): cut it, or set seq_len to the longest"
            )
        pad = self.seq_len - length
        if pad:
            ids = nn.functional.pad(ids, (0, pad), value=0)
            targets = nn.functional.pad(targets, (0, pad), value=IGNORE_INDEX)
        return ids, targets

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every gradient so that their global norm (over all ranks, each value counted
        once) is at most ``max_norm``; returns the norm before clipping. Collective."""
        params = [p for p in self.parameters() if p.grad is not None]
        square = torch.zeros((), dtype=torch.float64, device=self.layout.device)
        experts, shards = set(self.data_parallel.experts), set(self.data_parallel.shards)
        for p in params:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            square += grad.double().square().sum() / _replicas(p, self.layout.dims, experts, shards)
        total = self.layout.world.comm.all_reduce(square.reshape(1), op="sum")
        norm = math.sqrt(float(total))  # type: ignore[arg-type]
        if norm > max_norm:
            factor = max_norm / (norm + 1e-6)
            for p in params:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                grad.mul_(factor)
        return norm

    def close(self) -> None:
        """Remove the data-parallel hooks."""
        self.data_parallel.close()
