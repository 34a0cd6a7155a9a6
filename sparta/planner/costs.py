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
the measured all-reduces. Likewise ``moe/ep{g}``: the MoE layer with its experts split over g
adjacent ranks, its exchanges inside (the counts exchange with its host synchronisation, the
rows out and back, the busiest rank's experts), used for plans whose ep groups are adjacent
(tp 1); without it the planner adds two measured all-to-alls each way to ``moe``.
``moe/tp{g}`` has the experts' hidden units split over g adjacent ranks instead (its tp
all-reduces inside), and ``moe/ep{e}tp{t}`` both: ep groups of e ranks t apart, as in the
trainer's mesh.

Collectives are fitted per group shape, seconds vs bytes per rank: "all_reduce/g4" over
groups of 4 consecutive ranks, "all_reduce/g4s2" over groups of 4 ranks 2 apart, for every
size and stride a layout of the launch can give a group (the trainer's mesh is pp x dp x tp,
tp innermost: a dp group's stride is tp, a pipeline hop's tp x dp). On one host the stride
changes nothing; across hosts it decides which groups cross the slower link, and only a
measurement per stride says what that costs. ``p2p`` and ``p2p/s{s}`` are a send from one
rank to the one 1 or s ranks on (what a pipeline stage hands its neighbour), timed on the
pairs {0, s}, {1, 1 + s}, ... of the world: a pipeline of more than two stages also has hops
that these pairs do not cover, so a hop across a node's link is read off a stride whose
pairs all cross one (`ModelCosts.hop`). ``optimizer`` is what the trainer does per
parameter after the backward: the gradient-norm clip's pass over the gradients and AdamW's
step, seconds vs parameters.

`sparta.planner.measure.measure_costs` measures them on the hardware at hand;
`sparta.planner.hardware.analytic_costs` derives them from published figures.

A `ModelCosts` records the hardware (`hardware_fingerprint`) and the model shape it was
measured for; `ModelCosts.check` refuses to plan with costs from other hardware or another
model rather than silently predicting from them.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from sparta.errors import ConfigError
from sparta.parallel.decoder import DecoderConfig
from sparta.parallel.experts import MoESpec
from sparta.scheduling.profiler import LinearFit

PARTS = ("embed", "attention", "mlp", "moe", "head")
# what must match for costs to hold here (threads and ranks are the measuring launch's, recorded)
HARDWARE_KEYS = ("device", "device_type", "torch")
FLOAT_BYTES = 4


@dataclass(frozen=True)
class PartCost:
    """One part's costs. fwd, bwd: seconds vs tokens (bwd: input and weight gradients
    together; bwd_input: the input gradients alone); saved_bytes_per_token: what its forward
    keeps for backward, per token; params: parameter count (all experts of an MoE layer);
    busy: the share of those seconds the rank computes (1 but for the parts measured under
    their groups, tp halves and ep MoE layers, whose collectives wait inside them): ranks
    sharing a host's cores slow the busy share down, not the waiting (see simulate.py);
    zero_bubble: (I + W) / B, what torch's zero-bubble schedules' split of the backward into
    an input and a weight pass costs over one backward (zero_bubble.py; 1 where not timed:
    the embedding, the head, costs from published figures or without torch.distributed)."""

    fwd: LinearFit
    bwd: LinearFit
    bwd_input: LinearFit
    saved_bytes_per_token: float
    params: int
    busy: float = 1.0
    zero_bubble: float = 1.0


@dataclass
class ModelCosts:
    """Everything a plan's step time and memory are predicted from (see the module doc).

    model: the DecoderConfig and MoESpec fields it was measured for; hardware: where;
    world: ranks of the measuring launch (collectives are fitted for group sizes up to it);
    element_bytes: bytes of one activation or gradient element (4: float32, as measured);
    slots: how many ranks of one host compute at full speed at once (its cores over each
    rank's threads; a GPU per rank: as many as there are ranks); ranks_per_host: how many
    ranks share a host's cores. Ranks beyond the slots share them (see simulate.py): parts
    are timed on one rank alone for that reason. ranks_per_node: how many consecutive ranks
    sit behind one network link (the launcher's local size): a pipeline hop between ranks of
    two nodes crosses it (`hop`). The two differ on the emulated cluster, whose nodes share
    this machine's cores unpinned: 8 ranks on one host, 4 behind each link.
    link_per_rank: each rank has a network link of its own (a GPU's NIC, in published
    figures), where measured links are one per node, shared by its ranks' sends.
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
    ranks_per_node: int = 1
    link_per_rank: bool = False

    def collective(self, op: str, group: int, nbytes: float, stride: int = 1) -> float:
        """Seconds of ``op`` ("all_reduce", "all_gather", "all_to_all", "p2p") over ``group``
        ranks ``stride`` apart (a dp group's stride is tp), moving ``nbytes`` per rank; 0 for
        a group of one. A fit for that stride ("all_reduce/g4s8", "p2p/s16") is preferred;
        measured costs have one per size, from consecutive ranks ("all_reduce/g4", "p2p").
        Read off the measured sizes (`LinearFit.interpolate`): on 8 ranks sharing 2 cores a
        4-rank all-gather took 10.5 ms at 64 KiB and 228 ms at 4 MiB, and the least-squares
        line through both predicted 3.4 ms for the first."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        keys = (f"p2p/s{stride}", "p2p") if op == "p2p" else (f"{op}/g{group}s{stride}", f"{op}/g{group}")
        for key in keys:
            if key in self.comm:
                return self.comm[key].interpolate(nbytes)
        raise ConfigError(
            f"the costs have no fit for {keys[-1]!r} (measured on {self.world} ranks: {sorted(self.comm)}); "
            f"measure them on a launch of at least {group} ranks"
        )

    def hop(self, nbytes: float, first: int, second: int, replicas: int) -> float:
        """Seconds for ``replicas`` consecutive ranks from ``first`` to each send ``nbytes`` to
        the rank as far on from ``second`` (a pipeline stage's activations to another
        pipeline rank's replicas, all at once). Where a pair crosses a node's link, the time
        is read off a measured pair stride that crosses every node (a multiple of
        ``ranks_per_node``), its bytes scaled to the pairs that share the link (the
        measurement sent from every rank of a node at once); else off pairs ``replicas``
        apart (`collective`), as adjacent pipeline ranks are. On the emulated cluster a hop
        across its 100 Mbit/s link took the loopback pairs' figure, and a pp4 plan ran 0.39 s
        a step against 0.26 s predicted."""
        node = self.ranks_per_node

        def measured(stride: int) -> bool:
            return f"p2p/s{stride}" in self.comm or (stride == 1 and "p2p" in self.comm)

        across = [s for s in range(node, self.world, node) if measured(s)]
        if self.link(first, second, replicas) is None or not across:
            return self.collective("p2p", 2, nbytes, replicas)
        # of the measurement's pairs on one link; a link of each rank's own carries its pair alone
        share = 1.0 if self.link_per_rank else min(replicas, node) / node
        return self.collective("p2p", 2, nbytes * share, across[0])

    def link(self, first: int, second: int, replicas: int) -> tuple[int, int] | None:
        """The nodes (from, to) whose link the sends of `hop` cross, or None within a node."""
        node = self.ranks_per_node
        for j in range(replicas):
            if (first + j) // node != (second + j) // node:
                return (first + j) // node, (second + j) // node
        return None

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
        if missing:
            raise ConfigError(
                f"the costs were measured on {self.world} ranks and lack groups of {missing} ranks, which "
                f"layouts of {world} ranks use: measure them on a launch of {world} ranks (sparta plan --measure)"
            )
        if world > 1 and not any(k.startswith("p2p") for k in self.comm):
            raise ConfigError(
                f"the costs hold no point-to-point fits, which the pipeline layouts of {world} ranks use: measure "
                f"them on a launch of {world} ranks (sparta plan --measure)"
            )

    def save(self, path: str | Path) -> None:
        """Write the costs as JSON (`load` reads them back)."""
        Path(path).write_text(json.dumps(asdict(self), indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str | Path) -> ModelCosts:
        """Costs written by `save`; ConfigError naming the file when it is not one."""
        try:
            raw = json.loads(Path(path).read_text())

            def fit(f: dict[str, Any]) -> LinearFit:
                return LinearFit(f["alpha"], f["beta"], f["rel_error"], tuple(map(tuple, f["samples"])))

            return cls(
                parts={
                    k: PartCost(
                        fit(p["fwd"]),
                        fit(p["bwd"]),
                        fit(p["bwd_input"]),
                        p["saved_bytes_per_token"],
                        p["params"],
                        p.get("busy", 1.0),
                        p.get("zero_bubble", 1.0),
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
                ranks_per_node=raw.get("ranks_per_node", raw.get("ranks_per_host", 1)),
                link_per_rank=raw.get("link_per_rank", False),
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
