"""``MoESpec(pipeline_degree="auto")``: the co-scheduler tuned on the trainer's own inputs.

A fixed degree is a guess: the best one depends on the link, the experts' GEMMs and the
tokens each layer sees, which only the running job knows. With "auto" the MoE layers start
flat (one chunk, nothing overlapped); `ParallelModel.step`'s first step records each
layer's input (its last micro-batch's), and after that step `sparta.moe.tune_schedule` profiles the exchange
and the experts, asks the cost model for its best plans and times them (and flat) on the
recorded rows, and the winner is applied to the layer and to every other layer of this
rank with the same shape and exchange (all of a decoder's, usually: one tuning a rank).
Where every expert-parallel group spans several nodes with as many of its ranks on each
(`experts.two_level_pays`), or with ``MoESpec.hierarchical``, the tuner also weighs the
two-level all-to-all against the flat one. The degrees never change a result, only when rows travel, so the first step's
numbers and every later one's equal the flat layers' (the trainer's parity checks).

Then, where the layout lets blocks overlap micro-batches (`parallel_config.overlap_refusal`:
ep > 1, and no expert tensor parallelism, zero-bubble schedule or recomputation), the
strategy is not FSDP2 (whose gathers would run in the timings) and a layer's block is the
Decoder's `Block`, the tuner times that whole block, forward and
backward on its recorded input, cut into 1, 2 and 4 micro-batches (`Block.set_overlap`:
one micro-batch's attention computes while another's rows travel), each also with its
tokens deduplicated per node where the two-level exchange is weighed, and keeps the fastest
(the block as it was unless another is 3 % faster), for every block of the same shape.
This too changes no result (`sparta.moe.overlapped_moe_block`).

Every rank of an expert-parallel group tunes the same layers in the same order: the groups
lie inside one pipeline stage, whose ranks hold the same layers. Each group tunes on its
own, so groups may settle on different plans; that is safe because nothing but the group's
own exchange depends on the chunking: under expert tensor parallelism the tp peers (each in
another ep group) sum their partial outputs once per layer, after the exchange back, and
once per backward (`MoELayer.split_experts`), whatever chunks either used.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from sparta.comm import HierarchicalAllToAll
from sparta.errors import InputError
from sparta.moe import MoELayer, tune_schedule
from sparta.parallel.decoder import Block
from sparta.scheduling.cost_model import SchedulePlan
from sparta.scheduling.tuner import OnlineTuner

# the micro-batches a block is timed in (at most its sequences), each also deduplicated where
# the two-level exchange exists; the planner's simulator weighs the same counts
BLOCK_MICROBATCHES = (1, 2, 4)


class AutoSchedule:
    """The "auto" MoE layers of this rank, untuned until `tune` runs once.

    layers: this rank's MoE layers (ep > 1) by their paths in the model; exchange: their
    two-level all-to-all, when the spec asked for one (the tuner weighs it against flat),
    else None; trials: timed runs of each candidate plan (`tune_schedule`)."""

    def __init__(
        self,
        layers: dict[str, MoELayer],
        exchange: HierarchicalAllToAll | None,
        trials: int = 4,
        blocks: dict[str, Block] | None = None,
    ) -> None:
        self.layers, self.exchange, self.trials = layers, exchange, trials
        # block path -> a Block whose MLP is one of `layers`, where micro-batch overlap may run
        self.blocks = blocks or {}
        self.plans: dict[str, SchedulePlan] = {}  # layer path -> the plan it took
        self.overlaps: dict[str, tuple[int, bool]] = {}  # block path -> (micro-batches, deduplicated) it took
        # block path -> each candidate's agreed (slowest-rank) median seconds, forward and backward
        self.overlap_seconds: dict[str, dict[tuple[int, bool], float]] = {}
        self.samples: dict[str, Tensor] = {}  # layer or block path -> its input recorded for `tune`

    @property
    def pending(self) -> bool:
        """True until `tune` has run (it runs once)."""
        return not self.plans and bool(self.layers)

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Keep each layer's input [..., d_model] (detached) while the block runs: the last
        one it sees, since a pipeline stage's first run is torch's shape-learning pass, on
        uninitialised inputs after stage 0."""
        watched: dict[str, nn.Module] = {**self.layers, **self.blocks}
        handles = [module.register_forward_pre_hook(self._keep(path)) for path, module in watched.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _keep(self, path: str) -> Callable[[nn.Module, tuple[Tensor, ...]], None]:
        def hook(module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
            self.samples[path] = inputs[0].detach()

        return hook

    def tune(self) -> dict[str, SchedulePlan]:
        """Tune the first layer of each shape on its recorded input and apply the plan to
        that shape's layers. Collective over the layers' expert-parallel group."""
        by_shape: dict[tuple[object, ...], SchedulePlan] = {}
        missing = [path for path in (*self.layers, *self.blocks) if path not in self.samples]
        if missing:
            raise InputError(f"pipeline_degree='auto': MoE layers {missing} did not run in the step that tunes them")
        for path, layer in self.layers.items():
            sample = self.samples[path]
            key = (_shape(layer), tuple(sample.shape))
            if key not in by_shape:
                by_shape[key] = tune_schedule(layer, sample, hierarchical=self.exchange, trials=self.trials)
            layer.apply_schedule(by_shape[key], hierarchical=self.exchange)
            self.plans[path] = by_shape[key]
        by_block: dict[tuple[object, ...], tuple[tuple[int, bool], dict[tuple[int, bool], float]]] = {}
        for path, block in self.blocks.items():
            sample = self.samples[path]
            key = (_shape(block.mlp), tuple(sample.shape))  # type: ignore[arg-type]
            if key not in by_block:
                by_block[key] = _tune_overlap(block, sample, self.trials, self.exchange)
            (microbatches, dedup), self.overlap_seconds[path] = by_block[key]
            block.set_overlap(microbatches, self.exchange if dedup else None)
            self.overlaps[path] = (microbatches, dedup)
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
        by_count: dict[tuple[int, bool], int] = {}
        for taken in self.overlaps.values():
            by_count[taken] = by_count.get(taken, 0) + 1
        blocks = "; ".join(
            ("whole" if m == 1 else f"{m} micro-batches") + (", deduplicated" if dedup else "") + f" ({n} blocks)"
            for (m, dedup), n in sorted(by_count.items())
        )
        return f"co-scheduler tuned: {chosen or 'not yet'}" + (f"; blocks: {blocks}" if blocks else "")


def _tune_overlap(
    block: Block, sample: Tensor, trials: int, dedup: HierarchicalAllToAll | None
) -> tuple[tuple[int, bool], dict[tuple[int, bool], float]]:
    """The micro-batches (1, 2 or 4, at most the fewest sequences a rank's sample holds), and whether its
    tokens go through ``dedup`` (where given), that run ``block``'s forward and backward on
    ``sample`` fastest, timed round robin after one warm-up each, agreed over its MoE
    layer's group (slowest rank); (1, False), the block as it was, unless another is 3 %
    faster. Returns it and every candidate's seconds. Leaves the parameters' gradients, the
    router's state and the RNG as they were. Collective over the layer's ``comm``."""
    layer = block.mlp
    assert isinstance(layer, MoELayer) and layer.comm is not None
    # the fewest sequences any rank of the group recorded: ranks may hold batches of other
    # shapes (documents), and every rank must try the same candidates in the same order
    rows = min(int(t) for t in layer.comm.all_gather(torch.tensor([sample.shape[0]]), sizes=[1] * layer.comm.size))
    counts = [m for m in BLOCK_MICROBATCHES if m <= rows]
    candidates = [(m, False) for m in counts] + [(m, True) for m in counts if dedup is not None]
    tuner = OnlineTuner(layer.comm, candidates, trials=trials, baseline=(1, False), margin=0.03, warmup=1)
    params = [p for p in block.parameters() if p.requires_grad]
    router_state = copy.deepcopy(layer.router.state_dict())
    device = sample.device
    with torch.random.fork_rng(devices=[]):  # the host's generator, as tune_schedule forks it
        while tuner.chosen is None:
            microbatches, deduplicated = tuner.current
            block.set_overlap(microbatches, dedup if deduplicated else None)
            x = sample.detach().requires_grad_()
            begin = time.perf_counter()
            y = block(x)
            torch.autograd.grad(y, [x, *params], torch.ones_like(y))  # into no .grad
            torch.get_device_module(device).synchronize(device)
            tuner.observe(time.perf_counter() - begin)
    layer.router.load_state_dict(router_state)
    assert tuner.chosen is not None
    return tuner.chosen, tuner.measured


def _shape(layer: MoELayer) -> tuple[object, ...]:
    """What a plan depends on besides the tokens: the layer's widths, experts and routing."""
    cfg = layer.config
    return (cfg.d_model, layer.experts.ff_range, cfg.num_experts, cfg.top_k, cfg.router, cfg.capacity_factor)
