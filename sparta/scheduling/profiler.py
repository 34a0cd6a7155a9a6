"""Online profiler: time collectives, expert GEMMs and routers at several sizes, fit t = alpha + beta * n.

Every operation is timed on every rank and the slowest rank's time is kept (a collective is
as slow as its slowest member), so every rank ends with the same fits and hence makes the
same scheduling decisions: the pipeline needs identical degrees on every rank.

    profiler = Profiler(world.comm, {"world": world.comm, "intra": intra, "inter": inter})
    profile = profiler.collectives() | profiler.expert_mlp(d_model=512, d_ff=1024)
    profile |= profiler.router("topk", lambda x: layer.router(x).weight, d_model=512)
    profile.save("profile.json"); Profile.load("profile.json").fit("all_to_all", "inter")
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from sparta.comm.communicator import Communicator
from sparta.comm.hierarchical import HierarchicalAllToAll
from sparta.errors import ConfigError, InputError

COLLECTIVES = ("all_to_all", "all_reduce", "all_gather")
KIB = 1024


@dataclass(frozen=True)
class LinearFit:
    """t = alpha + beta * n, fitted by least squares.

    alpha: seconds (latency); beta: seconds per unit of n (bytes for collectives, rows for
    GEMMs); rel_error: root-mean-square of (fit - measured) / measured over the samples;
    samples: the (n, seconds) points it was fitted to.
    """

    alpha: float
    beta: float
    rel_error: float
    samples: tuple[tuple[float, float], ...]

    def __call__(self, n: float) -> float:
        """Predicted seconds for size n."""
        return self.alpha + self.beta * n

    def interpolate(self, n: float) -> float:
        """Seconds for size n read off the samples: linear between the two measured sizes
        around n, and beyond the smallest or largest along the fit's slope from it; the fit
        itself without samples. For costs that are not one line over the sizes measured (a
        collective whose latency floor hides its bandwidth at small sizes: least squares
        fits the large sizes and misses that floor). Below the smallest size the time is
        at least that size's in proportion (t0 * n / n0: a cost of a fixed part and a part
        per byte falls no faster), which the slope alone can undercut: across a 100 Mbit/s
        link it put a 16 KiB send at 0 s where 64 KiB took 7.9 ms."""
        points = sorted(self.samples)
        if not points:
            return self(n)
        if n <= points[0][0]:
            n0, t0 = points[0]
            return max(t0 + self.beta * (n - n0), t0 * n / n0 if n0 > 0 else 0.0, 0.0)
        if n >= points[-1][0]:
            return points[-1][1] + self.beta * (n - points[-1][0])
        for (n0, t0), (n1, t1) in zip(points, points[1:], strict=False):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        raise AssertionError("unreachable: n lies within the samples")

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float]]) -> LinearFit:
        """Least squares over (n, t); alpha and beta are clamped at 0 (a cost is never negative)."""
        if len({n for n, _ in samples}) < 2:
            raise InputError(f"LinearFit.fit needs samples at two or more sizes, got {list(samples)}")
        # plain floats, not BLAS: vectorised kernels may round differently from one process
        # to the next, and every rank must derive the very same fit from the agreed samples
        xs, ts = [float(n) for n, _ in samples], [float(s) for _, s in samples]
        x_mean, t_mean = sum(xs) / len(xs), sum(ts) / len(ts)
        beta = sum((x - x_mean) * (t - t_mean) for x, t in zip(xs, ts, strict=True)) / sum(
            (x - x_mean) ** 2 for x in xs
        )
        alpha = t_mean - beta * x_mean
        if alpha < 0:  # refit through the origin
            alpha, beta = 0.0, sum(x * t for x, t in zip(xs, ts, strict=True)) / sum(x * x for x in xs)
        beta = max(beta, 0.0)
        rel = math.sqrt(
            sum(((alpha + beta * x - t) / max(t, 1e-12)) ** 2 for x, t in zip(xs, ts, strict=True)) / len(xs)
        )
        return cls(alpha, beta, rel, tuple((float(n), float(s)) for n, s in samples))


@dataclass
class Profile:
    """Fits keyed "op/group" (e.g. "all_to_all/inter") or "op/shape" (e.g. "expert_fwd/512x1024")."""

    fits: dict[str, LinearFit] = field(default_factory=dict)

    def fit(self, op: str, group: str) -> LinearFit:
        """The fit of ``op`` on ``group`` (e.g. "all_to_all", "inter"); ConfigError naming the fits it has otherwise."""
        key = f"{op}/{group}"
        if key not in self.fits:
            raise ConfigError(f"the profile has no fit for {key!r}; it has {sorted(self.fits)}. Profile it first")
        return self.fits[key]

    def __or__(self, other: Profile) -> Profile:
        return Profile({**self.fits, **other.fits})

    def save(self, path: str | Path) -> None:
        """Write the fits as JSON (`load` reads them back)."""
        Path(path).write_text(json.dumps({k: asdict(f) for k, f in sorted(self.fits.items())}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """A profile written by `save`."""
        raw = json.loads(Path(path).read_text())
        return cls(
            {
                k: LinearFit(f["alpha"], f["beta"], f["rel_error"], tuple(map(tuple, f["samples"])))
                for k, f in raw.items()
            }
        )


@dataclass(frozen=True)
class ProfileConfig:
    """bytes: per-rank payload sizes for collectives; rows: GEMM row counts; repeats: timed
    samples per size (the median counts); warmup: untimed runs first (connections, caches);
    back_to_back: runs per sample, queued one after another with one wait for the device at
    the end, the sample their mean: on a GPU, how an operation costs inside a step whose host
    runs ahead of the device, where 1 adds the idle gap that each wait leaves before the next
    launch."""

    bytes: tuple[int, ...] = (64 * KIB, 256 * KIB, 1024 * KIB, 4096 * KIB)
    rows: tuple[int, ...] = (256, 1024, 4096)
    repeats: int = 3
    warmup: int = 1
    back_to_back: int = 1

    def __post_init__(self) -> None:
        if len(set(self.bytes)) < 2 or min(self.bytes) < 4:
            raise ConfigError(f"ProfileConfig.bytes = {self.bytes}; give two or more sizes >= 4 bytes")
        if len(set(self.rows)) < 2 or min(self.rows) < 1:
            raise ConfigError(f"ProfileConfig.rows = {self.rows}; give two or more row counts >= 1")
        if self.repeats < 1 or self.warmup < 0:
            raise ConfigError(f"ProfileConfig repeats = {self.repeats}, warmup = {self.warmup}; use >= 1 and >= 0")
        if self.back_to_back < 1:
            raise ConfigError(f"ProfileConfig.back_to_back = {self.back_to_back}; use >= 1 (runs per timed sample)")


class Profiler:
    """Times operations on `groups` ({name: communicator}); `comm` spans every rank of every
    group and agrees the timings (slowest rank). All methods are collective over `comm`. A
    HierarchicalAllToAll may be a group (named "hier" for the cost model) for "all_to_all".
    Tensors are made on `device` (the device the profiled layer runs on), and every timed run
    ends by waiting for that device (`torch.get_device_module(device).synchronize`), so a
    CUDA run is timed as the GPU executes it, not as the host queues it."""

    def __init__(
        self,
        comm: Communicator,
        groups: Mapping[str, Communicator | HierarchicalAllToAll],
        config: ProfileConfig | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.comm, self.groups, self.config = comm, dict(groups), config or ProfileConfig()
        self.device = torch.device(device)

    def synchronize(self) -> None:
        """Wait for the work queued on the profiled device."""
        torch.get_device_module(self.device).synchronize(self.device)

    def time(self, run: Callable[[], object]) -> float:
        """Median seconds of `run` on this rank, then the slowest rank's (collective over `comm`)."""
        for _ in range(self.config.warmup):
            run()
        self.synchronize()
        self.comm.barrier()
        times = []
        runs = self.config.back_to_back
        for _ in range(self.config.repeats):
            begin = time.perf_counter()
            for _ in range(runs):
                run()
            self.synchronize()
            times.append((time.perf_counter() - begin) / runs)
        mine = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64)
        every = self.comm.all_gather(mine)
        return float(torch.cat(every).max())  # type: ignore[arg-type]

    def collectives(self, ops: Sequence[str] = COLLECTIVES) -> Profile:
        """all-to-all, all-reduce, all-gather on every group at every size; n = bytes per rank."""
        unknown = [op for op in ops if op not in COLLECTIVES]
        if unknown:
            raise ConfigError(f"Profiler.collectives: unknown ops {unknown}; known: {COLLECTIVES}")
        fits = {}
        for name, group in self.groups.items():
            for op in ops:
                samples = []
                for nbytes in self.config.bytes:
                    n = max(group.size, nbytes // 4 // group.size * group.size)  # float32, divisible
                    x = torch.ones(n, device=self.device)
                    samples.append((n * 4, self.time(lambda op=op, x=x, g=group: getattr(g, op)(x))))
                fits[f"{op}/{name}"] = LinearFit.fit(samples)
        return Profile(fits)

    def compute(self, name: str, make: Callable[[int], Callable[[], object]]) -> Profile:
        """Time `make(rows)()` at every row count; fit under `name`."""
        return Profile({name: LinearFit.fit([(n, self.time(make(n))) for n in self.config.rows])})

    def forward_backward(
        self,
        shape: str,
        fn: Callable[[torch.Tensor], torch.Tensor],
        d_in: int,
        dtype: torch.dtype = torch.float32,
        op: str = "expert",
    ) -> Profile:
        """Row-wise `fn` ([rows, d_in] -> a tensor) timed forward ("{op}_fwd/{shape}") and
        backward alone ("{op}_bwd/{shape}", through a graph built untimed)."""

        def forward(rows: int) -> Callable[[], object]:
            x = torch.randn(rows, d_in, dtype=dtype, device=self.device)
            return lambda: fn(x)

        def backward(rows: int) -> Callable[[], object]:
            out = fn(torch.randn(rows, d_in, dtype=dtype, device=self.device, requires_grad=True))
            grad = torch.ones_like(out)
            return lambda: out.backward(grad, retain_graph=True)

        return self.compute(f"{op}_fwd/{shape}", forward) | self.compute(f"{op}_bwd/{shape}", backward)

    def router(
        self, name: str, route: Callable[[torch.Tensor], torch.Tensor], d_model: int, dtype: torch.dtype = torch.float32
    ) -> Profile:
        """A router, forward ("router_fwd/{name}") and backward ("router_bwd/{name}"), over
        [tokens, d_model] (n = tokens). `route` returns what the loss flows back through
        (e.g. the chosen experts' weights): the routing and its top-k run inside it, so the
        sort or top-k a router does is timed too, which is what grows with the expert count."""
        return self.forward_backward(name, route, d_model, dtype, op="router")

    def expert_mlp(self, d_model: int, d_ff: int, dtype: torch.dtype = torch.float32) -> Profile:
        """One expert's two GEMMs (d_model -> d_ff -> d_model, GELU), under "{d_model}x{d_ff}"."""
        w1 = torch.randn(d_model, d_ff, dtype=dtype, device=self.device, requires_grad=True)
        w2 = torch.randn(d_ff, d_model, dtype=dtype, device=self.device, requires_grad=True)
        return self.forward_backward(
            f"{d_model}x{d_ff}", lambda x: torch.nn.functional.gelu(x @ w1) @ w2, d_model, dtype
        )
