"""tune_schedule: choose an expert-parallel layer's pipeline degrees from a profile, as an
explicit step before training (never inside a forward).

    plan = tune_schedule(layer, sample)      # collective over layer.comm
    layer.apply_schedule(plan, hierarchical=hier)
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch
from torch import Tensor

from sparta.comm import HierarchicalAllToAll
from sparta.errors import ConfigError
from sparta.moe.dispatch import expert_capacity, plan_dispatch
from sparta.moe.layer import MoELayer
from sparta.moe.parallel import exchange_expert_counts, expert_parallel
from sparta.moe.routers import RouterOutput
from sparta.scheduling.cost_model import Calibration, CostModel, LayerShape, SchedulePlan
from sparta.scheduling.profiler import ProfileConfig, Profiler
from sparta.scheduling.tuner import UNPIPELINED, Choice, OnlineTuner


def tune_schedule(
    layer: MoELayer,
    sample: Tensor,
    hierarchical: HierarchicalAllToAll | None = None,
    config: ProfileConfig | None = None,
    margin: float = 0.03,
    trials: int = 4,
) -> SchedulePlan:
    """Profile ``layer``'s all-to-all (flat, and through ``hierarchical`` when given), one
    expert's GEMMs and its router on the layer's device, ask ``CostModel`` for its two best
    plans, then time them and flat r=1 on ``sample``'s rows (``[..., d_model]``, a batch
    like the ones it will train on; forward and backward, once to warm up, then ``trials``
    times each, round robin, compared by their medians) and return the fastest (r=1 unless
    another is ``margin`` faster), calibrated by those timings
    (``SchedulePlan.calibration``). Collective over ``layer.comm``: timings are
    agreed (slowest rank), and so is the token count planned for (the largest), so every
    rank returns the same plan. The layer's parameters, gradients and router state are left
    as they were; apply the plan with ``layer.apply_schedule``."""
    comm = layer.comm
    cfg = layer.config
    if comm is None:
        raise ConfigError(f"MoE layer {layer.name!r} has ep_size=1: there is no exchange to schedule")
    if cfg.router == "soft":
        raise ConfigError(f"MoE layer {layer.name!r}: tune_schedule plans token-choice routers; Soft MoE has none")
    device = layer.experts.w1.device
    tokens = sample.detach().reshape(-1, cfg.d_model).to(device, layer.experts.w1.dtype)
    groups: dict[str, Any] = {"world": comm}
    if hierarchical is not None:
        groups["hier"] = hierarchical
        groups["intra"] = hierarchical.intra  # the share of "hier" that blocks this thread
    profiler = Profiler(comm, groups, config, device=device)
    # this rank's hidden width: its share under expert tensor parallelism
    d_ff = layer.experts.ff_range[1] - layer.experts.ff_range[0]
    profile = profiler.collectives(("all_to_all",)) | profiler.expert_mlp(cfg.d_model, d_ff, tokens.dtype)
    router = copy.deepcopy(layer.router)  # leaves the layer's router state and RNG as they were
    with torch.random.fork_rng(devices=[]):
        profile |= profiler.router(cfg.router, lambda t: _routed_weight(router(t)), cfg.d_model, tokens.dtype)
        with torch.no_grad():
            route = router(tokens)
    capacity = None
    if cfg.capacity_factor is not None and cfg.router != "expert_choice":
        capacity = expert_capacity(tokens.shape[0], cfg.top_k, cfg.num_experts, cfg.capacity_factor)
    assert route.token_idx is not None and route.expert_idx is not None and route.weight is not None
    plan = plan_dispatch(route.token_idx, route.expert_idx, route.weight, cfg.num_experts, capacity)
    assert plan.token_idx is not None
    rows = tokens.index_select(0, plan.token_idx)
    exchanged = exchange_expert_counts(plan.counts, comm, layer.name, rows)
    most_rows = max(int(r) for r in comm.all_gather(torch.tensor([rows.shape[0]], dtype=torch.int64)))
    shape = LayerShape(
        tokens=max(1, math.ceil(most_rows / cfg.top_k)),
        top_k=cfg.top_k,
        d_model=cfg.d_model,
        d_ff=d_ff,
        ep_size=cfg.ep_size,
        element_bytes=tokens.element_size(),
    )
    model = CostModel(profile)
    best = model.plan(shape, hierarchical=None if hierarchical is not None else False, router=cfg.router)
    candidates = [*best.ranked(2), UNPIPELINED]
    tuner = OnlineTuner(comm, candidates, trials=trials, baseline=UNPIPELINED, margin=margin, warmup=1)
    experts = copy.deepcopy(layer.experts)  # its gradients are computed and dropped
    while tuner.chosen is None:
        choice: Choice = tuner.current
        route_rows = hierarchical if choice.hierarchical else None
        leaf = rows.detach().requires_grad_()
        profiler.synchronize()
        begin = time.perf_counter()
        out = expert_parallel(leaf, plan.counts, exchanged, experts, comm, choice.degrees, route_rows)
        torch.autograd.grad(out, leaf, torch.ones_like(out))
        profiler.synchronize()
        tuner.observe(time.perf_counter() - begin)
    points = []
    for choice, seconds in tuner.measured.items():
        p = model.predict_degrees(shape, choice.degrees, choice.hierarchical)
        points.append((p.forward_s + p.backward_s, p.forward_serial_s + p.backward_serial_s, seconds))
    calibrated = CostModel(profile, Calibration.fit(points))
    chosen = calibrated.predict_degrees(shape, tuner.chosen.degrees, tuner.chosen.hierarchical)
    return SchedulePlan(
        tuner.chosen.degrees,
        tuner.chosen.hierarchical,
        *calibrated.corrected(chosen),
        best.candidates,
        calibrated.calibration,
        best.router_s,
    )


def _routed_weight(route: RouterOutput) -> Tensor:
    """What a loss flows back through from a router: the routed pairs' weights (probs for a
    router that fills none)."""
    return route.weight if route.weight is not None else route.probs
