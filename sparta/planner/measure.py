"""Measuring a `ModelCosts` on the hardware at hand (`sparta plan --measure`).

`measure_costs` runs on every rank of a launch at once (torchrun, mpirun, horovodrun):
every rank times the same parts together and the slowest rank's median counts, so sharing a
host's cores or a node's memory bandwidth is in the figures, as it is in training. On GPUs
each rank times its own device. The parts are the trainer's own modules (parts.py: `Block`'s
halves, the MoE layer, the embedding and head as the Decoder has them); the collectives run over
every group shape a layout of the launch can form (`group_shapes`). Parts that talk inside
are timed under their groups as the trainer runs them too: a block's halves under tp
(``attention/tp2``), the MoE layer with its experts split over ep (``moe/ep4``), with
their hidden units split over tp (``moe/tp2``), and with both (``moe/ep2tp2``).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.utils import get_total_norm

from sparta.comm.communicator import Communicator
from sparta.errors import ConfigError
from sparta.parallel.decoder import DecoderConfig
from sparta.parallel.experts import MoESpec
from sparta.scheduling.profiler import LinearFit, ProfileConfig, Profiler

from .costs import FLOAT_BYTES, ModelCosts, PartCost, hardware_fingerprint, model_fingerprint
from .parts import (
    experts_split,
    hidden_states,
    model_parts,
    moe_part,
    residual_tp_styles,
    saved_activation_bytes,
    token_ids,
)
from .zero_bubble import alone_group, idle, zero_bubble_factor


def measure_costs(
    comm: Communicator,
    model: DecoderConfig,
    moe: MoESpec | None,
    device: torch.device | str = "cpu",
    group_sizes: tuple[int, ...] | None = None,
    config: ProfileConfig | None = None,
    max_sequences: int = 4,
    ranks_per_node: int | None = None,
) -> ModelCosts:
    """Time every part, every collective over groups of each size in ``group_sizes`` (default:
    every divisor of ``comm.size`` above 1: the group sizes a layout of it can have) at every
    stride a layout can give them (`group_shapes`), the pipeline's point-to-point at each
    stride, and AdamW's step. Parts are timed at 1, max_sequences / 4 and
    max_sequences sequences (the largest micro-batch a plan can give one rank: the global
    batch), or at ``config.rows`` tokens (whole sequences). Collective over ``comm``: every
    rank calls it and gets the same result. ``ranks_per_node``: ranks behind one network link
    (the launcher's local size; default: the world); the ranks sharing one host's cores are
    found here (`sharing_cores`)."""
    device = torch.device(device)
    ranks_per_host = sharing_cores(comm)
    slots = host_slots(device, ranks_per_host)
    seq = model.seq_len
    # token counts from one sequence to the largest micro-batch a plan can give a rank
    rows = tuple(sorted({seq * n for n in (1, max(1, max_sequences // 4), max_sequences)}))
    # On a GPU a step's host queues part after part while the device runs them: four runs a
    # sample, one wait, so no part pays a wait's idle gap that a step does not. On CPU every
    # run is synchronous and repeating it would change nothing but the time measuring takes.
    back_to_back = 4 if device.type == "cuda" else 1
    cfg = config or ProfileConfig(rows=rows if len(rows) > 1 else (seq, 2 * seq), repeats=5, back_to_back=back_to_back)
    if any(r % seq for r in cfg.rows):
        raise ConfigError(f"ProfileConfig.rows={cfg.rows} must be multiples of seq_len={seq} (whole sequences)")
    sizes = group_sizes or tuple(g for g in range(2, comm.size + 1) if comm.size % g == 0)
    groups: dict[str, Communicator] = {}
    for g, stride in group_shapes(comm.size, sizes):
        sub = comm.split_groups(strided_groups(comm.size, g, stride))
        assert sub is not None
        groups[f"g{g}" if stride == 1 else f"g{g}s{stride}"] = sub
    profiler = Profiler(comm, groups, cfg, device)
    fits = dict(profiler.collectives().fits)
    for name, pair in groups.items():
        if name == "g2" or name.startswith("g2s"):
            # a Communicator has no send/recv: the pair's all-to-all of 2n bytes sends n to the other rank
            key = "p2p" if name == "g2" else f"p2p/{name[2:]}"
            fits[key] = _fit(profiler, cfg.bytes, lambda n, p=pair: _call(p.all_to_all, _floats(2 * n, device)))
    torch.manual_seed(0)
    # ranks share the host: time each part on one rank alone (its speed-one time)
    active = 1 if slots < ranks_per_host else comm.size
    modules = {name: module.to(device) for name, module in model_parts(model, moe).items()}
    parts = {name: _part(profiler, module, name, model, cfg.rows, active, device) for name, module in modules.items()}
    if torch.distributed.is_initialized():
        # torch's zero-bubble split of a block's halves, timed through its schedules on a
        # group of each rank alone (zero_bubble.py)
        alone = alone_group(comm)
        tokens = cfg.rows[len(cfg.rows) // 2]
        for name in ("attention", "mlp", "moe"):
            if name in parts:
                backward_s = parts[name].bwd(tokens)
                factor = zero_bubble_factor(
                    profiler, modules[name], hidden_states(model, device), tokens, backward_s, alone, active
                )
                parts[name] = dataclasses.replace(parts[name], zero_bubble=factor)
    for g in sizes if torch.distributed.is_initialized() else ():
        if model.n_heads % g or model.d_ff % g:
            continue
        # on the first g ranks, the others idle; g ranks over fewer slots ran at slots / g
        mesh = init_device_mesh(device.type, (comm.size // g, g), mesh_dim_names=("rest", "tp"))
        for name, module in model_parts(model, None).items():
            if name in ("attention", "mlp"):
                parallelize_module(module.to(device), mesh["tp"], residual_tp_styles(name))
                parts[f"{name}/tp{g}"] = _grouped_part(profiler, module, name, model, cfg.rows, g, slots, device)
        if moe is not None and moe.expert_tp and experts_split(model, g):
            # the MoE layer with its experts' hidden units over g adjacent ranks, its two
            # all-reduces inside
            module = moe_part(model, moe, None, groups[f"g{g}"]).to(device)
            parts[f"moe/tp{g}"] = _grouped_part(profiler, module, "moe", model, cfg.rows, g, slots, device)
    for g in sizes if moe is not None else ():
        if moe.num_experts % g:  # type: ignore[union-attr]
            continue
        # the MoE layer with its experts over g ranks, its exchanges inside (counts, rows
        # out and back, the host synchronisation on the splits, the busiest rank's experts);
        # each rank's own group builds its layer alike
        module = moe_part(model, moe, groups[f"g{g}"]).to(device)  # type: ignore[arg-type]
        parts[f"moe/ep{g}"] = _grouped_part(profiler, module, "moe", model, cfg.rows, g, slots, device)
    for e, t in _ep_tp_pairs(comm.size, sizes, model, moe):
        # both at once, as the trainer's mesh lays them: tp groups of t adjacent ranks, ep
        # groups of e ranks t apart, on the first e x t ranks
        module = moe_part(model, moe, groups[f"g{e}s{t}"], groups[f"g{t}"]).to(device)  # type: ignore[arg-type]
        parts[f"moe/ep{e}tp{t}"] = _grouped_part(profiler, module, "moe", model, cfg.rows, e * t, slots, device)
    optimizer = _fit(profiler, (100_000, 400_000, 1_600_000), lambda n: _adamw(n, device), active)
    # the halves timed under their groups split their backward as the plain ones do
    parts = {k: dataclasses.replace(p, zero_bubble=parts[k.split("/")[0]].zero_bubble) for k, p in parts.items()}
    return ModelCosts(
        parts=parts,
        comm=fits,
        optimizer=optimizer,
        model=model_fingerprint(model, moe),
        hardware=hardware_fingerprint(device, comm.size),
        world=comm.size,
        slots=slots,
        ranks_per_host=ranks_per_host,
        ranks_per_node=ranks_per_node or comm.size,
    )


def _ep_tp_pairs(
    world: int, sizes: tuple[int, ...], model: DecoderConfig, moe: MoESpec | None
) -> list[tuple[int, int]]:
    """(ep, tp) of every layout with experts over ep and their hidden units over tp that the
    launch's ``world`` ranks hold and the model divides."""
    if moe is None or not moe.expert_tp:
        return []
    return [
        (e, t)
        for e in sizes
        for t in sizes
        if world % (e * t) == 0 and moe.num_experts % e == 0 and experts_split(model, t)
    ]


def group_shapes(world: int, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """(size, stride) of every group a layout of ``world`` ranks can form of each size in
    ``sizes``: a group of g ranks s apart tiles the world when g x s divides it."""
    bad = [g for g in sizes if g < 2 or world % g]
    if bad:
        raise ConfigError(f"group sizes {bad} do not divide the launch's {world} ranks; give divisors above 1")
    return [(g, s) for g in sizes for s in range(1, world // g + 1) if world % (g * s) == 0]


def strided_groups(world: int, size: int, stride: int) -> list[list[int]]:
    """The world's ranks as groups of ``size`` ranks ``stride`` apart: [[0, 2], [1, 3]] for 4, 2, 2."""
    span = size * stride
    return [[base + off + i * stride for i in range(size)] for base in range(0, world, span) for off in range(stride)]


def _part(
    profiler: Profiler,
    module: nn.Module,
    name: str,
    model: DecoderConfig,
    rows: tuple[int, ...],
    active: int,
    device: torch.device,
) -> PartCost:
    make = token_ids(model, device) if name == "embed" else hidden_states(model, device)
    fwd = _fit(profiler, rows, lambda n: _call(module, make(n)), active)
    # the backward as a step runs it: on a fresh graph, which it frees as it goes (timed with
    # its forward, less the forward). Repeated on one retained graph it missed that: the MoE
    # layer's (d 128, 256 tokens, one thread) took 3.9-4.1 ms fresh against 3.0-3.4 retained
    both = _fit(profiler, rows, lambda n: _backward_fresh(module, make(n)), active)
    forward = dict(fwd.samples)
    bwd = LinearFit.fit([(n, max(0.0, t - forward[n])) for n, t in both.samples])
    if name == "embed":  # ids take no gradient: the first stage's input half is empty
        bwd_input = LinearFit(0.0, 0.0, 0.0, ())
    else:
        bwd_input = _fit(profiler, rows, lambda n: _input_backward(module, make(n)), active)
    saved = saved_activation_bytes(_call(module, make(rows[-1])), module)
    params = sum(p.numel() for p in module.parameters())
    return PartCost(fwd, bwd, bwd_input, saved / rows[-1], params)


def _grouped_part(
    profiler: Profiler,
    module: nn.Module,
    name: str,
    model: DecoderConfig,
    rows: tuple[int, ...],
    g: int,
    slots: int,
    device: torch.device,
) -> PartCost:
    """A part that talks inside, timed on the first ``g`` ranks (one group, the others idle):
    as speed-one seconds (g ranks over fewer slots ran at slots / g), with ``busy``, its CPU
    seconds over those (on GPUs the devices' own time is not the process's: left at 1)."""
    cost = _scaled(_part(profiler, module, name, model, rows, g, device), min(1.0, slots / g))
    busy = 1.0
    if device.type == "cpu":
        busy = min(1.0, _cpu_share(profiler, module, model, rows[-1], g, device) * max(1.0, g / slots))
    return dataclasses.replace(cost, busy=busy)


def _scaled(cost: PartCost, factor: float) -> PartCost:
    def scale(f: LinearFit) -> LinearFit:
        return LinearFit(f.alpha * factor, f.beta * factor, f.rel_error, f.samples)

    return dataclasses.replace(cost, fwd=scale(cost.fwd), bwd=scale(cost.bwd), bwd_input=scale(cost.bwd_input))


def _cpu_share(
    profiler: Profiler, module: nn.Module, model: DecoderConfig, tokens: int, active: int, device: torch.device
) -> float:
    """Process CPU seconds over wall seconds of ``module``'s forward and backward on the first
    ``active`` ranks (their mean; every rank calls it): below 1 where the part waits, in its
    collectives, for peers."""
    ratio = 0.0
    if profiler.comm.rank < active:
        x = hidden_states(model, device)(tokens)
        run = _backward_fresh(module, x)
        run()  # warm-up
        cpu, wall = [], []
        for _ in range(profiler.config.repeats):
            c0, w0 = time.process_time(), time.perf_counter()
            run()
            profiler.synchronize()
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
        ratio = statistics.median(cpu) / max(statistics.median(wall), 1e-12)
    every = profiler.comm.all_gather(torch.tensor([ratio], dtype=torch.float64))
    return float(torch.cat(every)[:active].mean())  # type: ignore[arg-type]


def _backward_fresh(m: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    def run() -> None:
        out = m(x)
        out.backward(torch.ones_like(out))

    return run


def sharing_cores(comm: Communicator) -> int:
    """The most ranks of ``comm`` that share one set of cores: the same host name and CPU
    affinity. The emulated cluster's unpinned nodes are one machine's namespaces, of one
    host name and the same CPUs; pinned nodes, and real ones, have cores of their own.
    Collective; the same on every rank (it decides which ranks time the parts)."""
    mine = f"{socket.gethostname()}|{sorted(os.sched_getaffinity(0))}".encode()
    gathered = comm.all_gather(torch.tensor([zlib.crc32(mine)], dtype=torch.int64))
    keys = [int(t.item()) for t in gathered]  # type: ignore[union-attr]
    return max(keys.count(k) for k in keys)


def host_slots(device: torch.device, ranks_per_host: int) -> int:
    """Ranks of one host that compute at full speed at once: one per GPU, or this process's
    CPUs over its threads."""
    if device.type != "cpu":
        return ranks_per_host
    return max(1, len(os.sched_getaffinity(0)) // torch.get_num_threads())


def _fit(
    profiler: Profiler, sizes: tuple[int, ...], make: Callable[[int], Callable[[], object]], active: int | None = None
) -> LinearFit:
    """Seconds of ``make(n)()`` at every size n (the slowest rank's median), fitted; ``active``:
    run on the first ``active`` ranks only, the others idle (1: a part's speed-one time, see
    ModelCosts.slots; g: a tensor-parallel part on its group)."""
    resting = active is not None and profiler.comm.rank >= active
    return LinearFit.fit([(n, profiler.time(idle if resting else make(n))) for n in sizes])


def _floats(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.ones(max(1, nbytes // FLOAT_BYTES), device=device)


def _call(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Callable[[], Any]:
    return lambda: fn(x)


def _input_backward(m: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    """The input's gradient alone, as a zero-bubble schedule's I step computes it, through a
    graph built untimed (kept for the repeats)."""
    out = m(x)
    grad = torch.ones_like(out)
    return lambda: torch.autograd.grad(out, x, grad, retain_graph=True)


def _adamw(n: int, device: torch.device) -> Callable[[], object]:
    """The gradient norm (as ParallelModel.clip_grad_norm_ computes it) and fused AdamW (as
    `sparta train` steps it)."""
    p = nn.Parameter(torch.zeros(n, device=device))
    p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)

    def step() -> None:
        get_total_norm([p.grad]).double()  # type: ignore[list-item]
        opt.step()

    return step
