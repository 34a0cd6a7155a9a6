"""MoELayer: route -> dispatch -> (exchange) -> experts -> (exchange back) -> combine.

The whole forward is ``MoELayer.forward`` and the two helpers under it, read top to bottom;
the same code runs on CPU and CUDA, and autograd derives the backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from sparta.comm import all_reduce_backward, all_reduce_forward
from sparta.errors import ConfigError, InputError
from sparta.moe.config import MoEConfig
from sparta.moe.dispatch import (
    DispatchPlan,
    combine,
    expert_capacity,
    gather_rows,
    plan_dispatch,
    soft_combine,
    soft_dispatch,
)
from sparta.moe.experts import GroupedExperts
from sparta.moe.parallel import T, exchange_expert_counts, expert_parallel, fail_together
from sparta.moe.routers import RouterOutput, build_router
from sparta.scheduling.cost_model import SchedulePlan

if TYPE_CHECKING:
    from sparta.comm import Communicator, Exchange


@dataclass
class MoEStats:
    """Counts from the last forward, summed over the ranks of the layer's ``stats_comm``
    (by default its expert-parallel group; one process: this process's own).

    ``tokens_per_expert[e]``: (token, expert) pairs expert ``e`` processed (after capacity;
    for Soft MoE, slots). ``routed_per_expert[e]``: pairs the router sent to ``e`` before
    capacity. ``tokens_dropped``: pairs removed by capacity (their tokens got nothing from
    that expert).
    """

    tokens_per_expert: list[int]
    routed_per_expert: list[int]
    tokens_dropped: int


class _AuxLossInBackward(torch.autograd.Function):
    """Identity on ``carrier`` whose backward also back-propagates ``aux_loss`` with gradient
    1, so the aux loss trains the router without the user adding it to their loss.

    The carrier is the routing weights rather than the layer output: an output made by a
    custom Function could not be modified in place by the caller (``y += x``)."""

    @staticmethod
    def forward(ctx: Any, carrier: Tensor, aux_loss: Tensor, scale: float) -> Tensor:
        ctx.aux_dtype, ctx.aux_device, ctx.scale = aux_loss.dtype, aux_loss.device, scale
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=ctx.aux_device), None


class MoELayer(nn.Module):
    """A Mixture-of-Experts MLP: ``y = moe(x)``, ``x`` ``[..., d_model]`` -> same shape.

    Built from a ``MoEConfig`` (``MoELayer(config)``) or from its fields, positional or by
    name (``MoELayer(512, 1024, 8, top_k=2, router="topk")``); see ``MoEConfig`` for every
    option. Each token goes to experts chosen by the router; their outputs are summed with
    the routing weights. In training, backward also applies ``aux_loss_coef * aux_loss +
    z_loss_coef * z_loss`` to the router: do not add them to your loss (a loss back-propagated
    scaled, by a GradScaler or 1 / N over N accumulated backwards: set ``aux_loss_scale`` to
    that scale, so the aux loss keeps its weight beside it). After each forward,
    ``aux_loss`` holds that weighted sum (detached, float32) and ``last_stats`` the
    per-expert counts (``MoEStats``, read from the device when first asked for).

    ``ep_size > 1`` shards the experts over the ``ep_size`` ranks of ``comm`` (a
    ``sparta.comm.Communicator``): rank ``r`` holds global experts ``[r * E / ep_size,
    (r + 1) * E / ep_size)``. Each forward then issues, in this order on every rank, three
    all-to-alls (counts, rows, outputs); the counts exchange also carries each rank's input
    verdict (an error on one rank raises on all), the rows' dtype and width, and the counts
    behind ``last_stats``, and is the forward's one host synchronisation. Each backward
    issues two all-to-alls. With ``ep_size == 1`` (and no ``split_experts``) no collective is
    issued and dropless routing never synchronises with the host. ``split_experts`` adds one
    all-reduce over tp to each forward and each backward.

    ``stats_comm`` sums those counts over every rank that trains the layer instead, by one
    all-reduce after the outputs' all-to-all (e.g. over the world, when expert-parallel
    groups are replicated for data parallelism): ``last_stats`` then counts the global batch
    and the sigmoid router's balancing bias stays identical on every replica. It must
    contain ``comm``'s ranks; every rank of it runs the layer's forward.

    ``pipeline_degree`` cuts the row exchanges into chunks that overlap the experts'
    compute; ``exchange`` (a ``sparta.comm.HierarchicalAllToAll`` over ``comm``'s ranks)
    moves the rows intra-node first, then inter-node; ``apply_schedule`` takes both from a
    ``SchedulePlan`` (``sparta.moe.tune_schedule``). Outputs and gradients depend on neither.

    ``name`` identifies the layer in error messages (give it the module path).
    """

    def __init__(
        self,
        *args: Any,
        comm: Communicator | None = None,
        name: str = "moe",
        stats_comm: Communicator | None = None,
        exchange: Exchange | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        config = _config_of(args, options)
        first_expert = 0
        if config.ep_size > 1:
            if comm is None or comm.size != config.ep_size:
                got = "no comm" if comm is None else f"a comm of size {comm.size}"
                raise ConfigError(
                    f"ep_size={config.ep_size} needs a Communicator of size {config.ep_size}, "
                    f"got {got}: pass comm= for the expert-parallel group, or set ep_size=1"
                )
            first_expert = comm.rank * config.num_local_experts
        self.config = config
        self.comm = comm if config.ep_size > 1 else None
        if stats_comm is not None and self.comm is not None and stats_comm.size % self.comm.size:
            raise ConfigError(
                f"stats_comm of size {stats_comm.size} cannot contain the expert-parallel group of "
                f"size {self.comm.size}: pass the world (or data-parallel) communicator that holds it"
            )
        self.stats_comm = stats_comm if stats_comm is not None else self.comm
        self.degrees = config.degrees
        self.exchange: Exchange | None = None
        self.set_exchange(exchange)
        self.schedule_plan: SchedulePlan | None = None
        self.router = build_router(config)
        self.experts = GroupedExperts(
            config.num_local_experts,
            config.d_model,
            config.d_ff,
            activation=config.activation,
            first_expert=first_expert,
            bias=config.expert_bias,
        )
        self.name = name
        self.tp: Communicator | None = None  # the group the experts' hidden units split over (split_experts)
        self.aux_loss: Tensor = torch.zeros(())
        # the gradient the aux and z losses enter backward with: 1, as if added to a loss
        # back-propagated as it is. Set it to the scale your loss is back-propagated with
        # (a GradScaler's scale, 1 / N when N backwards accumulate) to keep their weight
        self.aux_loss_scale = 1.0
        # False: training forwards leave the router's load state alone (a pass whose rows are
        # not the batch's, such as torch's pipeline stages learning their shapes)
        self.load_updates = True
        self._stats: Tensor | None = None
        self._counts_checked = False  # the counts exchange's layout, proven at the first forward
        self._stats_checked = False  # and the counts summed over stats_comm

    @classmethod
    def from_config(
        cls,
        config: MoEConfig,
        comm: Communicator | None = None,
        name: str = "moe",
        stats_comm: Communicator | None = None,
        exchange: Exchange | None = None,
    ) -> MoELayer:
        """Build a layer from a (e.g. YAML-loaded) ``MoEConfig``."""
        return cls(config, comm=comm, name=name, stats_comm=stats_comm, exchange=exchange)

    @property
    def name(self) -> str:
        """The layer's name in logs, stats and collective names (its router's)."""
        return self.router.name

    @name.setter
    def name(self, value: str) -> None:
        self.router.name = value

    def set_exchange(self, exchange: Exchange | None) -> None:
        """Move the rows through ``exchange`` (same ranks as ``comm``), or ``comm`` if None."""
        if exchange is not None and (self.comm is None or exchange.size != self.comm.size):
            raise ConfigError(
                "exchange= moves the rows of an expert-parallel layer and must span the same ranks as "
                f"comm (size {None if self.comm is None else self.comm.size}), got size {exchange.size}: "
                "build it with sparta.comm.HierarchicalAllToAll over comm, or leave it out"
            )
        self.exchange = exchange

    def apply_schedule(self, plan: SchedulePlan, hierarchical: Exchange | None = None) -> None:
        """Take ``plan``'s pipeline degrees, and its flat or hierarchical exchange
        (``hierarchical``, when the plan chose it). Every rank of ``comm`` must apply the same plan."""
        if plan.hierarchical and hierarchical is None:
            raise ConfigError(
                f"MoE layer {self.name!r}: the plan moves rows hierarchically; pass the "
                "HierarchicalAllToAll it was profiled with as hierarchical="
            )
        self.set_exchange(hierarchical if plan.hierarchical else None)
        self.degrees = plan.degrees
        self.schedule_plan = plan

    @property
    def last_stats(self) -> MoEStats | None:
        """The last forward's counts (None before the first); reading them waits for the device."""
        if self._stats is None:
            return None
        num_experts = self.config.num_experts
        values = self._stats.tolist()
        return MoEStats(
            tokens_per_expert=values[num_experts : 2 * num_experts],
            routed_per_expert=values[:num_experts],
            tokens_dropped=values[-1],
        )

    def forward(self, x: Tensor) -> Tensor:
        self._guard(lambda: self._check_input(x))
        cfg = self.config
        if cfg.router == "soft":
            # Soft MoE mixes the tokens of each sequence into slots grouped by expert.
            seq_len = x.shape[-2] if x.dim() > 1 else 1
            groups = x.reshape(math.prod(x.shape[:-2]), seq_len, cfg.d_model)
            route = self._guard(lambda: self.router(groups))
            slots = soft_dispatch(groups, route.dispatch_weights, cfg.num_experts)
            out = self._experts(slots.rows, slots, slots.rows.shape[0])
            return soft_combine(out, self._attach_aux_loss(route, route.combine_weights), cfg.num_experts).view(x.shape)
        tokens = x.reshape(-1, cfg.d_model)
        route = self._guard(lambda: self.router(tokens))
        capacity = None
        if cfg.capacity_factor is not None and cfg.router != "expert_choice":
            capacity = expert_capacity(tokens.shape[0], cfg.top_k, cfg.num_experts, cfg.capacity_factor)
        weight = self._attach_aux_loss(route, route.weight)
        per_token = None if route.expert_ids is None else route.expert_ids.shape[1]
        plan = plan_dispatch(route.token_idx, route.expert_idx, weight, cfg.num_experts, capacity, per_token)
        rows = gather_rows(tokens, plan)
        # token choice keeps at most top_k rows a token; expert choice's count is fixed
        most = rows.shape[0] if cfg.router == "expert_choice" else tokens.shape[0] * cfg.top_k
        out = self._experts(rows, plan, most)
        return combine(out, plan, tokens.shape[0]).view(x.shape)

    def _experts(self, rows: Tensor, plan: DispatchPlan, most: int) -> Tensor:
        """``rows`` ``[N, d]`` grouped by global expert through their experts, wherever they
        live: ``[N, d]`` in the same order; records the plan's counts. Under `split_experts`
        the tp ranks' partial outputs are summed here, after the exchange back, sent as
        ``most`` rows (N's bound from the input's shape alone): torch's pipelining infers
        stage shapes from uninitialised inputs, on which tp ranks route differently, and
        the collective must still match."""
        stats = stats_vector(plan.routed, plan.counts, plan.dropped)
        tp = self.tp
        if tp is not None:
            rows = all_reduce_backward(rows, tp, most)
        if self.comm is None:
            self.record_counts(stats)
            out = self.experts(rows, plan.counts)
        else:
            exchanged = exchange_expert_counts(
                plan.counts, self.comm, self.name, rows, stats=stats, check=not self._counts_checked
            )
            self._counts_checked = True
            out = expert_parallel(rows, plan.counts, exchanged, self.experts, self.comm, self.degrees, self.exchange)
            self.record_counts(stats, exchanged.stats)
        return out if tp is None else all_reduce_forward(out, tp, most)

    def split_experts(self, tp: Communicator) -> None:
        """Expert tensor parallelism: split every expert's hidden units over ``tp``'s ranks
        (`GroupedExperts.split_ff`), whose partial outputs this layer sums with one
        all-reduce of its ``[tokens x top_k, d_model]`` rows per forward (and their
        gradients with one per backward). Every rank of ``tp`` must feed the layer the same
        tokens (as tensor parallelism's replicated activations are) and run it in step;
        ``comm`` (expert parallelism) is then one group per tp rank. Collective-free."""
        self.experts.split_ff(tp.rank, tp.size)
        self.tp = tp

    def _check_input(self, x: Tensor) -> None:
        d_model = self.config.d_model
        if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[-1] != d_model:
            shape = f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else f"a {type(x).__name__}"
            raise InputError(
                f"MoE layer {self.name!r} expects [..., d_model={d_model}] input, got {shape}: "
                "pass tokens with d_model features in the last dimension"
            )
        if not x.is_floating_point():
            raise InputError(f"MoE layer {self.name!r} got {x.dtype} input: pass floating-point activations")
        self.experts.check_rows(x)

    def _guard(self, step: Callable[[], T]) -> T:
        """Local work before the first collective: an error on one rank raises on all."""
        num_experts, device = self.config.num_experts, self.experts.w1.device
        check = not self._counts_checked
        return fail_together(step, num_experts, _stats_len(num_experts), self.comm, self.name, device, check)

    def _attach_aux_loss(self, route: RouterOutput, carrier: Tensor) -> Tensor:
        total = self.config.aux_loss_coef * route.aux_loss + self.config.z_loss_coef * route.z_loss
        return self.attach_aux_loss(carrier, total)

    def attach_aux_loss(self, carrier: Tensor, total: Tensor) -> Tensor:
        """``carrier`` (the routing weights) as is, whose backward in training also
        back-propagates ``total`` (the scaled aux and z losses, a scalar) with gradient 1;
        ``aux_loss`` keeps ``total`` detached."""
        self.aux_loss = total.detach()
        if self.training and total.requires_grad and carrier.requires_grad:
            return _AuxLossInBackward.apply(carrier, total, self.aux_loss_scale)
        return carrier

    def record_counts(self, local: Tensor, summed: Tensor | None = None) -> None:
        """Keep the counts behind ``last_stats`` (``stats_vector``, summed over a forward's
        dispatches) and feed the router its load, summed over ``stats_comm`` (one all-reduce):
        ``summed`` is their sum over ``comm`` from the counts exchange, enough when
        ``stats_comm`` is ``comm``."""
        if summed is not None and self.stats_comm is self.comm:
            counts = summed
        elif self.stats_comm is not None:
            # the vector's length is the same at every forward: checked at the first only
            counts = self.stats_comm.all_reduce(local, op="sum", check=not self._stats_checked)
            self._stats_checked = True
        else:
            counts = local
        if self.training and self.load_updates:
            self.router.update_load(counts[: self.config.num_experts])
        self._stats = counts

    def extra_repr(self) -> str:
        cfg = self.config
        return (
            f"name={self.name!r}, router={cfg.router}, top_k={cfg.top_k}, "
            f"capacity_factor={cfg.capacity_factor}, ep_size={cfg.ep_size}"
        )


def _config_of(args: tuple[Any, ...], options: dict[str, Any]) -> MoEConfig:
    """``MoELayer``'s arguments as a ``MoEConfig``: one given whole, or its fields."""
    if len(args) == 1 and isinstance(args[0], MoEConfig) and not options:
        return args[0]
    known = [f.name for f in fields(MoEConfig)]
    unknown = sorted(set(options) - set(known))
    if unknown or len(args) > len(known):
        raise ConfigError(
            f"MoELayer got unknown options {unknown or list(args[len(known) :])}: pass a MoEConfig, "
            f"or its fields {known}"
        )
    try:
        return MoEConfig(*args, **options)
    except TypeError as err:  # a field missing or given twice
        raise ConfigError(f"MoELayer: {err}; the fields are {known}") from None


def stats_vector(routed: Tensor, kept: Tensor, dropped: Tensor) -> Tensor:
    """Counts as `MoELayer.record_counts` takes them: ``[routed (E), kept (E), dropped (1)]``
    int64, the pairs routed to and kept by each expert and those capacity dropped (0-dim),
    the counts behind ``last_stats``."""
    return torch.cat([routed, kept, dropped.reshape(1)])


def _stats_len(num_experts: int) -> int:
    return 2 * num_experts + 1
