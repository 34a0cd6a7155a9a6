"""The search: every plan the trainer can run for a model on N ranks, predicted on measured
costs, the ones that fit the memory budget ranked by step time (the plan file that `sparta
train --plan` takes is `plan_file`'s).

The space (Galvatron's, cut to what `sparta.parallel` runs): every pp x dp x tp x ep whose
product is the world (pp up to the layers, tp dividing the heads and the MLP width, ep
dividing dp and the experts), every schedule with one stage per rank and with two (looped
or V), every micro-batch count dividing a dp rank's batch, and data parallelism by the
"sparta" strategy (replicated, bucketed) or "fsdp" (sharded, for memory; only over dp > 1:
see FSDP_ALONE), the embedding tables replicated or row-sharded over dp (``embedding``
"dense" or "sparse"; sparse only over dp > 1, and with embedding stages only where a table
stays beside the layers: see SPARSE_ALONE, SPARSE_STAGES), and for an MoE model its blocks
whole or over 2 or 4 micro-batches (``MoESpec.overlap``) where the layout lets them overlap
and the exchange can hide (`exchange_hides`: not where ranks share a host's cores), each
also with its tokens deduplicated per node (``MoESpec.dedup``) where the ep groups span
nodes. Each candidate's stages are balanced on the predicted per-layer cost (the exact
split of `pipeline.split_by_cost`, counting embedding and head), then checked by the
trainer's own `ParallelConfig.check`; what it refuses is rejected with its message. A plan
over the memory budget is tried again with stage-aware recomputation (`_fitted`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from sparta.errors import ConfigError
from sparta.parallel.auto_schedule import BLOCK_MICROBATCHES
from sparta.parallel.dims import ParallelDims
from sparta.parallel.parallel_config import EMBEDDINGS, ParallelConfig, overlap_refusal
from sparta.parallel.pipeline import SCHEDULES, ZERO_BUBBLE, ModelParts, split_by_cost, stage_ids

from .costs import ModelCosts
from .parts import experts_split
from .simulate import Plan, Prediction, Workload, simulate
from .stage_cost import embedding_tables, exchange_hides, spans_nodes

STRATEGIES = ("sparta", "fsdp")
# Over one dp rank FSDP shards nothing (the memory of "sparta") and still unshards and
# reshards every layer per micro-batch, which the costs do not hold: at world 1, 16 micro-
# batches, such plans ran 1.68 s (MoE) and 0.89 s (dense) against 0.89 s and 0.46 s predicted.
FSDP_ALONE = "fsdp over one data-parallel rank: it shards nothing, and its per-layer unshard is not in the costs"
SPARSE_ALONE = "a sparse embedding over one data-parallel rank: it shards nothing"
# under embedding_stages the token table's rows lie on the embedding stages, dense; only the
# tables left beside the layers (the decoder's positions) are row-sharded
SPARSE_STAGES = "a sparse embedding with embedding_stages and no table beside the layers: it shards nothing"
GIB = 2**30


@dataclass(frozen=True)
class Space:
    """Where the search looks. schedules: names (None: every schedule); max_microbatches:
    the largest count tried (None: every divisor of a dp rank's batch); max_tp: the largest
    tp (e.g. the devices of one node: tp across nodes never pays); strategies: the
    data-parallel strategies tried; vocab_stages: also the head as pipeline stages of its own
    (and, on looped schedules, the token embedding too, at 3 stages per rank); overlaps: the
    micro-batch counts an MoE model's blocks are tried in (``MoESpec.overlap``), where the
    layout lets them overlap, the exchange can hide and the run leaves them to the search;
    dedup: also those blocks (and whole ones) with their tokens deduplicated per node
    (``MoESpec.dedup``), where the ep groups span nodes evenly; embeddings: the
    ``ParallelConfig.embedding`` values tried (replicated tables, or row-sharded over dp).
    A narrower
    space is what makes 1,024-device searches quick: torch builds an interleaved table of 64
    ranks x 512 micro-batches in ~15 s."""

    schedules: tuple[str, ...] | None = None
    max_microbatches: int | None = None
    max_tp: int | None = None
    strategies: tuple[str, ...] = STRATEGIES
    vocab_stages: bool = True
    overlaps: tuple[int, ...] = BLOCK_MICROBATCHES
    dedup: bool = True
    embeddings: tuple[str, ...] = EMBEDDINGS

    def __post_init__(self) -> None:
        unknown = [s for s in self.schedules or () if s not in SCHEDULES]
        if unknown:
            raise ConfigError(f"Space.schedules: {unknown} unknown; choose from {', '.join(SCHEDULES)}")
        for name in ("max_microbatches", "max_tp"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"Space.{name}={value!r} must be a positive integer or None")
        if not self.strategies or any(s not in STRATEGIES for s in self.strategies):
            raise ConfigError(f"Space.strategies={self.strategies!r}: choose from {STRATEGIES}")
        if any(not isinstance(m, int) or isinstance(m, bool) or m < 1 for m in self.overlaps):
            raise ConfigError(f"Space.overlaps={self.overlaps!r} must be positive integers (MoESpec.overlap)")
        if not isinstance(self.dedup, bool):
            raise ConfigError(f"Space.dedup={self.dedup!r} must be True or False")
        if not self.embeddings or any(e not in EMBEDDINGS for e in self.embeddings):
            raise ConfigError(f"Space.embeddings={self.embeddings!r}: choose from {EMBEDDINGS}")


@dataclass(frozen=True)
class Ranked:
    """A plan and its prediction."""

    plan: Plan
    prediction: Prediction


@dataclass
class SearchResult:
    """fits: plans within the budget, fastest first; over_budget: those that run but do not
    fit, smallest peak first; rejected: why the others cannot run, {reason: count}."""

    fits: list[Ranked]
    over_budget: list[Ranked]
    rejected: dict[str, int]

    @property
    def best(self) -> Ranked:
        """The fastest plan within the budget; ConfigError saying what would fit when none does."""
        if not self.fits:
            raise ConfigError(self.no_fit_message())
        return self.fits[0]

    def no_fit_message(self) -> str:
        """Why no plan fits: the smallest over-budget plan and what it needs, or every layout's refusal."""
        if not self.over_budget:
            reasons = "; ".join(f"{n} x {why}" for why, n in self.rejected.items())
            return (
                f"no plan of this model runs on these ranks ({reasons}): change the world size, or widen the "
                "space (--schedules, --max-microbatches)"
            )
        small = self.over_budget[0]
        return (
            f"no plan fits the memory budget: the smallest found, {small.plan.describe()}, needs "
            f"{small.prediction.max_peak_bytes / GIB:.3f} GiB per rank; raise --memory to that, or add ranks"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(world: int, work: Workload, max_tp: int | None = None) -> Iterator[ParallelDims]:
    """Every pp x dp x tp (x ep) of ``world`` ranks that the model's shape admits."""
    m = work.model
    for pp in _divisors(world):
        if pp > m.n_layers:
            continue
        for tp in _divisors(world // pp):
            if m.n_heads % tp or m.d_ff % tp or m.d_model % tp or (max_tp is not None and tp > max_tp):
                continue
            if tp > 1 and work.moe is not None and work.moe.expert_tp and not experts_split(m, tp):
                continue
            dp = world // (pp * tp)
            for ep in _divisors(dp):
                if (work.moe is None and ep > 1) or (work.moe is not None and work.moe.num_experts % ep):
                    continue
                yield ParallelDims(pp=pp, dp=dp, tp=tp, ep=ep)


def _schedules(pp: int, names: tuple[str, ...] | None, vocab: bool) -> Iterator[tuple[str, int, bool, bool]]:
    """(schedule, stages per rank, vocab_stages, embedding_stages) to try: the vocabulary
    stages where ``vocab`` and the schedule holds them (head stages beside one layers' stage
    per rank; looped schedules also the embedding's, at 3 stages per rank)."""
    if pp == 1:
        yield "1F1B", 1, False, False  # one stage: every schedule runs the same forward then backward
        return
    for name, style in SCHEDULES.items():
        if names is not None and name not in names:
            continue
        if style == "single":
            yield name, 1, False, False
            continue
        yield name, 2, False, False
        if vocab:
            yield name, 2, True, False
            if style == "loop":
                yield name, 3, True, True


def layer_costs(costs: ModelCosts, work: Workload, tokens: float) -> dict[str, float]:
    """Forward + backward seconds per layer and for the first/last stage's extras, at
    ``tokens`` per micro-batch: what `split_by_cost` balances."""
    parts = costs.parts
    out = {"embed": parts["embed"].fwd(tokens) + parts["embed"].bwd(tokens)}
    for i in range(work.model.n_layers):
        mlp = "moe" if work.moe is not None and work.moe.is_moe(i) else "mlp"
        out[f"layers.{i}"] = sum(parts[p].fwd(tokens) + parts[p].bwd(tokens) for p in ("attention", mlp))
    out["head"] = parts["head"].fwd(tokens) + parts["head"].bwd(tokens)
    return out


def search(
    costs: ModelCosts,
    work: Workload,
    world: int,
    memory_bytes: float,
    base: ParallelConfig,
    space: Space | None = None,
) -> SearchResult:
    """Predict every plan of ``space`` (see the module doc); ``base`` gives the fields not
    searched (moe, bucket size...)."""
    space = space or Space()
    costs.check(work.model, work.moe)
    costs.check_world(world)
    parts = ModelParts(("embed",), tuple(f"layers.{i}" for i in range(work.model.n_layers)), ("head",), ())
    fits: list[Ranked] = []
    over: list[Ranked] = []
    rejected: Counter[str] = Counter()
    blocks = _searched_blocks(base, space, exchange_hides(costs))
    beside = embedding_tables(costs, work.model)[1] > 0  # a table the embedding stages leave (positions)
    # without tensor_parallel a tp group would replicate the blocks, which the simulator prices
    # split: such layouts are left out
    for dims in layouts(world, work, space.max_tp if base.tensor_parallel else 1):
        per_dp = work.global_batch // dims.dp if work.global_batch % dims.dp == 0 else 0
        if not per_dp:
            rejected[f"global_batch={work.global_batch} does not divide over dp"] += 1
            continue
        for schedule, spr, heads, tables in _schedules(dims.pp, space.schedules, space.vocab_stages):
            for mb in (m for m in _divisors(per_dp) if space.max_microbatches is None or m <= space.max_microbatches):
                tokens = per_dp // mb * work.model.seq_len
                for strategy, embedding in ((s, e) for s in space.strategies for e in space.embeddings):
                    if strategy == "fsdp" and dims.dp == 1:
                        rejected[FSDP_ALONE] += 1
                        continue
                    if embedding == "sparse" and (dims.dp == 1 or (tables and not beside)):
                        rejected[SPARSE_ALONE if dims.dp == 1 else SPARSE_STAGES] += 1
                        continue
                    body = dims.pp * (spr - heads - tables)  # the vocabulary stages' pp each apart
                    apart = (parts.first if tables else ()) + (parts.last if heads else ())
                    try:
                        if body > work.model.n_layers:
                            raise ConfigError(f"{body} stages but {work.model.n_layers} layers")
                        stages = _split(parts, body, layer_costs(costs, work, tokens), apart)
                        config = dataclasses.replace(
                            base,
                            schedule=schedule,
                            microbatches=mb,
                            stages_per_rank=spr,
                            split_points=tuple(s[0] for s in stages[1:]),
                            recompute=(),  # the run file's own is no plan's: _fitted chooses
                            data_parallel=strategy,
                            embedding=embedding,
                            vocab_stages=heads,
                            embedding_stages=tables,
                        )
                    except ConfigError as exc:
                        rejected[_reason(str(exc))] += 1
                        continue
                    for tried in _block_variants(config, dims, per_dp // mb, blocks, spans_nodes(dims, costs)):
                        try:
                            ranked = _fitted(costs, work, Plan(dims, tried), memory_bytes)
                        except ConfigError as exc:
                            rejected[_reason(str(exc))] += 1
                            continue
                        (fits if ranked.prediction.max_peak_bytes <= memory_bytes else over).append(ranked)
    fits.sort(key=lambda r: r.prediction.step_s)
    over.sort(key=lambda r: r.prediction.max_peak_bytes)
    return SearchResult(fits, over, dict(rejected.most_common()))


def _searched_blocks(base: ParallelConfig, space: Space, hides: bool) -> tuple[tuple[int, bool], ...]:
    """The ways (micro-batches, deduplicated) to run the MoE blocks that the search tries
    beyond the run's own, where the run leaves them to it (an MoE run whose spec can
    overlap, with neither ``overlap`` nor ``dedup`` set nor ``pipeline_degree="auto"``, whose
    tuner picks them): ``space.overlaps`` where the exchange can hide (``hides``), and under
    ``space.dedup`` each count deduplicated (`_block_variants` keeps those to layouts whose
    groups span nodes)."""
    moe = base.moe
    if moe is None or moe.auto or moe.overlap_asked:
        return ()
    try:
        dataclasses.replace(moe, overlap=2)
    except ConfigError:  # a router or capacity whose routing spans the batch
        return ()
    counts = tuple(m for m in space.overlaps if m > 1) if hides else ()
    deduplicated = tuple((m, True) for m in (1, *counts)) if space.dedup else ()
    return tuple((m, False) for m in counts) + deduplicated


def _block_variants(
    config: ParallelConfig, dims: ParallelDims, sequences: int, blocks: tuple[tuple[int, bool], ...], spans: bool
) -> Iterator[ParallelConfig]:
    """``config`` as it is, then with its MoE blocks each way of ``blocks`` where the layout
    lets them overlap, a pipeline micro-batch has that many sequences and, for a
    deduplicated one, the ep groups span nodes evenly (``spans``)."""
    yield config
    if config.moe is None or overlap_refusal(config, dims) is not None:
        return
    for m, dedup in blocks:
        if m <= sequences and (spans or not dedup):
            yield dataclasses.replace(config, moe=dataclasses.replace(config.moe, overlap=m, dedup=dedup))


@functools.lru_cache(maxsize=256)
def _split_cached(parts: ModelParts, stages: int, costs: tuple[tuple[str, float], ...]) -> list[list[str]]:
    return split_by_cost(parts, stages, dict(costs))


def _split(parts: ModelParts, stages: int, costs: dict[str, float], apart: tuple[str, ...]) -> list[list[str]]:
    """The layers of ``stages`` stages balanced on ``costs``; ``apart``: the extras that run on
    stages of their own (the head under vocab_stages, the embedding under embedding_stages),
    charged to no layers' stage."""
    costs = {**costs, **dict.fromkeys(apart, 0.0)}
    return _split_cached(parts, stages, tuple(sorted(costs.items())))


def _fitted(costs: ModelCosts, work: Workload, plan: Plan, memory_bytes: float) -> Ranked:
    """The plan as it is, or, when it exceeds the budget, with stage-aware recomputation
    (Merak): first only the stages of the pipeline ranks over budget, then every stage.
    Not under zero-bubble schedules: torch 2.13's weight pass recomputes a block once per
    parameter group (1 + 8 forwards for a Decoder block), which no plan gains from; nor with
    its MoE blocks over micro-batches, which would run their exchanges again."""
    prediction = simulate(costs, work, plan)
    overlapped = plan.config.moe is not None and bool(plan.config.moe.overlap_asked)  # the trainer refuses both
    if prediction.max_peak_bytes <= memory_bytes or plan.config.schedule in ZERO_BUBBLE or overlapped:
        return Ranked(plan, prediction)
    dims, spr = plan.dims, plan.config.stages_per_rank
    # the vocabulary stages have no layers to recompute
    first, body = plan.config.first_body(dims.pp), plan.config.body_stages(dims.pp)
    over = [r for r, b in prediction.peak_bytes.items() if b > memory_bytes]
    fitted = Ranked(plan, prediction)
    for stages in ({s for r in over for s in stage_ids(plan.config.schedule, dims.pp, r, spr)}, range(first + body)):
        stages = [s for s in stages if first <= s < first + body]
        try:
            recomputed = Plan(dims, dataclasses.replace(plan.config, recompute=tuple(sorted(stages))))
            fitted = Ranked(recomputed, simulate(costs, work, recomputed))
        except ConfigError:  # the trainer refuses recomputation here (the sigmoid router): over budget as is
            return Ranked(plan, prediction)
        if fitted.prediction.max_peak_bytes <= memory_bytes:
            break
    return fitted


def _reason(message: str) -> str:
    """A refusal without its numbers' particulars, so equal reasons count together."""
    return message.split(":")[0][:160]
