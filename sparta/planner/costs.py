"""What the planner knows of a model on some hardware: per-part compute and memory, and the
network's collectives, measured once and saved as JSON.

Parts are what a pipeline stage is made of: ``embed`` (token + position tables, first stage),
``attention`` and ``mlp`` (the two residual halves of a transformer block, norm included),
``moe`` (the MLP half as an MoE layer, all experts local: with expert parallelism every rank
still routes its own tokens and computes tokens x top_k expert rows, only spread over other
ranks' experts), ``head`` (final norm, output projection, loss; last stage). Each part has
forward and backward seconds as linear fits in tokens (the backward also as its input-gradient
half alone, which zero-bubble schedules run apart from the weight gradients), the bytes it
saves for backward per token, and its parameter count.

Under tensor parallelism of degree g the planner uses ``attention/tp{g}`` and ``mlp/tp{g}``
where measured: the same halves with the trainer's tp plan applied (DTensor, torch's styles)
on g ranks, their all-reduces inside. Dividing the plain part by g misses DTensor's dispatch:
a Decoder block (d 128, 256 tokens) took 6.1 ms forward + backward plain and 30.1 ms under
tp2 on this 2-core machine, against 3.1 ms for plain / 2. Parts without such a measurement
(costs from published figures, runs without torch.distributed) fall back to plain / g plus
the measured all-reduces.

Collectives are fitted per group size g ("all_reduce/g4": seconds vs bytes per rank), over
groups of g consecutive ranks, and ``p2p`` (a send from one rank to the next: what a
pipeline stage hands its neighbour). ``optimizer`` is what the trainer does per parameter
after the backward: the gradient-norm clip's pass over the gradients and AdamW's step,
seconds vs parameters.

`measure_costs` runs on every rank of a launch at once (torchrun, mpirun, horovodrun):
every rank times the same parts together and the slowest rank's median counts, so sharing a
host's cores or a node's memory bandwidth is in the figures, as it is in training. On GPUs
each rank times its own device.

A `ModelCosts` records the hardware (`hardware_fingerprint`) and the model shape it was
measured for; `ModelCosts.check` refuses to plan with costs from other hardware or another
model rather than silently predicting from them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from sparta.comm.communicator import Communicator
from sparta.errors import ConfigError
from sparta.parallel.decoder import Block, Decoder, DecoderConfig
from sparta.parallel.experts import MoESpec, moe_layers
from sparta.parallel.parallelize import TP_STYLES
from sparta.scheduling.profiler import LinearFit, ProfileConfig, Profiler

PARTS = ("embed", "attention", "mlp", "moe", "head")
# what must match for costs to hold here (threads and ranks are the measuring launch's, recorded)
HARDWARE_KEYS = ("device", "device_type", "torch")
FLOAT_BYTES = 4


@dataclass(frozen=True)
class PartCost:
    """One part's costs. fwd, bwd: seconds vs tokens (bwd: input and weight gradients
    together; bwd_input: the input gradients alone); saved_bytes_per_token: what its forward
    keeps for backward, per token; params: parameter count (all experts of an MoE layer)."""

    fwd: LinearFit
    bwd: LinearFit
    bwd_input: LinearFit
    saved_bytes_per_token: float
    params: int


@dataclass
class ModelCosts:
    """Everything a plan's step time and memory are predicted from (see the module doc).

    model: the DecoderConfig and MoESpec fields it was measured for; hardware: where;
    world: ranks of the measuring launch (collectives are fitted for group sizes up to it);
    element_bytes: bytes of one activation or gradient element (4: float32, as measured);
    slots: how many ranks of one host compute at full speed at once (its cores over each
    rank's threads; a GPU per rank: as many as there are ranks); ranks_per_host: how many
    ranks a host runs. Ranks beyond the slots share them (see simulate.py): parts are timed
    on one rank alone for that reason.
    """

    parts: dict[str, PartCost]
    comm: dict[str, LinearFit]
    optimizer: LinearFit
    model: dict[str, Any]
    hardware: dict[str, Any]
    world: int
    element_bytes: int = FLOAT_BYTES
    slots: int = 1 << 30
    ranks_per_host: int = 1

    def collective(self, op: str, group: int, nbytes: float, stride: int = 1) -> float:
        """Seconds of ``op`` ("all_reduce", "all_gather", "all_to_all", "p2p") over ``group``
        ranks ``stride`` apart (a dp group's stride is tp), moving ``nbytes`` per rank; 0 for
        a group of one. A fit for that stride ("all_reduce/g4s8", "p2p/s16") is preferred;
        measured costs have one per size, from consecutive ranks ("all_reduce/g4", "p2p")."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        keys = (f"p2p/s{stride}", "p2p") if op == "p2p" else (f"{op}/g{group}s{stride}", f"{op}/g{group}")
        for key in keys:
            if key in self.comm:
                return self.comm[key](nbytes)
        raise ConfigError(
            f"the costs have no fit for {keys[-1]!r} (measured on {self.world} ranks: {sorted(self.comm)}); "
            f"measure them on a launch of at least {group} ranks"
        )

    def check(self, model: DecoderConfig, moe: MoESpec | None, hardware: dict[str, Any] | None = None) -> None:
        """ConfigError if these costs were measured for another model shape or (when
        ``hardware`` is given) other hardware: another device model, device type or torch."""
        want = model_fingerprint(model, moe)
        if want != self.model:
            diff = {k: (self.model.get(k), v) for k, v in want.items() if self.model.get(k) != v}
            raise ConfigError(
                f"the costs were measured for another model ({diff}, as (measured, asked)); "
                "measure them again for this one (sparta plan --measure)"
            )
        if hardware is not None:
            diff = {
                k: (self.hardware.get(k), hardware.get(k))
                for k in HARDWARE_KEYS
                if self.hardware.get(k) != hardware.get(k)
            }
        if hardware is not None and diff:
            raise ConfigError(
                f"the costs were measured on other hardware ({diff}, as (measured, here)); measure them here "
                "(sparta plan --measure), or pass --any-hardware to predict that hardware on purpose"
            )

    def check_world(self, world: int) -> None:
        """ConfigError unless every group size a layout of ``world`` ranks can have was measured."""

        def has(g: int) -> bool:
            return f"all_reduce/g{g}" in self.comm or any(k.startswith(f"all_reduce/g{g}s") for k in self.comm)

        missing = [g for g in range(2, world + 1) if world % g == 0 and not has(g)]
        if missing or (world > 1 and not any(k.startswith("p2p") for k in self.comm)):
            raise ConfigError(
                f"the costs were measured on {self.world} ranks and lack groups of {missing or [2]} ranks, which "
                f"layouts of {world} ranks use: measure them on a launch of {world} ranks (sparta plan --measure)"
            )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str | Path) -> ModelCosts:
        try:
            raw = json.loads(Path(path).read_text())

            def fit(f: dict[str, Any]) -> LinearFit:
                return LinearFit(f["alpha"], f["beta"], f["rel_error"], tuple(map(tuple, f["samples"])))

            return cls(
                parts={
                    k: PartCost(
                        fit(p["fwd"]), fit(p["bwd"]), fit(p["bwd_input"]), p["saved_bytes_per_token"], p["params"]
                    )
                    for k, p in raw["parts"].items()
                },
                comm={k: fit(f) for k, f in raw["comm"].items()},
                optimizer=fit(raw["optimizer"]),
                model=raw["model"],
                hardware=raw["hardware"],
                world=raw["world"],
                element_bytes=raw.get("element_bytes", FLOAT_BYTES),
                slots=raw.get("slots", 1 << 30),
                ranks_per_host=raw.get("ranks_per_host", 1),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path} is not a costs file written by sparta plan --measure: {exc}") from exc


def model_fingerprint(model: DecoderConfig, moe: MoESpec | None) -> dict[str, Any]:
    """The fields that change a part's cost: the decoder's shape and the MoE's."""
    out: dict[str, Any] = asdict(model)
    if moe is not None:
        out.update(num_experts=moe.num_experts, top_k=moe.top_k, router=moe.router, moe_every=moe.every)
    return out


def hardware_fingerprint(device: torch.device, ranks: int) -> dict[str, Any]:
    """What makes measured costs hold elsewhere: device model, torch, threads, and the ranks
    measured together (on a shared host they compete for its cores)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return {
        "device": name,
        "device_type": device.type,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "ranks": ranks,
    }


def _saved_bytes(fn: Callable[[], Any]) -> int:
    """Bytes of the distinct tensors autograd saves for backward while ``fn`` runs."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if isinstance(t, DTensor) else t  # under tp: this rank's shard
        if local.device.type != "meta":
            seen[(local.untyped_storage().data_ptr(), local.storage_offset())] = local.numel() * local.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


class _Residual(nn.Module):
    """x + fn(norm(x)): one half of a pre-norm block."""

    def __init__(self, norm: nn.Module, fn: nn.Module) -> None:
        super().__init__()
        self.norm, self.fn = norm, fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fn(self.norm(x))


class _Embed(nn.Module):
    """The first stage's extras: ids [B, T] -> [B, T, d]."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class _Head(nn.Module):
    """The last stage's extras and the loss: [B, T, d] -> scalar."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.norm(h))
        targets = torch.zeros(logits.shape[:-1], dtype=torch.long, device=h.device)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _parts(cfg: DecoderConfig, moe: MoESpec | None) -> dict[str, nn.Module]:
    """The parts as modules of the trainer's own classes (Block, moeify's MoELayer)."""
    block = Block(cfg)
    parts: dict[str, nn.Module] = {
        "embed": _Embed(cfg),
        "attention": _Residual(block.attn_norm, block.attn),
        "mlp": _Residual(block.mlp_norm, block.mlp),
        "head": _Head(cfg),
    }
    if moe is not None:
        holder = nn.Module()
        holder.layers = nn.ModuleDict({"0": Block(cfg)})
        moe_layers(holder, dataclasses.replace(moe, every=1), None)
        moe_block = holder.layers["0"]
        parts["moe"] = _Residual(moe_block.mlp_norm, moe_block.mlp)
    return parts


def measure_costs(
    comm: Communicator,
    model: DecoderConfig,
    moe: MoESpec | None,
    device: torch.device | str = "cpu",
    group_sizes: tuple[int, ...] | None = None,
    config: ProfileConfig | None = None,
    max_sequences: int = 4,
    ranks_per_host: int | None = None,
) -> ModelCosts:
    """Time every part, every collective over groups of each size in ``group_sizes`` (default:
    every divisor of ``comm.size`` above 1: the group sizes a layout of it can have), the
    pipeline's point-to-point and AdamW's step. Parts are timed at 1, max_sequences / 4 and
    max_sequences sequences (the largest micro-batch a plan can give one rank: the global
    batch), or at ``config.rows`` tokens (whole sequences). Collective over ``comm``: every
    rank calls it and gets the same result."""
    device = torch.device(device)
    ranks_per_host = ranks_per_host or comm.size
    slots = host_slots(device, ranks_per_host)
    seq = model.seq_len
    # token counts from one sequence to the largest micro-batch a plan can give a rank
    rows = tuple(sorted({seq * n for n in (1, max(1, max_sequences // 4), max_sequences)}))
    cfg = config or ProfileConfig(rows=rows if len(rows) > 1 else (seq, 2 * seq), repeats=5)
    if any(r % seq for r in cfg.rows):
        raise ConfigError(f"ProfileConfig.rows={cfg.rows} must be multiples of seq_len={seq} (whole sequences)")
    sizes = group_sizes or tuple(g for g in range(2, comm.size + 1) if comm.size % g == 0)
    groups: dict[str, Communicator] = {}
    for g in sizes:
        if comm.size % g:
            raise ConfigError(f"group size {g} does not divide the launch's {comm.size} ranks")
        sub = comm.split_groups([list(range(s, s + g)) for s in range(0, comm.size, g)])
        assert sub is not None
        groups[f"g{g}"] = sub
    profiler = Profiler(comm, groups, cfg, device)
    fits = dict(profiler.collectives().fits)
    if "g2" in groups:
        pair = groups["g2"]
        # a Communicator has no send/recv: the pair's all-to-all of 2n bytes sends n to the other rank
        fits["p2p"] = _fit(
            profiler, cfg.bytes, lambda n: _call(pair.all_to_all, torch.ones(2 * max(1, n // 4), device=device))
        )
    torch.manual_seed(0)
    # ranks share the host: time each part on one rank alone (its speed-one time)
    active = 1 if slots < ranks_per_host else comm.size
    parts = {name: _part(profiler, module.to(device), name, model, cfg.rows, active, device)
             for name, module in _parts(model, moe).items()}  # fmt: skip
    for g in sizes if torch.distributed.is_initialized() else ():
        if model.n_heads % g or model.d_ff % g:
            continue
        # on the first g ranks, the others idle; g ranks over fewer slots ran at slots / g
        mesh = init_device_mesh(device.type, (comm.size // g, g), mesh_dim_names=("rest", "tp"))
        for name, module in _parts(model, None).items():
            if name in ("attention", "mlp"):
                parallelize_module(module.to(device), mesh["tp"], _tp_styles(name))
                cost = _part(profiler, module, name, model, cfg.rows, g, device)
                parts[f"{name}/tp{g}"] = _scaled(cost, min(1.0, slots / g))
    optimizer = _fit(profiler, (100_000, 400_000, 1_600_000), lambda n: _adamw(n, device), active)
    return ModelCosts(
        parts=parts,
        comm=fits,
        optimizer=optimizer,
        model=model_fingerprint(model, moe),
        hardware=hardware_fingerprint(device, comm.size),
        world=comm.size,
        slots=slots,
        ranks_per_host=ranks_per_host,
    )


def _part(
    profiler: Profiler,
    module: nn.Module,
    name: str,
    model: DecoderConfig,
    rows: tuple[int, ...],
    active: int,
    device: torch.device,
) -> PartCost:
    make = _ids(model, device) if name == "embed" else _hidden(model, device)
    fwd = _fit(profiler, rows, lambda n: _call(module, make(n)), active)
    bwd = _fit(profiler, rows, lambda n: _backward(module, make(n), False), active)
    if name == "embed":  # ids take no gradient: the first stage's input half is empty
        bwd_input = LinearFit(0.0, 0.0, 0.0, ())
    else:
        bwd_input = _fit(profiler, rows, lambda n: _backward(module, make(n), True), active)
    saved = _saved_bytes(_call(module, make(rows[-1])))
    params = sum(p.numel() for p in module.parameters())
    return PartCost(fwd, bwd, bwd_input, saved / rows[-1], params)


def _tp_styles(name: str) -> dict[str, Any]:
    """The trainer's tp plan (Decoder.tp_plan) for one half of a block, as a _Residual's paths."""
    prefix = "attn." if name == "attention" else "mlp."
    return {
        "fn." + path.removeprefix(prefix): TP_STYLES[style]()
        for path, style in Decoder.tp_plan.items()
        if path.startswith(prefix)
    }


def _scaled(cost: PartCost, factor: float) -> PartCost:
    def scale(f: LinearFit) -> LinearFit:
        return LinearFit(f.alpha * factor, f.beta * factor, f.rel_error, f.samples)

    return dataclasses.replace(cost, fwd=scale(cost.fwd), bwd=scale(cost.bwd), bwd_input=scale(cost.bwd_input))


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
    idle = active is not None and profiler.comm.rank >= active
    return LinearFit.fit([(n, profiler.time(_idle if idle else make(n))) for n in sizes])


def _idle() -> None:
    return None


def _call(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Callable[[], Any]:
    return lambda: fn(x)


def _ids(cfg: DecoderConfig, device: torch.device) -> Callable[[int], torch.Tensor]:
    return lambda tokens: torch.randint(0, cfg.vocab_size, (tokens // cfg.seq_len, cfg.seq_len), device=device)


def _hidden(cfg: DecoderConfig, device: torch.device) -> Callable[[int], torch.Tensor]:
    return lambda tokens: torch.randn(
        tokens // cfg.seq_len, cfg.seq_len, cfg.d_model, device=device, requires_grad=True
    )


def _backward(m: nn.Module, x: torch.Tensor, input_only: bool) -> Callable[[], object]:
    """Backward alone, through a graph built untimed (kept for the repeats): every gradient,
    or (``input_only``) the input's alone, as a zero-bubble schedule's I step computes it."""
    out = m(x)
    grad = torch.ones_like(out)
    if input_only:
        return lambda: torch.autograd.grad(out, x, grad, retain_graph=True)
    return lambda: out.backward(grad, retain_graph=True)


def _adamw(n: int, device: torch.device) -> Callable[[], object]:
    """The gradient norm (as ParallelModel.clip_grad_norm_ computes it, in float64) and AdamW."""
    p = nn.Parameter(torch.zeros(n, device=device))
    p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3)

    def step() -> None:
        p.grad.double().square().sum()  # type: ignore[union-attr]
        opt.step()

    return step
