"""The candidates of `sparta bench moe-layer` and benchmarks/moe_layer.py, each one layer's
forward + backward step.

The list and what each one is: benchmarks/moe_layer.py's docstring (its --help). Each step
also carries `step.forward()`, the layer's output alone (no backward), which the bench
compares with a one-process dropless reference (`reference_output`).
``build(name, cfg, x, place)`` returns the step, or a string saying why that candidate
cannot run here (DeepSpeed not installed, rows the layer cannot take, no exchange to pipeline).
Weights and inputs are made on CPU from fixed seeds and then moved to the config's device
and dtype, so that every device and every expert-parallel size starts from the same values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import Tensor, nn

from sparta.errors import InputError
from sparta.moe import MoELayer, tune_schedule
from sparta_tools.bench.deepspeed_peer import deepspeed_step

if TYPE_CHECKING:
    from sparta.comm import Communicator

T = TypeVar("T", Tensor, nn.Module)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class BenchConfig:
    name: str
    tokens: int
    d_model: int
    d_ff: int
    num_experts: int
    top_k: int = 2
    zero_grad: bool = False  # drop parameter gradients before each step (--zero-grad)
    device: str = "cpu"  # where inputs, weights and steps live (--device)
    dtype: str = "float32"  # inputs' and weights' dtype (--dtype); routing stays float32 in Sparta

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: known {sorted(DTYPES)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r}: cpu or cuda")

    def place(self, module_or_tensor: T) -> T:
        """``module_or_tensor`` on this config's device in its dtype. Made on CPU first, so
        that every device starts from the same values."""
        return module_or_tensor.to(device=self.device, dtype=DTYPES[self.dtype])


CONFIGS = {
    "small": BenchConfig("small", tokens=4096, d_model=512, d_ff=1024, num_experts=8),
    "large": BenchConfig("large", tokens=8192, d_model=1024, d_ff=2048, num_experts=16),
}
# Sized for one H100/H200 (about 6.6 TFLOP a step in bf16): GEMMs large enough that the step
# is the tensor cores' and not kernel launches'; "all" adds it on CUDA only, minutes a step on CPU.
GPU_CONFIGS = {"gpu": BenchConfig("gpu", tokens=16384, d_model=2048, d_ff=8192, num_experts=8)}


def all_configs(device: str) -> list[BenchConfig]:
    """What ``--config all`` times on ``device``: the CPU sizes, and on CUDA the GPU one."""
    return [*CONFIGS.values(), *(GPU_CONFIGS.values() if device == "cuda" else ())]


CANDIDATES = (
    "dense",
    "naive",
    "deepspeed_dropless",
    "deepspeed_cap1.25",
    "sparta_dropless",
    "sparta_cap1.25",
    "sparta_pipelined",
)
# Under expert parallelism the naive loop has no meaning (it holds every expert).
EP_CANDIDATES = (
    "dense",
    "deepspeed_dropless",
    "deepspeed_cap1.25",
    "sparta_dropless",
    "sparta_cap1.25",
    "sparta_pipelined",
)
AUX_LOSS_COEF = 1e-2  # Sparta's default; DeepSpeed's l_aux gets the same weight in backward

Step = Callable[[], None]


@dataclass(frozen=True)
class Place:
    """Where a candidate runs: the expert-parallel communicator (None on one process)."""

    comm: Communicator | None = None

    @property
    def ranks(self) -> int:
        return 1 if self.comm is None else self.comm.size


def _timed(
    run: Callable[[], None],
    cfg: BenchConfig,
    leaf: Tensor,
    params: Iterable[Tensor],
    forward: Callable[[], Tensor] | None = None,
) -> Step:
    """``run`` as a timed step that first drops the gradient of its input ``leaf`` (each
    step's is its own) and, with ``cfg.zero_grad``, its parameters' gradients, as
    ``optimizer.zero_grad()`` does: backward then writes them afresh instead of adding
    into the previous step's, as it does in gradient accumulation. On CUDA the step ends
    when its kernels have, so that a wall clock around it times the device's work."""
    dropped = [leaf, *params] if cfg.zero_grad else [leaf]

    def step() -> None:
        for t in dropped:
            t.grad = None
        run()
        if leaf.is_cuda:
            torch.cuda.synchronize(leaf.device)

    step.forward = forward  # type: ignore[attr-defined]
    return step


def _sparta_layer(cfg: BenchConfig, place: Place, capacity_factor: float | None) -> MoELayer:
    # Same seed on every rank and for every candidate: the experts of global id e get the
    # same weights whatever the expert-parallel size, and the router is the same gate.
    torch.manual_seed(0)
    layer = MoELayer(
        cfg.d_model,
        cfg.d_ff,
        cfg.num_experts,
        top_k=cfg.top_k,
        capacity_factor=capacity_factor,
        ep_size=place.ranks,
        comm=place.comm,
        aux_loss_coef=AUX_LOSS_COEF,
    )
    return cfg.place(layer)


def _sparta(cfg: BenchConfig, x: Tensor, place: Place, capacity_factor: float | None, tune: bool = False) -> Step | str:
    layer = _sparta_layer(cfg, place, capacity_factor)
    try:
        layer.experts.check_rows(x)
    except InputError as err:
        return str(err)
    if tune:  # the co-scheduler's choice, tuned before any step is timed
        layer.apply_schedule(tune_schedule(layer, x))
    grad = torch.randn_like(x)
    return _timed(lambda: layer(x).backward(grad), cfg, x, layer.parameters(), lambda: layer(x))


def _dense(cfg: BenchConfig, x: Tensor) -> Step:
    torch.manual_seed(0)
    w1 = cfg.place(nn.Linear(cfg.d_model, cfg.d_ff, bias=False))
    w2 = cfg.place(nn.Linear(cfg.d_ff, cfg.d_model, bias=False))
    rows = x.detach().repeat(cfg.top_k, 1).requires_grad_()
    grad = torch.randn_like(rows)
    params = [w1.weight, w2.weight]
    return _timed(lambda: w2(nn.functional.gelu(w1(rows))).backward(grad), cfg, rows, params)


def _naive(cfg: BenchConfig, x: Tensor) -> Step:
    layer = _sparta_layer(cfg, Place(), None)
    gate, experts = layer.router.gate.weight, layer.experts
    grad = torch.randn_like(x)

    def forward() -> Tensor:
        # Per-expert weight tensors, as an nn.ModuleList of experts would have.
        w1, w2 = experts.w1.unbind(0), experts.w2.unbind(0)
        # Routing in float32, as Sparta's router does: in bf16 near-ties pick other experts,
        # and the output check then compares two different functions.
        probs = torch.softmax(x.float() @ gate.float().t(), dim=-1)
        top, ids = torch.topk(probs, cfg.top_k, dim=-1)
        weights = (top / top.sum(dim=-1, keepdim=True)).to(x.dtype)
        y = torch.zeros_like(x)
        for e in range(cfg.num_experts):
            chosen = ids == e
            rows = chosen.any(dim=-1)
            w = (weights * chosen).sum(dim=-1)[rows].unsqueeze(1)
            h = nn.functional.gelu(x[rows] @ w1[e]) @ w2[e]
            y = y.index_put((rows,), w * h, accumulate=True)
        return y

    return _timed(lambda: forward().backward(grad), cfg, x, layer.parameters(), forward)


def _deepspeed(cfg: BenchConfig, x: Tensor, place: Place, drop_tokens: bool) -> Step | str:
    # Sparta's weights (same seed), copied in, so both route the same tokens to the same experts.
    reference = _sparta_layer(cfg, place, None)
    built = deepspeed_step(reference, x, place.ranks, drop_tokens, AUX_LOSS_COEF)
    if isinstance(built, str):
        return built
    run, params = built
    return _timed(run, cfg, x, params, run.forward)  # type: ignore[attr-defined]


def build(name: str, cfg: BenchConfig, x: Tensor, place: Place | None = None) -> Step | str:
    """The candidate's forward+backward step, or why it cannot run."""
    place = place or Place()
    if name == "dense":
        return _dense(cfg, x)
    if name == "naive":
        return _naive(cfg, x)
    if name.startswith("deepspeed"):
        return _deepspeed(cfg, x, place, drop_tokens=name != "deepspeed_cap1.25")
    if name == "sparta_dropless":
        return _sparta(cfg, x, place, None)
    if name == "sparta_cap1.25":
        return _sparta(cfg, x, place, 1.25)
    if name == "sparta_pipelined":
        if place.comm is None:
            return "expert parallel only: one process has no exchange to pipeline"
        return _sparta(cfg, x, place, None, tune=True)
    raise ValueError(f"unknown candidate {name!r}; known: {CANDIDATES}")


def make_input(cfg: BenchConfig, rank: int = 0, ranks: int = 1) -> Tensor:
    """This rank's slice of the one-process input (all of it on one process)."""
    torch.manual_seed(1)
    share = cfg.tokens // ranks
    return cfg.place(torch.randn(cfg.tokens, cfg.d_model)[rank * share : (rank + 1) * share].clone()).requires_grad_()


def busiest_rank_load(cfg: BenchConfig, ranks: int) -> float:
    """Rows the busiest expert-parallel rank computes over the mean, for this benchmark's
    input and gate (dropless top-k): the floor that routing imbalance sets for any dropless
    layer, Sparta's or DeepSpeed's, over a dense floor of T / ranks * top_k rows per rank."""
    layer = _sparta_layer(cfg, Place(), None)
    with torch.no_grad():
        layer(make_input(cfg))
    assert layer.last_stats is not None
    per_rank = torch.tensor(layer.last_stats.tokens_per_expert).view(ranks, -1).sum(1).double()
    return float(per_rank.max() / per_rank.mean())


TOLERANCE = {"float32": (1e-4, 1e-3), "bfloat16": (3e-2, 3e-2)}  # (atol, rtol) of the output check
UNCHECKED = {  # candidates the reference does not hold for, and why
    "dense": "the floor: an MLP on T * top_k rows, another function than the MoE layer",
    "sparta_cap1.25": "capacity drops depend on each rank's tokens, unlike the one-process reference",
    "deepspeed_cap1.25": "capacity drops depend on each rank's tokens, unlike the one-process reference",
}


def wrong_values(y: Tensor, want: Tensor, atol: float, rtol: float) -> int:
    """Elements of ``y`` off ``want`` by more than atol + rtol |want| (all of them when the
    shapes differ)."""
    if y.shape != want.shape:
        return int(want.numel())
    y, want = y.float(), want.float()
    return int((~((y - want).abs() <= atol + rtol * want.abs())).sum().item())  # NaN counts as wrong


def reference_output(cfg: BenchConfig, rank: int = 0, ranks: int = 1) -> Tensor:
    """What every dropless top-k candidate must output on this rank's slice: the one-process
    dropless layer (the same seeded weights) on the whole input, its rows of this rank."""
    layer = _sparta_layer(cfg, Place(), None)
    share = cfg.tokens // ranks
    with torch.no_grad():
        return layer(make_input(cfg))[rank * share : (rank + 1) * share]
