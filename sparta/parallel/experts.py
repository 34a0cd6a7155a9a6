"""Experts in the 3D trainer: which MLPs become expert-parallel MoE layers, seeded so that
any layout builds the same experts as one process, the co-scheduler's exchange, and the hold
on the routers' load state through torch's shape-learning forwards."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from sparta.comm import Communicator, HierarchicalAllToAll
from sparta.errors import ConfigError
from sparta.moe import ROUTERS, MoELayer, moeify
from sparta.parallel.decoder import Block
from sparta.parallel.dims import Layout
from sparta.scheduling.chunks import PipelineDegrees

AUTO = "auto"  # MoESpec.pipeline_degree: tuned on the first step's inputs (auto_schedule.py)


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
    # (an int, or (forward, backward) degrees, or "auto": tuned on the first step's inputs,
    # auto_schedule.py), and the two-level all-to-all over the world's nodes (intra-node
    # first, one message per node across). Under "auto" the tuner weighs the two-level one
    # against flat wherever every ep group spans several nodes evenly, hierarchical or not
    pipeline_degree: int | tuple[int, ...] | str = 1
    hierarchical: bool = False
    # under tp > 1, each expert's hidden units split over the tp ranks (Megatron-Core's expert
    # tensor parallelism: 1/tp of the experts' GEMMs and memory, two all-reduces over tp per
    # layer); False: every tp rank holds and runs whole experts
    expert_tp: bool = True
    # micro-batch overlap: each decoder Block cuts its batch into this many micro-batches of
    # whole sequences, one's attention computing while another's rows travel
    # (sparta.moe.overlapped_moe_block; dropless token choice). pipeline_degree="auto" weighs
    # 1, 2 and 4 itself, where the layout allows (parallel_config.overlap_refusal)
    overlap: int = 1
    # node-deduplicated dispatch under it: a token crosses to each node holding one of its
    # experts once, and that node sums its experts' weighted outputs before the one row goes
    # back (DeepEP's inter-node dispatch; needs every ep group over nodes of equal ranks)
    dedup: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.pipeline_degree, list):
            object.__setattr__(self, "pipeline_degree", tuple(self.pipeline_degree))
        for name in ("num_experts", "top_k", "every", "overlap"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"MoESpec.{name}={value!r} must be a positive integer")
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"MoESpec.top_k={self.top_k} exceeds num_experts={self.num_experts}: lower top_k or raise num_experts"
            )
        if self.router not in ROUTERS:
            raise ConfigError(f"MoESpec.router={self.router!r} is unknown: choose one of {', '.join(ROUTERS)}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(f"MoESpec.capacity_factor={self.capacity_factor} must be > 0, or None for dropless")
        if not isinstance(self.dedup, bool):
            raise ConfigError(f"MoESpec.dedup={self.dedup!r} must be True or False")
        asked = self.overlap_asked
        if asked and (self.router in ("soft", "expert_choice") or self.capacity_factor is not None):
            raise ConfigError(
                f"MoESpec.{asked} runs each block through micro-batches, which route as the whole batch only for "
                f"dropless token choice (router {self.router!r}, capacity_factor {self.capacity_factor}): use topk, "
                "switch, sigmoid or xmoe without a capacity, or leave it off"
            )
        if isinstance(self.pipeline_degree, str):
            if self.pipeline_degree != AUTO:
                raise ConfigError(
                    f"MoESpec.pipeline_degree={self.pipeline_degree!r}: the one word it takes is 'auto' (tuned on the "
                    "first step's inputs); else an int or (forward, backward) degrees"
                )
            if self.router == "soft":
                raise ConfigError(
                    "MoESpec.pipeline_degree='auto' tunes a token-choice router's exchange; router='soft' has none: "
                    "set a degree, or pick another router"
                )
            if self.overlap_asked:
                raise ConfigError(
                    f"MoESpec.{self.overlap_asked} with pipeline_degree='auto', which tunes the blocks' "
                    "micro-batches and deduplication itself: leave them off, or give a degree"
                )
        else:
            try:
                PipelineDegrees.of(self.pipeline_degree)
            except ConfigError as exc:
                raise ConfigError(f"MoESpec.pipeline_degree: {exc}") from None

    def is_moe(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) becomes an MoE layer: every ``every``-th,
        from the first."""
        return layer % self.every == 0

    @property
    def overlap_asked(self) -> str:
        """The block options set, as they read ("overlap=2", "dedup=True"), or "" for none."""
        asked = [f"overlap={self.overlap}"] * (self.overlap > 1) + ["dedup=True"] * self.dedup
        return " and ".join(asked)

    @property
    def balances_by_load(self) -> bool:
        """The router moves a bias by each training forward's load (sigmoid, DeepSeek-V3's
        aux-loss-free balancing): every replica must count the same load, the global
        micro-batch's, or the replicas route apart."""
        return self.router == "sigmoid"

    @property
    def auto(self) -> bool:
        """The co-scheduler's degrees are tuned on the first step (pipeline_degree="auto")."""
        return self.pipeline_degree == AUTO


def check_overlap_layers(spec: MoESpec, layers: dict[str, nn.Module]) -> None:
    """ConfigError unless every MoE layer of ``layers`` (decoder layer key -> module) is the
    Decoder's Block, which ``spec.overlap`` (or dedup) runs over micro-batches. Pure."""
    for key, layer in layers.items():
        if spec.overlap_asked and spec.is_moe(int(key)) and not isinstance(layer, Block):
            raise ConfigError(
                f"MoESpec.{spec.overlap_asked} runs a sparta.parallel.Decoder's Block over micro-batches; layer "
                f"{key} is a {type(layer).__name__}: leave it off"
            )


def moe_layers(
    module: nn.Module,
    spec: MoESpec,
    ep: Communicator | None,
    exchange: HierarchicalAllToAll | None = None,
    tp: Communicator | None = None,
    dedup: HierarchicalAllToAll | None = None,
    stats: Communicator | None = None,
) -> list[str]:
    """Turn the MLP of every ``spec.every``-th layer of ``module.layers`` into an MoELayer,
    in place, its experts split over ``ep`` (a layout's ``ep``; None: all on this rank); each
    is seeded from ``spec.seed`` and the layer's name, so any stage cut and the one-process
    model (``ep=None``) build equal experts and routers. ``exchange``: the rows' two-level
    all-to-all over ``ep`` (see `hierarchical_ep`), or None (flat). ``tp``: the layout's
    tensor-parallel group, over which each expert's hidden units are split when
    ``spec.expert_tp`` (`MoELayer.split_experts`; the whole experts are built first, so
    the slices are the one-process model's). ``dedup``: the two-level all-to-all over
    ``ep`` that ``spec.dedup`` sends tokens through (`Block.set_overlap`). ``stats``: every
    rank that trains these layers on other tokens (a layout's ``dp``, which holds ``ep``), over
    which a router that balances by load (`MoESpec.balances_by_load`) sums each forward's
    counts, one all-reduce a layer, so that its bias moves alike on every replica, as one
    process's on the global micro-batch; None: the counts of ``ep``'s ranks (one replica)."""
    # where stats holds no rank outside ep, the counts exchange over ep already sums the load
    wider = spec.balances_by_load and stats is not None and stats.size > (ep.size if ep is not None else 1)
    replaced = []
    for key, layer in module.layers.items():  # type: ignore[union-attr, operator]
        if not spec.is_moe(int(key)):
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
                pipeline_degree=1 if spec.auto else spec.pipeline_degree,  # "auto": flat until tuned
                stats_comm=stats if wider else None,
            )
        for path in paths:
            moe = layer.get_submodule(path)
            moe.set_exchange(exchange)
            if tp is not None and spec.expert_tp:
                moe.split_experts(tp)
        if spec.overlap_asked and ep is not None:  # one process: nothing travels to overlap
            check_overlap_layers(spec, {key: layer})
            if spec.dedup and dedup is None:
                raise ConfigError("MoESpec.dedup=True: pass moe_layers the two-level all-to-all over ep as dedup=")
            layer.set_overlap(spec.overlap, dedup if spec.dedup else None)
        replaced += [f"layers.{key}.{p}" for p in paths]
    return replaced


def check_expert_tp(module: nn.Module, tp: int) -> None:
    """ConfigError unless ``tp`` divides the hidden width of every MoE layer's experts in
    ``module`` (what `GroupedExperts.split_ff` needs) into slices whose rows grouped_mm
    takes (16-byte aligned in the experts' dtype). Pure: no collective."""
    for path, moe in module.named_modules():
        if isinstance(moe, MoELayer):
            try:
                moe.experts.check_ff_split(tp)
            except ConfigError as exc:
                raise ConfigError(f"{path}: {exc}") from None


def _ep_by_node(groups: list[list[int]], nodes: Sequence[Sequence[int]]) -> list[list[list[int]]]:
    """Each expert-parallel group's ranks, split by ``nodes`` (the nodes it touches)."""
    return [[ranks for node in nodes if (ranks := [r for r in group if r in node])] for group in groups]


@dataclass(frozen=True)
class EpGrid:
    """How every expert-parallel group lies over the nodes: ``nodes`` of them with ``local``
    ranks on each, ``local_stride`` world ranks apart within a node and ``node_stride``
    apart from one node's rank to the next node's of the same local index (the inter-node
    group of a two-level all-to-all)."""

    nodes: int
    local: int
    local_stride: int
    node_stride: int

    @property
    def spans_nodes(self) -> bool:
        """Whether the groups cross nodes: where a two-level all-to-all might pay."""
        return self.nodes > 1


def ep_grid(groups: list[list[int]], nodes: Sequence[Sequence[int]]) -> EpGrid | None:
    """The grid every group of ``groups`` (`ParallelDims.ep_groups`) forms over ``nodes``
    (each node's world ranks), or None where a group has unequal ranks on its nodes, or
    the groups lie differently. Pure."""
    grids = set()
    for by_node in _ep_by_node(groups, nodes):
        if len({len(ranks) for ranks in by_node}) != 1:
            return None
        first = by_node[0]
        local_stride = first[1] - first[0] if len(first) > 1 else 1
        node_stride = by_node[1][0] - first[0] if len(by_node) > 1 else 1
        grids.add(EpGrid(len(by_node), len(first), local_stride, node_stride))
    return grids.pop() if len(grids) == 1 else None


def two_level_pays(layout: Layout) -> bool:
    """Whether a two-level all-to-all can serve the expert-parallel groups and might pay:
    every group spans more than one node, with as many of its ranks on each. Pure."""
    grid = ep_grid(layout.dims.ep_groups(), layout.world.node_ranks)
    return grid is not None and grid.spans_nodes


def hierarchical_ep(layout: Layout) -> HierarchicalAllToAll:
    """A two-level all-to-all over this rank's expert-parallel group, nodes as the world's.
    Collective over the world (every rank builds its group's)."""
    world = layout.world
    intra_groups, inter_groups = [], []
    groups = layout.dims.ep_groups()
    for group, by_node in zip(groups, _ep_by_node(groups, world.node_ranks), strict=True):
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


@contextmanager
def first_forwards_keep_loads(parts: list[nn.Module]) -> Iterator[None]:
    """Inside: each stage module's first forward leaves its MoE routers' load state alone.
    That forward is torch's shape-learning run at a schedule's first step: on uninitialised
    rows after stage 0, and on stage 0 a second run of the first micro-batch; a router that
    balances by load (sigmoid's bias) must take the micro-batches' loads only."""
    handles: list[RemovableHandle] = []
    layers = [[m for m in part.modules() if isinstance(m, MoELayer)] for part in parts]

    def hold(moe: list[MoELayer], value: bool) -> None:
        for layer in moe:
            layer.load_updates = value

    for part, moe in zip(parts, layers, strict=True):
        if not moe:
            continue
        mine: list[RemovableHandle] = []

        def release(*_: Any, moe: list[MoELayer] = moe, mine: list[RemovableHandle] = mine) -> None:
            hold(moe, True)
            for handle in mine:
                handle.remove()

        mine.append(part.register_forward_pre_hook(lambda *_, moe=moe: hold(moe, False)))
        mine.append(part.register_forward_hook(release))
        handles += mine
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for moe in layers:
            hold(moe, True)
