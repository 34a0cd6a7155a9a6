"""MoELayer: router -> dispatch -> experts (local or expert-parallel) -> combine."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from sparta.errors import ConfigError, InputError
from sparta.moe.config import MoEConfig
from sparta.moe.dispatch import (
    Dispatched,
    DispatchPlan,
    expert_capacity,
    plan_dispatch,
    soft_combine,
    soft_dispatch,
)
from sparta.moe.experts import GroupedExperts
from sparta.moe.parallel import T, exchange_counts, expert_parallel_mlp, fail_together
from sparta.moe.routers import RouterOutput, build_router
from sparta.scheduling.cost_model import Calibration, CostModel, LayerShape, SchedulePlan
from sparta.scheduling.pipeline import Exchange
from sparta.scheduling.profiler import Profiler
from sparta.scheduling.tuner import UNPIPELINED, Choice, OnlineTuner

if TYPE_CHECKING:
    from sparta.comm import Communicator


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
    def forward(ctx: Any, carrier: Tensor, aux_loss: Tensor) -> Tensor:
        ctx.aux_dtype, ctx.aux_device = aux_loss.dtype, aux_loss.device
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, torch.ones((), dtype=ctx.aux_dtype, device=ctx.aux_device)


class MoELayer(nn.Module):
    """A Mixture-of-Experts MLP: ``y = moe(x)``, ``x`` ``[..., d_model]`` -> same shape.

    Each token goes to experts chosen by ``router`` (see ``MoEConfig`` for the choices and
    options); their outputs are summed with the routing weights. In training, backward also
    applies ``aux_loss_coef * aux_loss + z_loss_coef * z_loss`` to the router: do not add
    them to your loss. After each forward, ``aux_loss`` holds that weighted sum (detached,
    float32) and ``last_stats`` the per-expert counts (``MoEStats``).

    ``ep_size > 1`` shards the experts over the ``ep_size`` ranks of ``comm`` (a
    ``sparta.comm.Communicator``): rank ``r`` holds global experts ``[r * E / ep_size,
    (r + 1) * E / ep_size)``. Each forward then issues, in this order on every rank, three
    all-to-alls (counts, rows, outputs); the counts exchange also sums, over ``comm``, the
    counts behind ``last_stats`` and the sigmoid router's load. Each backward issues two
    all-to-alls. With ``ep_size == 1`` ``comm`` is ignored and no collective is issued.

    ``stats_comm`` sums those counts over every rank that trains the layer instead, by one
    all-reduce after the outputs' all-to-all (e.g. over the world, when expert-parallel
    groups are replicated for data parallelism, or when ``ep_size == 1`` under data
    parallelism): ``last_stats`` then counts the global batch and the sigmoid router's
    balancing bias stays identical on every replica. It must contain ``comm``'s ranks;
    every rank of it runs the layer's forward.

    ``pipeline_degree`` (an option) cuts those row exchanges into chunks that overlap the
    experts' compute (``"auto"``: profiled and planned at the first forward, the plan kept
    in ``schedule_plan``); ``exchange`` (a ``sparta.comm.HierarchicalAllToAll`` over ``comm``'s
    ranks) moves the rows intra-node first, then inter-node. Outputs and gradients do not
    depend on either.

    ``name`` identifies the layer in error messages (give it the module path).
    Extra keyword ``options`` are the other ``MoEConfig`` fields (``jitter_eps``,
    ``bias_update_rate``, ``xmoe_dim``, ``slots_per_expert``, ``expert_gemm``, ``expert_bias``).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        top_k: int = 2,
        router: str = "topk",
        capacity_factor: float | None = None,
        activation: str = "gelu",
        ep_size: int = 1,
        aux_loss_coef: float = 1e-2,
        z_loss_coef: float = 1e-3,
        comm: Communicator | None = None,
        name: str = "moe",
        stats_comm: Communicator | None = None,
        exchange: Exchange | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        known = {f.name for f in fields(MoEConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"MoELayer got unknown options {unknown}: the options are {sorted(known)}")
        config = MoEConfig(
            d_model=d_model,
            d_ff=d_ff,
            num_experts=num_experts,
            top_k=top_k,
            router=router,
            capacity_factor=capacity_factor,
            activation=activation,
            ep_size=ep_size,
            aux_loss_coef=aux_loss_coef,
            z_loss_coef=z_loss_coef,
            **options,
        )
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
        if exchange is not None and (self.comm is None or exchange.size != self.comm.size):
            raise ConfigError(
                "exchange= moves the rows of an expert-parallel layer and must span the same ranks as "
                f"comm (size {None if self.comm is None else self.comm.size}), got size {exchange.size}: "
                "build it with sparta.comm.HierarchicalAllToAll over comm, or leave it out"
            )
        self.exchange = exchange
        # None until "auto" has profiled and planned (at the first expert-parallel forward).
        self.degrees = config.degrees
        self.schedule_plan: SchedulePlan | None = None
        self.router = build_router(config)
        self.experts = GroupedExperts(
            config.num_local_experts,
            config.d_model,
            config.d_ff,
            activation=config.activation,
            gemm=config.expert_gemm,
            first_expert=first_expert,
            bias=config.expert_bias,
        )
        self.name = name
        self.aux_loss: Tensor = torch.zeros(())
        self.last_stats: MoEStats | None = None
        self._counts_checked = False  # the counts exchange's layout, proven at the first forward

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
        values = {f.name: getattr(config, f.name) for f in fields(MoEConfig)}
        return cls(**values, comm=comm, name=name, stats_comm=stats_comm, exchange=exchange)

    @property
    def name(self) -> str:
        return self.router.name

    @name.setter
    def name(self, value: str) -> None:
        self.router.name = value

    def forward(self, x: Tensor) -> Tensor:
        self._guard(lambda: self._check_input(x))
        d_model = self.config.d_model
        if self.config.router == "soft":
            seq_len = x.shape[-2] if x.dim() > 1 else 1
            sequences = math.prod(x.shape[:-2])
            return self._forward_soft(x.reshape(sequences, seq_len, d_model)).view(x.shape)
        return self._forward_sparse(x.reshape(-1, d_model)).view(x.shape)

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

    def _guard(self, step: Callable[[], T]) -> T:
        """Local work before the first collective: an error on one rank raises on all."""
        num_experts, device = self.config.num_experts, self.experts.w1.device
        stats_len, check = _stats_len(num_experts), not self._counts_checked
        return fail_together(step, num_experts, stats_len, self.comm, self.name, device, check)

    def _forward_sparse(self, tokens: Tensor) -> Tensor:
        cfg = self.config
        route = self._guard(lambda: self.router(tokens))
        capacity = None
        if cfg.capacity_factor is not None and cfg.router != "expert_choice":
            capacity = expert_capacity(tokens.shape[0], cfg.top_k, cfg.num_experts, cfg.capacity_factor)
        weight = self._attach_aux_loss(route, route.weight)
        plan = plan_dispatch(route.token_idx, route.expert_idx, weight, cfg.num_experts, capacity)
        if self.comm is None:
            self._record(plan)
            return self.experts.forward_tokens(tokens, plan)
        return self._expert_parallel(plan, tokens)

    def _forward_soft(self, groups: Tensor) -> Tensor:
        route = self._guard(lambda: self.router(groups))
        slots = soft_dispatch(groups, route.dispatch_weights, self.config.num_experts)
        out = self._run_experts(slots)
        combine_weights = self._attach_aux_loss(route, route.combine_weights)
        return soft_combine(out, combine_weights, self.config.num_experts)

    def _run_experts(self, routed: Dispatched) -> Tensor:
        if self.comm is None:
            self._record(routed)
            return self.experts(routed.rows, routed.counts, routed.counts_list)
        return self._expert_parallel(routed, routed.rows)

    def _expert_parallel(self, plan: DispatchPlan, x: Tensor) -> Tensor:
        """``plan``'s pairs through every rank's experts: ``x`` the tokens ``[T, d]`` (a sparse
        router's plan; returns them combined, ``[T, d]``) or the rows ``[N, d]`` grouped by
        expert (Soft MoE's slots; returns ``[N, d]``). See ``expert_parallel_mlp``."""
        assert self.comm is not None
        stats, check = _stats_vector(plan), not self._counts_checked
        recv_counts, summed = exchange_counts(plan.counts, self.comm, self.name, x, stats=stats, check=check)
        self._counts_checked = True
        if self.degrees is None:
            self._plan_schedule(plan, x, recv_counts)
        exchange = self.exchange if self.schedule_plan is None or self.schedule_plan.hierarchical else None
        out = expert_parallel_mlp(x, plan, recv_counts, self.experts, self.comm, self.degrees, exchange)
        self._record(plan, summed)
        return out

    def _plan_schedule(self, plan: DispatchPlan, x: Tensor, recv_counts: Tensor) -> None:
        """``pipeline_degree="auto"``: profile this layer's all-to-all (flat, and hierarchical
        when an ``exchange`` is given), one expert's GEMMs and the router; take the cost
        model's two best plans and flat r=1, run this forward's rows through each (forward
        and backward; once to warm up, then twice timed) and keep the fastest, r=1 unless
        another is 3% faster; those timings calibrate the model
        (``schedule_plan.calibration``). Collective over
        ``comm``; the timings are agreed (slowest rank), and so is the token count planned
        for (the largest), so every rank picks the same plan."""
        assert self.comm is not None
        cfg, num_rows = self.config, sum(plan.counts_list)
        groups: dict[str, Any] = {"world": self.comm}
        if self.exchange is not None:
            groups["hier"] = self.exchange
            intra = getattr(self.exchange, "intra", None)  # a HierarchicalAllToAll's node group
            if intra is not None:
                groups["intra"] = intra  # the share of "hier" that blocks this thread
        profiler = Profiler(self.comm, groups)
        profile = profiler.collectives(("all_to_all",)) | profiler.expert_mlp(cfg.d_model, cfg.d_ff, x.dtype)
        router = None
        if cfg.router != "soft":  # Soft MoE routes whole sequences, not [tokens, d_model]
            probe = copy.deepcopy(self.router)  # leaves the layer's router state and RNG as they were
            with torch.random.fork_rng(devices=[]):
                profile |= profiler.router(cfg.router, lambda t: _routed_weight(probe(t)), cfg.d_model, x.dtype)
            router = cfg.router
        local_rows = torch.tensor([num_rows], dtype=torch.int64)
        most_rows = max(int(r) for r in self.comm.all_gather(local_rows))
        shape = LayerShape(
            tokens=max(1, math.ceil(most_rows / cfg.top_k)),
            top_k=cfg.top_k,
            d_model=cfg.d_model,
            d_ff=cfg.d_ff,
            ep_size=cfg.ep_size,
            element_bytes=x.element_size(),
        )
        model = CostModel(profile)
        best = model.plan(shape, hierarchical=None if self.exchange is not None else False, router=router)
        candidates = [*best.ranked(2), UNPIPELINED]
        tuner = OnlineTuner(self.comm, candidates, trials=2, baseline=UNPIPELINED, margin=0.03, warmup=1)
        while tuner.chosen is None:
            tuner.observe(self._time_exchange(plan, x, recv_counts, tuner.current))
        points = []
        for choice, seconds in tuner.measured.items():
            p = model.predict_degrees(shape, choice.degrees, choice.hierarchical)
            points.append((p.forward_s + p.backward_s, p.forward_serial_s + p.backward_serial_s, seconds))
        calibrated = CostModel(profile, Calibration.fit(points))
        chosen = calibrated.predict_degrees(shape, tuner.chosen.degrees, tuner.chosen.hierarchical)
        self.schedule_plan = SchedulePlan(
            tuner.chosen.degrees,
            tuner.chosen.hierarchical,
            *calibrated.corrected(chosen),
            best.candidates,
            calibrated.calibration,
            best.router_s,
        )
        self.degrees = self.schedule_plan.degrees

    def _time_exchange(self, plan: DispatchPlan, x: Tensor, recv_counts: Tensor, choice: Choice) -> float:
        """Seconds of this layer's expert-parallel part, forward and backward, under `choice`
        (the experts' gradients are computed and dropped: parameters keep theirs)."""
        assert self.comm is not None
        exchange = self.exchange if choice.hierarchical else None
        leaf = x.detach().requires_grad_()
        detached = replace(plan, weight=None if plan.weight is None else plan.weight.detach())
        begin = time.perf_counter()
        with torch.enable_grad():
            args = (self.experts, self.comm, choice.degrees, exchange)
            out = expert_parallel_mlp(leaf, detached, recv_counts, *args)
            torch.autograd.grad(out, leaf, torch.ones_like(out))
        return time.perf_counter() - begin

    def _attach_aux_loss(self, route: RouterOutput, carrier: Tensor) -> Tensor:
        total = self.config.aux_loss_coef * route.aux_loss + self.config.z_loss_coef * route.z_loss
        self.aux_loss = total.detach()
        if self.training and total.requires_grad and carrier.requires_grad:
            return _AuxLossInBackward.apply(carrier, total)
        return carrier

    def _record(self, routed: DispatchPlan, summed: Tensor | None = None) -> None:
        """Set ``last_stats`` (and feed the router its load) from ``routed``'s counts summed
        over ``stats_comm``: ``summed`` is their sum over ``comm`` from the counts exchange,
        enough when ``stats_comm`` is ``comm``."""
        num_experts = self.config.num_experts
        if summed is not None and self.stats_comm is self.comm:
            counts = summed
        elif self.stats_comm is not None:
            counts = self.stats_comm.all_reduce(_stats_vector(routed), op="sum")
        else:
            counts = _stats_vector(routed)
        if self.training:
            self.router.update_load(counts[:num_experts])
        values = counts.tolist()
        self.last_stats = MoEStats(
            tokens_per_expert=values[num_experts : 2 * num_experts],
            routed_per_expert=values[:num_experts],
            tokens_dropped=values[-1],
        )

    def extra_repr(self) -> str:
        cfg = self.config
        return (
            f"name={self.name!r}, router={cfg.router}, top_k={cfg.top_k}, "
            f"capacity_factor={cfg.capacity_factor}, ep_size={cfg.ep_size}"
        )


def _stats_vector(plan: DispatchPlan) -> Tensor:
    """``[routed (E), kept (E), dropped (1)]`` int64: the counts behind ``last_stats``."""
    return torch.cat([plan.routed, plan.counts, plan.counts.new_tensor([plan.dropped])])


def _stats_len(num_experts: int) -> int:
    return 2 * num_experts + 1


def _routed_weight(route: RouterOutput) -> Tensor:
    """What a loss flows back through from a router: the routed pairs' weights (probs for a
    router that fills none)."""
    return route.weight if route.weight is not None else route.probs
