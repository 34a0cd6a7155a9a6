"""``MoESpec(pipeline_degree="auto")``: the co-scheduler tuned on the trainer's own inputs.

A fixed degree is a guess: the best one depends on the link, the experts' GEMMs and the
tokens each layer sees, which only the running job knows. With "auto" the MoE layers start
flat (one chunk, nothing overlapped); `ParallelModel.step`'s first step records each
layer's first input, and after that step `sparta.moe.tune_schedule` profiles the exchange
and the experts, asks the cost model for its best plans and times them (and flat) on the
recorded rows, and the winner is applied to the layer and to every other layer of this
rank with the same shape and exchange (all of a decoder's, usually: one tuning a rank).
Where every expert-parallel group spans several nodes with as many of its ranks on each
(`experts.two_level_pays`), or with ``MoESpec.hierarchical``, the tuner also weighs the
two-level all-to-all against the flat one. The degrees never change a result, only when rows travel, so the first step's
numbers and every later one's equal the flat layers' (the trainer's parity checks).

Every rank of an expert-parallel group tunes the same layers in the same order: the groups
lie inside one pipeline stage, whose ranks hold the same layers. Each group tunes on its
own, so groups may settle on different plans; that is safe because nothing but the group's
own exchange depends on the chunking: under expert tensor parallelism the tp peers (each in
another ep group) sum their partial outputs once per layer, after the exchange back, and
once per backward (`MoELayer.split_experts`), whatever chunks either used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from sparta.comm import HierarchicalAllToAll
from sparta.errors import InputError
from sparta.moe import MoELayer, tune_schedule
from sparta.scheduling.cost_model import SchedulePlan


class AutoSchedule:
    """The "auto" MoE layers of this rank, untuned until `tune` runs once.

    layers: this rank's MoE layers (ep > 1) by their paths in the model; exchange: their
    two-level all-to-all, when the spec asked for one (the tuner weighs it against flat),
    else None; trials: timed runs of each candidate plan (`tune_schedule`)."""

    def __init__(self, layers: dict[str, MoELayer], exchange: HierarchicalAllToAll | None, trials: int = 4) -> None:
        self.layers, self.exchange, self.trials = layers, exchange, trials
        self.plans: dict[str, SchedulePlan] = {}  # layer path -> the plan it took
        self.samples: dict[str, Tensor] = {}  # layer path -> its input recorded for `tune`

    @property
    def pending(self) -> bool:
        """True until `tune` has run (it runs once)."""
        return not self.plans and bool(self.layers)

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Keep each layer's first input [..., d_model] (detached) while the block runs."""
        handles = [layer.register_forward_pre_hook(self._keep(path)) for path, layer in self.layers.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _keep(self, path: str) -> Callable[[nn.Module, tuple[Tensor, ...]], None]:
        def hook(module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
            self.samples.setdefault(path, inputs[0].detach())

        return hook

    def tune(self) -> dict[str, SchedulePlan]:
        """Tune the first layer of each shape on its recorded input and apply the plan to
        that shape's layers. Collective over the layers' expert-parallel group."""
        by_shape: dict[tuple[object, ...], SchedulePlan] = {}
        missing = [path for path in self.layers if path not in self.samples]
        if missing:
            raise InputError(f"pipeline_degree='auto': MoE layers {missing} did not run in the step that tunes them")
        for path, layer in self.layers.items():
            sample = self.samples[path]
            key = (_shape(layer), tuple(sample.shape))
            if key not in by_shape:
                by_shape[key] = tune_schedule(layer, sample, hierarchical=self.exchange, trials=self.trials)
            layer.apply_schedule(by_shape[key], hierarchical=self.exchange)
            self.plans[path] = by_shape[key]
        self.samples.clear()
        return self.plans

    def describe(self) -> str:
        """One line: what `tune` chose on this rank, equal plans merged."""
        by_choice: dict[str, int] = {}
        for plan in self.plans.values():
            form = "two-level" if plan.hierarchical else "flat"
            choice = f"{plan.degrees.forward} forward / {plan.degrees.backward} backward chunks, {form} all-to-all"
            by_choice[choice] = by_choice.get(choice, 0) + 1
        chosen = "; ".join(f"{choice} ({n} MoE layers)" for choice, n in by_choice.items())
        return f"co-scheduler tuned: {chosen or 'not yet'}"


def _shape(layer: MoELayer) -> tuple[object, ...]:
    """What a plan depends on besides the tokens: the layer's widths, experts and routing."""
    cfg = layer.config
    return (cfg.d_model, layer.experts.ff_range, cfg.num_experts, cfg.top_k, cfg.router, cfg.capacity_factor)
