"""Replay a plan on measured costs: the step time and each pipeline rank's peak memory, and
the predicted timeline as a Chrome trace beside a measured one (dPRO's idea, for our trainer).

A `Plan` is exactly what the trainer runs: `ParallelDims` and `ParallelConfig` (its
``split_points`` set). A `Workload` is the model and the batch. `simulate` replays the
schedule's own action list (`sparta.parallel.schedule_actions`, torch's schedules) rank by
rank, each rank running its actions strictly in order as torch does, an action starting when
its rank is free and its inputs have arrived:

    F(s, m)       after F(s-1, m) (plus the point-to-point hop when s-1 is on another rank)
    B/I(s, m)     after F(s, m), and B/I(s+1, m) plus the hop (the last stage: after its F)
    W(s, m)       after I(s, m)

A hop across a node's link (`ModelCosts.hop`, `ModelCosts.link`) waits for the sends queued
on that link before it, one direction of it at a time.

Under zero-bubble schedules I is a part's plain input gradient and W the rest of its
backward, both times its ``zero_bubble`` factor: torch's split of one backward into the two
costs more than the backward (zero_bubble.py measures it through torch's schedules).

DualPipeV's overlapped pairs ("(0F3;3B1)OVERLAP_F_B") run as their two actions in turn, and
the schedules' REDUCE_GRAD markers take no time here (the gradient sync is counted after).

An action's seconds are its stage's parts at the micro-batch's tokens (`ModelCosts` fits):
attention and dense MLPs as timed under the plan's tp degree where the costs have it
(``attention/tp2``: DTensor's dispatch and the all-reduces inside), else their per-token
cost split over tp plus two tp all-reduces of the activations per block forward and two
backward; the embedding on the first stage and the head on the last (its vocabulary split
over tp where tp divides it, with one all-reduce of its input gradient). Under
``embedding="sparse"`` the first stage's tables are row-sharded over dp: each rank holds
1/dp of their rows, which neither the dp reduction nor FSDP2 takes, and their forward
exchanges the ids and rows, their backward the rows' gradients (`sparse_rows_exchange`).
Under ``embedding_stages`` the token table's rows lie on the embedding stages, dense
whatever ``embedding`` says; the tables left beside the layers (the positions) stay on the
layers' first stage, replicated or row-sharded as above.

MoE layers: where the costs have the layer timed with its experts over the plan's ep
(``moe/ep4``: the counts exchange, the rows out and back and the busiest rank's experts
inside), tp is 1 and the exchange flat, that time is used; else the plain layer plus two
ep all-to-alls of tokens x top_k rows each way. Under tp their experts' hidden units split
over it (``MoESpec.expert_tp``, as the trainer does): where ep is 1 and the costs have the
layer timed so (``moe/tp2``, its all-reduces inside), that time; where ep is above 1 too,
the layer timed with both (``moe/ep2tp2``: ep groups tp apart, as the trainer's mesh lays
them, the flat exchange), that time; else the layer's per-token
time divided by tp (routing is replicated, and counted split: it is small) plus one tp
all-reduce of its tokens x top_k rows per pass. With ``expert_tp=False`` they run
replicated.

Blocks over micro-batches (``MoESpec.overlap`` = m, `sparta.moe.overlapped_moe_block`): an
MoE block's attention and MoE layer are priced as above at tokens / m, and
`sparta.scheduling.timeline` replays the block's pipeline on the rank's thread and the
link: forward, a micro-batch's attention computes while another's rows travel; backward,
its attention's backward takes the rows as they return. The block computes m micro-batches'
worth; what the replay leaves of its exchanges exposed counts as the action's collectives.
That needs the exchange to wait on a resource of its own, which it does where each rank has
a compute slot (GPUs; `exchange_hides`). Ranks sharing a host's cores move rows on those
cores, across a link or not, so there the micro-batches are priced one after another.

Two-level exchanges (`ep_exchange`, over the ep groups' grid of nodes, `ep_grid_of`):
``MoESpec.hierarchical`` moves each all-to-all's rows inside the node, then across;
``dedup`` crosses once per token and node it needs (`distinct_nodes`, under uniform
routing) and moves a row per pair inside the node; both on the plain layer.
Under ``pipeline_degree="auto"`` each of the tuner's block candidates (`block_candidates`:
1, 2 and 4 micro-batches, each deduplicated too where the groups span nodes) is priced and
the fastest taken, as the tuner takes it. Not modelled: the co-scheduler's chunks
(``pipeline_degree``) and its choice between the flat and the two-level exchange.

After the last action the rank's gradient sync runs: the dense gradients' all-reduce over
dp, of which the bucketed strategies hide what their buckets (``bucket_mb``; sparta's at
most the dense bytes over the layers plus one, with ``bucket_per_layer``) send while the last micro-batch's
backward still runs (`_exposed`: one bucket hides nothing), the experts'
over their replicas; then AdamW. Under fsdp the
reduction is one reduce-scatter per unit (`_reduce_scatter`: an all-reduce of its gradients
on gloo, which runs it so, an all-gather's bytes on NCCL), and waits after the last action
(torch's schedules hold it to the end, and gloo reduce-scatters inside the backward), but
for a one-stage plan on CUDA (no schedule: `ParallelModel.one_stage`), whose reduce-scatters
run on their own stream as the last backward goes, as the buckets do.

Under fsdp each of FSDP2's units (the trainer's `fsdp_units`: every layer, the token table,
the stage module's own rest, the norm and head together; a vocabulary stage's rows, which
are dense over dp, as its module's own) all-gathers its parameters over dp
inside the action that finds them sharded, one call per unit: F gathers what is sharded,
after it the units reshard but the head (and none under zero-bubble schedules, where the
trainer keeps them gathered), and after a B or I all stay gathered until the step's last
(torch's pipelining turns resharding after backward off but for the last micro-batch). So
GPipe over m micro-batches gathers each unit m + 1 times, a zero-bubble schedule once,
which is what a traced step shows (``FSDP::all_gather`` per unit).

Memory per pipeline rank: parameters, gradients and AdamW's two moments (16 bytes per
float32 parameter; fsdp divides them by dp, and adds its units' whole parameters and
gradients: all of the rank's under a schedule or over several micro-batches, which hold
them to the step's reduction, else the largest; "sparta" at dp > 1 adds its buckets'
buffers, 4 bytes a dense parameter), plus the activations of the micro-batches in
flight, tracked through the replay (saved at F, freed at B, or at W under zero-bubble).
Stages in ``config.recompute`` keep only each block's input (tokens x d_model) and run the
blocks' forward again before their backward (B, or I under zero-bubble), one block's
activations live meanwhile.

Every dp and tp rank of one pipeline rank runs the same actions, so a plan's step is the
slowest pipeline rank's.

The replay itself (processor sharing where ranks oversubscribe a host's cores, links
between nodes) is `replay.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil

from sparta.errors import ConfigError
from sparta.parallel.decoder import DecoderConfig
from sparta.parallel.dims import ParallelDims
from sparta.parallel.experts import MoESpec
from sparta.parallel.grad_buckets import bucket_cap
from sparta.parallel.parallel_config import ParallelConfig
from sparta.parallel.pipeline import ZERO_BUBBLE, action_table, stage_ids
from sparta.scheduling.trace import Span
from sparta.scheduling.varlen import LengthCost

from .costs import FLOAT_BYTES, ModelCosts
from .replay import replay
from .stage_cost import StageCost, stage_cost

ADAMW_BYTES = 4 * FLOAT_BYTES  # parameter, gradient, two moments
DDP_BUCKET_MB = 25.0  # DistributedDataParallel's bucket_cap_mb default


@dataclass(frozen=True)
class Workload:
    """The model and the batch a plan trains: global_batch sequences of model.seq_len tokens per step."""

    model: DecoderConfig
    moe: MoESpec | None
    global_batch: int

    def __post_init__(self) -> None:
        if not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise ConfigError(f"Workload.global_batch={self.global_batch!r} must be a positive integer")


@dataclass(frozen=True)
class Plan:
    """A layout and how the trainer cuts and wraps the model: what `sparta train` runs."""

    dims: ParallelDims
    config: ParallelConfig

    def describe(self) -> str:
        """One line naming the layout, schedule, micro-batches and the choices that differ from the defaults."""
        d, c = self.dims, self.config
        where = ",".join(c.split_points or ())
        return (
            f"pp{d.pp} dp{d.dp} tp{d.tp} ep{d.ep} {c.schedule} x{c.microbatches}"
            + (f" v{c.stages_per_rank}" if c.stages_per_rank > 1 else "")
            + f" {c.data_parallel}"
            + (" sparse-embedding" if c.embedding == "sparse" else "")
            + (" embedding-stages" if c.embedding_stages else "")
            + (" vocab-stages" if c.vocab_stages else "")
            + (f" recompute{list(c.recompute)}" if c.recompute else "")
            + (f" overlap{c.moe.overlap}" if c.moe is not None and c.moe.overlap > 1 else "")
            + (" dedup" if c.moe is not None and c.moe.dedup else "")
            + (f" split@{where}" if where else "")
        )


@dataclass
class Prediction:
    """step_s: predicted seconds per optimizer step; pipeline_s, sync_s, optimizer_s: its
    parts on the slowest pipeline rank; peak_bytes: each pipeline rank's peak memory;
    spans: the predicted timeline, {pipeline rank: spans} (times in seconds from 0)."""

    step_s: float
    pipeline_s: float
    sync_s: float
    optimizer_s: float
    peak_bytes: dict[int, float]
    spans: dict[int, list[Span]] = field(repr=False, default_factory=dict)

    @property
    def max_peak_bytes(self) -> float:
        """The highest pipeline rank's predicted peak memory, in bytes."""
        return max(self.peak_bytes.values())


def stage_layers(plan: Plan, n_layers: int) -> list[list[int]]:
    """Layer indices of each stage, from the plan's split points ("layers.K" where stage i+1
    begins); the embedding stages (``embedding_stages``, first) and the head stages
    (``vocab_stages``, last) hold none."""
    stages = plan.config.body_stages(plan.dims.pp)
    front = plan.config.first_body(plan.dims.pp)
    heads = plan.dims.pp * plan.config.stages_per_rank - stages - front
    points = plan.config.split_points
    if points is None:
        raise ConfigError("a plan needs split_points to be simulated (the planner balances them; see search.py)")
    try:
        cuts = [int(p.removeprefix("layers.")) for p in points]
    except ValueError:
        raise ConfigError(f"split_points={points} must name layers as 'layers.K'") from None
    bounds = [0, *cuts, n_layers]
    if len(cuts) != stages - 1 or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ConfigError(f"split_points={points} do not cut {n_layers} layers into {stages} non-empty stages")
    body = [list(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]
    return [[] for _ in range(front)] + body + [[] for _ in range(heads)]


def simulate(costs: ModelCosts, work: Workload, plan: Plan, trace: bool = False) -> Prediction:
    """Predict ``plan``'s step on ``costs`` (see the module doc). Pure: no process group."""
    dims, config = plan.dims, plan.config
    config.check(dims, work.model.n_layers)
    if work.global_batch % (dims.dp * config.microbatches):
        raise ConfigError(
            f"global_batch={work.global_batch} does not divide into dp={dims.dp} x microbatches={config.microbatches}"
        )
    tokens = work.global_batch // (dims.dp * config.microbatches) * work.model.seq_len
    layers = stage_layers(plan, work.model.n_layers)
    stages = [stage_cost(costs, work, plan, i, ls, tokens) for i, ls in enumerate(layers)]
    owner = {s: r for r in range(dims.pp) for s in stage_ids(config.schedule, dims.pp, r, config.stages_per_rank)}
    # the hops between the pipeline ranks of consecutive stages, either way
    replicas, nbytes = dims.dp * dims.tp, tokens * work.model.d_model * costs.element_bytes
    pairs = {(owner[s], owner[s + 1]) for s in range(len(stages) - 1)}
    hop: dict[tuple[int, int], tuple[float, tuple[int, int] | None]] = {}
    for a, b in (ends for p in pairs for ends in (p, p[::-1])):
        first, second = a * replicas, b * replicas
        hop[a, b] = costs.hop(nbytes, first, second, replicas), costs.link(first, second, replicas)
    actions = action_table(config.schedule, dims.pp, config.microbatches, config.stages_per_rank)
    # pipeline ranks that compute at full speed at once: the hosts' slots over each one's replicas
    share = costs.slots * (dims.world_size / costs.ranks_per_host) / (dims.dp * dims.tp)
    zero_bubble = config.schedule in ZERO_BUBBLE
    grad = costs.element_bytes
    unshard: dict[int, tuple[float, float]] = {}
    if config.data_parallel == "fsdp" and dims.dp > 1:

        def gathers(st: StageCost, resharded: bool) -> float:
            return sum(
                costs.collective("all_gather", dims.dp, params * grad / dims.dp, dims.tp)
                for params, again in st.units
                if again == resharded
            )

        unshard = {i: (gathers(st, True), gathers(st, False)) for i, st in enumerate(stages)}
    # on one node every collective is the host's cores' work (replay.py)
    one_node = costs.ranks_per_node >= dims.world_size
    spans, finish, peak = replay(actions, stages, owner, hop, zero_bubble, unshard, trace, share, one_node)

    # FSDP2's reduce-scatters overlap the last backward where they run on a stream of their
    # own (CUDA) and the step runs without a schedule (one stage; torch's schedules hold them
    # to the end); on gloo they wait in the backward
    streamed = len(stages) == 1 and costs.hardware.get("device_type") == "cuda"
    step = pipeline_s = sync_s = opt_s = 0.0
    peak_bytes: dict[int, float] = {}
    for rank in range(dims.pp):
        mine = [stages[s] for s in owner if owner[s] == rank]
        dense = sum(s.dense_params for s in mine)
        expert = sum(s.expert_params for s in mine)
        held = sum(s.params for s in mine)
        units = [params for s in mine for params, _ in s.units]  # FSDP2's, on this rank
        if config.data_parallel == "fsdp":
            # one reduce-scatter per unit, as it gathers: a traced pp2 dp4 step on 8 CPU
            # ranks spent 62 ms in rank 0's seven, where one all-reduce of all their
            # gradients is priced 21 ms
            reduce, pieces = sum(_reduce_scatter(costs, dims, n * grad) for n in units), len(units)
        else:
            reduce = costs.collective("all_reduce", dims.dp, dense * grad, dims.tp)
            # horovod reduces at the step's end in one go; sparta's buckets (bucket_mb) and
            # DDP's (torch's 25 MiB: the trainer sets none) are sent as backward fills each;
            # sparta's at most the dense bytes over the rank's layers plus one (bucket_per_layer),
            # counted as equal pieces: the trainer closes a bucket at a parameter's end
            bucket_mb = config.bucket_mb if config.data_parallel == "sparta" else DDP_BUCKET_MB
            per_layer = config.data_parallel == "sparta" and config.bucket_per_layer
            least = sum(len(layers[s]) for s in owner if owner[s] == rank) + 1 if per_layer else 1
            cap = bucket_cap(ceil(dense * grad), int(bucket_mb * 2**20), least)
            pieces = 1 if config.data_parallel == "horovod" else ceil(dense * grad / cap)
        if config.data_parallel == "fsdp" and not streamed:  # gloo: each ran inside the backward
            sync = reduce
        elif zero_bubble:
            # the weight passes set .grad by hand (torch's stage_backward_weight): no bucket's
            # hooks fire, and every bucket goes once the pipeline is done (DataParallel.finish)
            sync = reduce
        else:  # the last micro-batch's backward hides what its pieces sent before it ended
            sync = _exposed(reduce, sum(s.bwd + s.bwd_comm for s in mine), pieces)
        whole = 0.0  # bytes beside the sharded state: FSDP2's units gathered, or sparta's bucket buffers
        if config.data_parallel == "fsdp":
            held = held - dense + dense / dims.dp
            # FSDP2's units whole, parameters and gradients: under torch's schedules, and in one
            # stage over several micro-batches, every unit of the rank from its first gather to
            # the step's reduction (resharding and reducing are off but for the last
            # micro-batch); one stage and one micro-batch, the largest unit at a time
            alone = len(stages) == 1 and config.microbatches == 1
            whole = 2 * FLOAT_BYTES * (max(units, default=0.0) if alone else sum(units))
        elif config.data_parallel == "sparta" and dims.dp > 1:
            whole = dense * grad  # each bucket's flat buffer, kept from step to step (grad_buckets.py)
        sync += costs.collective("all_reduce", dims.dp // dims.ep, expert * grad, dims.tp * dims.ep)
        # the clip's norm and the reported loss: one scalar all-reduce over the world each
        opt = costs.optimizer(held) * max(1.0, dims.pp / share)  # every rank steps at once
        opt += 2 * costs.collective("all_reduce", dims.world_size, 8)
        total = finish[rank] + sync + opt
        if trace:
            spans[rank].append(Span("grad sync", "comm", finish[rank], finish[rank] + sync))
            spans[rank].append(Span("optimizer", "compute", finish[rank] + sync, total))
        peak_bytes[rank] = held * ADAMW_BYTES + whole + peak[rank]
        if total > step:
            step, pipeline_s, sync_s, opt_s = total, finish[rank], sync, opt
    return Prediction(step, pipeline_s, sync_s, opt_s, peak_bytes, spans if trace else {})


def _exposed(reduce: float, backward: float, pieces: int) -> float:
    """Seconds of a gradient reduction of ``pieces`` equal pieces (buckets, FSDP2 units) past
    the end of the ``backward`` that readies them one after another, each sent when ready and
    the sends one at a time: the last piece always shows; a reduction slower than the
    backward shows all but the backward after the first piece. A traced dp8 step (one 25 MiB
    bucket held its 4.3 MB) sent its all-reduce after the backward, 26.6 ms on one host and
    220 ms across a 300 Mbit/s link, as one piece predicts."""
    if reduce <= 0:
        return 0.0
    n = max(pieces, 1)
    return max(reduce - backward * (n - 1) / n, reduce / n)


def _reduce_scatter(costs: ModelCosts, dims: ParallelDims, nbytes: float) -> float:
    """Seconds of FSDP2's reduce-scatter of one unit's ``nbytes`` of gradients over dp. gloo
    runs it as an all-reduce of them all (``gloo:all_reduce`` inside a traced step's
    ``FSDP::post_backward_reduce``); NCCL's ring moves what an all-gather of the shards does."""
    if costs.hardware.get("device_type") == "cuda":
        return costs.collective("all_gather", dims.dp, nbytes / dims.dp, dims.tp)
    return costs.collective("all_reduce", dims.dp, nbytes, dims.tp)


def length_cost(costs: ModelCosts, work: Workload) -> LengthCost:
    """The whole model's forward + backward from the measured parts (one rank, no
    parallelism), for `sparta.scheduling.varlen`'s groupings: the sum of every part's fits,
    linear in tokens (the parts are measured at ``seq_len``)."""
    model, moe = work.model, work.moe
    names = ["embed", "head"] + ["attention"] * model.n_layers
    names += ["moe" if moe is not None and moe.is_moe(i) else "mlp" for i in range(model.n_layers)]
    alpha = sum(costs.parts[n].fwd.alpha + costs.parts[n].bwd.alpha for n in names)
    beta = sum(costs.parts[n].fwd.beta + costs.parts[n].bwd.beta for n in names)
    return LengthCost(alpha, beta)
