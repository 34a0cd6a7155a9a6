"""Cost model of an expert-parallel MoE exchange, and the choice of its pipeline degrees.

From a Profile's fits it predicts the time of the dispatch -> experts -> combine part of an
MoE layer, forward and backward, for a pipeline degree r and a flat or hierarchical
all-to-all, by replaying the exact issue order of `pipeline.run_pipeline` on two resources:
the network (one FIFO channel: the slow link carries one transfer's bytes at a time; a fit's
alpha delays its transfer's arrival but leaves the channel to the next) and this rank's
compute thread. The hierarchical all-to-all's intra-node step blocks the compute
thread (it is waited before the call returns); its inter-node step queues on the network.
Measured whole ("all_to_all/hier"), the intra-node fit, when profiled, says how much of it
blocks.

A profile fitted apart from training misses what a real step adds (cores shared between
ranks and gloo's threads, transfers that overlap compute less than perfectly), so the model
takes a Calibration fitted from a few real steps: measured ~ scale * (serial - efficiency *
(serial - overlapped)), with the (overlapped, serial) seconds the model gives each plan.

    model = CostModel(profile)
    plan = model.plan(LayerShape(tokens=4096, top_k=2, d_model=512, d_ff=1024, ep_size=4))
    plan.degrees.forward, plan.degrees.backward, plan.hierarchical, plan.forward_s
    model = CostModel(profile, Calibration.fit([(overlapped_s, serial_s, measured_s), ...]))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sparta.errors import ConfigError, InputError
from sparta.scheduling.chunks import MAX_TAPER, PipelineDegrees, chunk_weights
from sparta.scheduling.profiler import LinearFit, Profile
from sparta.scheduling.timeline import Timeline, timeline
from sparta.scheduling.tuner import Choice


@dataclass(frozen=True)
class LayerShape:
    """One rank's share of an MoE layer. tokens: rows entering the layer on this rank;
    top_k: experts per token; d_model, d_ff: expert MLP sizes; ep_size: ranks the experts
    are spread over; element_bytes: 4 for float32. Routing is taken as balanced: each rank
    receives about tokens * top_k rows."""

    tokens: int
    top_k: int
    d_model: int
    d_ff: int
    ep_size: int
    element_bytes: int = 4

    def __post_init__(self) -> None:
        for name in ("tokens", "top_k", "d_model", "d_ff", "ep_size", "element_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"LayerShape.{name} = {getattr(self, name)}; use >= 1")

    @property
    def rows(self) -> int:
        """Rows this rank sends into the exchange: tokens x top_k."""
        return self.tokens * self.top_k

    @property
    def exchange_bytes(self) -> int:
        """Bytes one all-to-all moves per rank (dispatch, or combine)."""
        return self.rows * self.d_model * self.element_bytes


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds of one configuration: forward and backward at degree r."""

    degree: int
    hierarchical: bool
    forward_s: float
    backward_s: float  # with backward at the same degree as forward (graphs reused)
    # the same transfers and compute one after another, nothing overlapped: what the
    # pipeline saves is serial - overlapped, the part a Calibration scales by its efficiency
    forward_serial_s: float = 0.0
    backward_serial_s: float = 0.0
    taper: int = 0  # PipelineDegrees.taper the chunks were cut with


@dataclass(frozen=True)
class Calibration:
    """The cost model corrected by real steps: measured ~ scale * (serial - efficiency * saved),
    saved = serial - overlapped. `scale` absorbs what the profile got wrong for every
    configuration alike (compute slowed by the ranks sharing cores, the links under a real
    step's traffic); `efficiency` (0..1) is the share of the overlap the model predicts that
    the pipeline really achieves (transfers and compute contend for the same cores, so
    overlap is never perfect). rel_error: RMS relative error over the fitted steps.

    Fitted from steps timed on every rank and agreed (slowest rank), so every rank holds the
    same Calibration and makes the same decisions."""

    scale: float = 1.0
    efficiency: float = 1.0
    rel_error: float = 0.0

    def __post_init__(self) -> None:
        if self.scale <= 0 or not 0.0 <= self.efficiency <= 1.0:
            raise ConfigError(
                f"Calibration scale = {self.scale}, efficiency = {self.efficiency}; use scale > 0, 0 <= efficiency <= 1"
            )

    def __call__(self, overlapped_s: float, serial_s: float) -> float:
        """Corrected seconds of a configuration the model predicts at `overlapped_s` with its
        pipeline and `serial_s` without overlap."""
        return self.scale * (serial_s - self.efficiency * (serial_s - overlapped_s))

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float, float]]) -> Calibration:
        """Least squares over (overlapped_s, serial_s, measured_s) of timed configurations.
        Needs a configuration that overlaps nothing (r=1: it pins `scale`) and one that
        overlaps (pins `efficiency`); with only one kind, efficiency stays at the bound
        nearest the fit (or 1, the model's own, when nothing overlaps)."""
        if not points or any(min(p) <= 0 or p[0] > p[1] * (1 + 1e-9) for p in points):
            raise InputError(
                f"Calibration.fit: points {list(points)}; give (overlapped_s, serial_s, measured_s), all > 0, "
                "overlapped <= serial"
            )
        # plain floats, not BLAS: vectorised kernels may round differently from one process
        # to the next (alignment), and every rank must derive the very same calibration
        cols = [(s, o - s, t) for o, s, t in points]  # measured = scale * s + scale * eff * (o - s)
        ss, sd, dd = sum(s * s for s, _, _ in cols), sum(s * d for s, d, _ in cols), sum(d * d for _, d, _ in cols)
        efficiency = 1.0
        det = ss * dd - sd * sd
        if len(points) > 1 and det > 1e-9 * ss * dd:
            sm, dm = sum(s * t for s, _, t in cols), sum(d * t for _, d, t in cols)
            scale, scaled_eff = (sm * dd - sd * dm) / det, (ss * dm - sd * sm) / det
            efficiency = min(1.0, max(0.0, scaled_eff / scale)) if scale > 0 else 1.0
        x = [s + efficiency * d for s, d, _ in cols]  # the model at this efficiency; scale by least squares
        scale = sum(xi * t for xi, (_, _, t) in zip(x, cols, strict=True)) / sum(xi * xi for xi in x)
        rel = math.sqrt(sum(((scale * xi - t) / t) ** 2 for xi, (_, _, t) in zip(x, cols, strict=True)) / len(x))
        return cls(scale, efficiency, rel)


@dataclass(frozen=True)
class SchedulePlan:
    """What the co-scheduler chose and why: the chosen degrees and all-to-all form, their
    predicted seconds (through the model's Calibration), and every configuration it weighed
    (uncalibrated; for logs and traces)."""

    degrees: PipelineDegrees
    hierarchical: bool
    forward_s: float
    backward_s: float
    candidates: tuple[Prediction, ...]
    calibration: Calibration = Calibration()
    # (forward, backward) seconds of the layer's router over this rank's tokens, when the
    # profile has it: outside the pipeline (routing precedes dispatch) but part of the layer
    router_s: tuple[float, float] = (0.0, 0.0)

    @property
    def choice(self) -> Choice:
        """The chosen degrees and all-to-all form as a `Choice`."""
        return Choice(self.degrees, self.hierarchical)

    def ranked(self, count: int) -> list[Choice]:
        """This plan's choice, then the best other equal-degree candidates by predicted
        forward + backward, each at least twice or at most half the degree of every one
        taken (neighbouring degrees differ by less than a real step's noise, so trying both
        tells nothing): what an OnlineTuner should try. At most `count` choices."""
        cal = self.calibration
        by_total = sorted(
            self.candidates, key=lambda c: cal(c.forward_s, c.forward_serial_s) + cal(c.backward_s, c.backward_serial_s)
        )
        taken = [self.choice]
        for c in by_total:
            apart = all(
                c.hierarchical != t.hierarchical
                or max(c.degree, t.degrees.forward) >= 2 * min(c.degree, t.degrees.forward)
                for t in taken
            )
            if apart and len(taken) < count:
                taken.append(Choice(PipelineDegrees(c.degree, c.degree, c.taper), c.hierarchical))
        return taken[:count]


class CostModel:
    """Predictions from a Profile holding "all_to_all/world" (flat), "all_to_all/hier" or
    "all_to_all/intra" and "all_to_all/inter" (hierarchical), "expert_fwd/DxF" and
    "expert_bwd/DxF"."""

    def __init__(self, profile: Profile, calibration: Calibration | None = None) -> None:
        self.profile = profile
        self.calibration = calibration or Calibration()

    def corrected(self, p: Prediction) -> tuple[float, float]:
        """(forward, backward) seconds of `p` through this model's Calibration."""
        return self.calibration(p.forward_s, p.forward_serial_s), self.calibration(p.backward_s, p.backward_serial_s)

    def _exchange(self, shape: LayerShape, fraction: float, hierarchical: bool) -> tuple[float, float, float]:
        """(network seconds, blocking seconds, latency seconds within the network's) of the
        all-to-all of a chunk holding `fraction` of the rows."""
        nbytes = shape.exchange_bytes * fraction
        fits = self.profile.fits
        if not hierarchical:
            flat = self.profile.fit("all_to_all", "world")
            return flat(nbytes), 0.0, flat.alpha
        if "all_to_all/hier" in fits:
            # measured whole (its block permutations and count exchanges included): more
            # faithful than the sum of its two steps; its intra-node step runs on the calling
            # thread before an async call returns, so that much of it blocks compute
            hier = self.profile.fit("all_to_all", "hier")
            whole = hier(nbytes)
            intra = min(whole, self.profile.fit("all_to_all", "intra")(nbytes) if "all_to_all/intra" in fits else 0.0)
            return whole - intra, intra, min(hier.alpha, whole - intra)
        inter = self.profile.fit("all_to_all", "inter")
        return inter(nbytes), self.profile.fit("all_to_all", "intra")(nbytes), inter.alpha

    def _compute(self, shape: LayerShape, kind: str) -> LinearFit:
        return self.profile.fit(f"expert_{kind}", f"{shape.d_model}x{shape.d_ff}")

    def _chunks(
        self, shape: LayerShape, degree: int, hierarchical: bool, taper: int, recompute: bool = False
    ) -> tuple[list[float], list[float], list[float], list[float], list[float]]:
        """Per chunk: transfer, blocking, latency, forward compute and backward compute
        seconds; `recompute` adds the forward's compute to the backward's."""
        if degree < 1:
            raise ConfigError(f"CostModel: degree = {degree}; use >= 1")
        weights = chunk_weights(degree, taper)
        parts = [w / sum(weights) for w in weights]
        exchange = [self._exchange(shape, f, hierarchical) for f in parts]
        comm, blocking, latency = ([e[k] for e in exchange] for k in range(3))
        fwd = [self._compute(shape, "fwd")(shape.rows * f) for f in parts]
        redo = fwd if recompute else [0.0] * degree
        bwd = [self._compute(shape, "bwd")(shape.rows * f) + c for f, c in zip(parts, redo, strict=True)]
        return comm, blocking, latency, fwd, bwd

    def predict(
        self, shape: LayerShape, degree: int, hierarchical: bool, recompute: bool = False, taper: int = 0
    ) -> Prediction:
        """Forward and backward seconds at `degree` with chunks tapered by `taper`
        (PipelineDegrees); `recompute` adds the forward's compute to the backward's (what the
        pipeline does when the two degrees differ)."""
        comm, blocking, latency, fwd, bwd = self._chunks(shape, degree, hierarchical, taper, recompute)
        transfers = 2 * (sum(comm) + sum(blocking))
        return Prediction(
            degree,
            hierarchical,
            timeline(comm, fwd, blocking, latency).end_s,
            timeline(comm, bwd, blocking, latency).end_s,
            transfers + sum(fwd),
            transfers + sum(bwd),
            taper,
        )

    def predict_degrees(self, shape: LayerShape, degrees: PipelineDegrees, hierarchical: bool) -> Prediction:
        """Forward at degrees.forward, backward at degrees.backward (recomputing the forward's
        compute when they differ, as the pipeline does); `degree` is the forward's."""
        fwd = self.predict(shape, degrees.forward, hierarchical, taper=degrees.taper)
        if degrees.backward == degrees.forward:
            return fwd
        bwd = self.predict(shape, degrees.backward, hierarchical, recompute=True, taper=degrees.taper)
        return Prediction(
            degrees.forward,
            hierarchical,
            fwd.forward_s,
            bwd.backward_s,
            fwd.forward_serial_s,
            bwd.backward_serial_s,
            degrees.taper,
        )

    def predict_microbatched(
        self, shape: LayerShape, microbatches: int, hierarchical: bool, before: str, after: str
    ) -> Prediction:
        """A block run by microbatch.overlapped_block: `microbatches` equal cuts of the
        tokens, each exchanged whole, with the dense layers before the exchange and after it
        on the pipeline's ends (from the "dense_fwd|dense_bwd/{before}" and ".../{after}"
        fits over tokens, `Profiler.forward_backward(..., op="dense")`). Unlike `predict`,
        forward_s and backward_s (and the serial figures) include those dense layers, and
        the forward each micro-batch's counts exchange (its fit's fixed cost, on this thread)."""
        if microbatches < 1:
            raise ConfigError(f"CostModel: microbatches = {microbatches}; use >= 1")
        comm, blocking, latency, fwd, bwd = self._chunks(shape, microbatches, hierarchical, 0)
        tokens = shape.tokens / microbatches

        def dense(kind: str, name: str) -> float:
            return self.profile.fit(f"dense_{kind}", name)(tokens)

        counts_s = sum(self._exchange(shape, 0.0, hierarchical)[:2])
        pre_f, post_f, pre_b, post_b = (
            dense("fwd", before),
            dense("fwd", after),
            dense("bwd", before),
            dense("bwd", after),
        )
        transfers = 2 * (sum(comm) + sum(blocking))
        return Prediction(
            microbatches,
            hierarchical,
            timeline(comm, fwd, blocking, latency, pre_f + counts_s, post_f).end_s,
            timeline(comm, bwd, blocking, latency, post_b, pre_b).end_s,
            transfers + sum(fwd) + microbatches * (pre_f + post_f + counts_s),
            transfers + sum(bwd) + microbatches * (pre_b + post_b),
        )

    def backward_timeline(self, shape: LayerShape, degrees: PipelineDegrees, hierarchical: bool) -> Timeline:
        """The simulated backward of one layer under `degrees` (its network gaps feed the
        gradient partitioner)."""
        recompute = degrees.backward != degrees.forward
        comm, blocking, latency, _, bwd = self._chunks(shape, degrees.backward, hierarchical, degrees.taper, recompute)
        return timeline(comm, bwd, blocking, latency)

    def router(self, shape: LayerShape, name: str) -> tuple[float, float]:
        """(forward, backward) seconds of router `name` over shape.tokens tokens, from the
        "router_fwd/{name}" and "router_bwd/{name}" fits (Profiler.router)."""
        return self.profile.fit("router_fwd", name)(shape.tokens), self.profile.fit("router_bwd", name)(shape.tokens)

    def plan(
        self, shape: LayerShape, max_degree: int = 8, hierarchical: bool | None = None, router: str | None = None
    ) -> SchedulePlan:
        """The degrees (forward and backward chosen apart) and all-to-all form that minimise
        the predicted forward + backward time. `hierarchical=None` weighs both forms when
        the profile has the intra/inter fits; True or False forces one. `router` names a
        profiled router whose time the plan reports (it is the same under every plan)."""
        if max_degree < 1:
            raise ConfigError(f"CostModel.plan: max_degree = {max_degree}; use >= 1")
        fits = self.profile.fits
        has_hier = "all_to_all/hier" in fits or ("all_to_all/inter" in fits and "all_to_all/intra" in fits)
        forms = [hierarchical] if hierarchical is not None else ([False, True] if has_hier else [False])
        # tapers that change the cut (a degree-2 cut is the same at every taper)
        shapes = [
            (h, r, t)
            for h in forms
            for r in range(1, max_degree + 1)
            for t in range(MAX_TAPER + 1)
            if t == 0 or chunk_weights(r, t) != chunk_weights(r, t - 1)
        ]
        candidates = tuple(self.predict(shape, r, h, taper=t) for h, r, t in shapes)
        cal = self.calibration
        router_s = self.router(shape, router) if router is not None else (0.0, 0.0)
        best: tuple[float, SchedulePlan] | None = None
        for h, t in ((h, t) for h in forms for t in range(MAX_TAPER + 1)):
            # a taper applies to both passes; a degree it leaves uniform fits under any taper
            mine = [
                c
                for c in candidates
                if c.hierarchical == h and chunk_weights(c.degree, c.taper) == chunk_weights(c.degree, t)
            ]
            fwd = min(mine, key=lambda c: cal(c.forward_s, c.forward_serial_s))
            bwd = min(mine, key=lambda c: cal(c.backward_s, c.backward_serial_s))
            if bwd.degree != fwd.degree:
                # unequal degrees make the backward recompute the forward: price that in
                both = self.predict_degrees(shape, PipelineDegrees(fwd.degree, bwd.degree, t), h)
                if cal(both.backward_s, both.backward_serial_s) > cal(fwd.backward_s, fwd.backward_serial_s):
                    bwd = fwd
            # candidates carry the least taper giving their cut: equal plans then compare equal
            degrees = PipelineDegrees(fwd.degree, bwd.degree, max(fwd.taper, bwd.taper))
            chosen = self.predict_degrees(shape, degrees, h)
            fwd_s, bwd_s = self.corrected(chosen)
            # strictly faster only: a tie keeps the flat form and the smaller taper, tried first
            if best is None or fwd_s + bwd_s < best[0] - 1e-12:
                plan = SchedulePlan(degrees, h, fwd_s, bwd_s, candidates, cal, router_s)
                best = (fwd_s + bwd_s, plan)
        assert best is not None
        return best[1]
