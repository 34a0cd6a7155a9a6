"""What one pipeline stage of a plan costs per micro-batch: its actions' compute and the
collectives inside them, its saved activations and the parameters it holds (the part of the
simulator that prices the parts; `simulate.py` replays the schedule on these). The rules
for each part (tp halves, MoE layers under ep and tp, the embedding and the head, the
vocabulary stages, recomputation) are in `simulate.py`'s module docstring.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from math import comb
from typing import TYPE_CHECKING

from sparta.errors import ConfigError
from sparta.parallel.auto_schedule import BLOCK_MICROBATCHES
from sparta.parallel.decoder import DecoderConfig
from sparta.parallel.dims import ParallelDims
from sparta.parallel.experts import EpGrid, MoESpec, ep_grid
from sparta.parallel.parallel_config import tunes_blocks
from sparta.scheduling.timeline import timeline

from .costs import ModelCosts

if TYPE_CHECKING:
    from .simulate import Plan, Workload


@dataclass(frozen=True)
class StageCost:
    """One stage's seconds and bytes per micro-batch on this plan (see the module docstring)."""

    fwd: float  # compute seconds at full speed
    bwd: float
    # zero-bubble schedules only: their input pass I, and I + W, as torch splits the
    # backward (each part's PartCost.zero_bubble applied)
    bwd_input: float
    zb_bwd: float
    fwd_comm: float  # collective seconds inside the action (tp all-reduces, ep all-to-alls)
    bwd_comm: float
    bwd_input_comm: float
    saved: float  # activation bytes per micro-batch, held from F to B (or W)
    transient: float  # bytes briefly live during backward (a recomputed block's activations)
    params: float  # float32 parameters this rank holds for the stage (with sparse tables' shards)
    dense_params: float  # of which reduced over dp
    expert_params: float  # of which reduced over the expert's replicas
    # FSDP2's units under "fsdp" (dp_rules.fsdp_units): each one's parameters on this
    # rank before dp shards them, and whether it reshards after forward (the head does not)
    units: tuple[tuple[float, bool], ...] = ()
    # zero-bubble schedules only: collective seconds inside the weight pass W (the sparse
    # tables' row gradients, which the embedding's own backward sends)
    weight_comm: float = 0.0


def stage_cost(
    costs: ModelCosts, work: Workload, plan: Plan, index: int, layers: list[int], tokens: float
) -> StageCost:
    """Global stage ``index`` of ``plan``, holding ``layers``, at ``tokens`` per micro-batch. Pure."""
    dims, cfg, moe = plan.dims, work.model, work.moe
    n_stages = dims.pp * plan.config.stages_per_rank
    act = tokens * cfg.d_model * costs.element_bytes
    # [fwd, bwd, bwd_input, saved, zb_bwd] of the stage's blocks and of its extras
    # (embedding, head), and the collectives' seconds inside fwd, bwd and bwd_input
    blocks, extras, comms = [0.0] * 5, [0.0] * 5, [0.0] * 3
    outside_blocks = 0.0  # forward collectives of the stage that are not its blocks' (not recomputed)
    weight_comm = 0.0
    largest_block = dense = expert = sharded = 0.0
    grid = ep_grid_of(dims, costs)  # the ep groups over the nodes, for two-level exchanges
    units: list[tuple[float, bool]] = []

    def add(
        into: list[float],
        part: str,
        split: int,
        comm: float = 0.0,
        group: int = dims.tp,
        saved_split: int = 0,
        at: float = tokens,
        waits: list[float] | None = None,
    ) -> None:
        # a part's fixed cost per call (launches, Python) is every tp rank's, whole; its
        # per-token cost is split, and so are its saved activations unless saved_split says
        # otherwise. ``at``: the tokens of one call (a block's micro-batch under overlap);
        # ``waits``: where its collectives' seconds go (the stage's by default)
        p = costs.parts[part]
        into_comms = comms if waits is None else waits
        # a part that waits inside (a tp half's all-reduces, an ep MoE layer's exchanges):
        # its busy share is compute, the rest waiting, which was measured on its group's
        # share of the host (group / slots) and is not slowed by the host's other ranks: it
        # joins the unshared collectives
        waited = (1.0 - p.busy) * max(1.0, group / costs.slots)
        for i, f in enumerate((p.fwd, p.bwd, p.bwd_input)):
            seconds = f.alpha + f.beta * at / split
            into[i] += p.busy * seconds * (p.zero_bubble if i == 2 else 1.0)
            into_comms[i] += comm + waited * seconds
            if i == 1:
                into[4] += p.busy * seconds * p.zero_bubble
        into[3] += p.saved_bytes_per_token * at / (saved_split or split)

    first, body = plan.config.first_body(dims.pp), plan.config.body_stages(dims.pp)
    # vocabulary stages' rows: 1/pp of the table each, cut over tp too as the tp head is
    config = plan.config
    rows_tp = dims.tp if config.tensor_parallel and config.vocab_parallel_head and dims.tp > 1 else 1
    tables = embedding_tables(costs, cfg)
    if index < first:
        # an embedding stage (embedding_stages): its token rows' lookups, summed over tp
        # forward; dense rows whatever ``embedding`` says, since only the layers' first
        # stage swaps its tables
        add(extras, "embed", dims.pp * rows_tp)
        if rows_tp > 1:
            comms[0] += costs.collective("all_reduce", rows_tp, act)
        dense += tables[0] / (dims.pp * rows_tp)
        units.append((tables[0] / (dims.pp * rows_tp), True))  # the stage module's own
    elif index == first:
        # the layers' first stage: the whole embedding, or under embedding_stages the tables
        # left beside the layers (the positions), whose lookups are in the embedding
        # stages' share of the part
        held = tables[1:] if first else tables
        if not first:
            add(extras, "embed", 1)
        if plan.config.embedding == "sparse":
            # row-sharded over dp (swap_embeddings): no reduction and no FSDP2 unit takes
            # the shards; their rows travel instead (`sparse_rows_exchange`)
            sharded += sum(held) / dims.dp
            forward, backward = sparse_rows_exchange(costs, cfg, dims, tokens, held)
            comms[0] += forward
            comms[1] += backward
            outside_blocks += forward
            weight_comm += backward
        else:
            dense += sum(held)
            # the token table a unit of its own, the position table left to the stage
            # module's own
            units += [(n, True) for n in held]

    def add_dense(part: str, into: list[float], at: float = tokens, waits: list[float] | None = None) -> None:
        measured = f"{part}/tp{dims.tp}"  # timed under tp, its all-reduces inside (costs.py)
        if dims.tp > 1 and measured in costs.parts:
            add(into, measured, 1, at=at, waits=waits)
        else:
            reduced = at * cfg.d_model * costs.element_bytes  # the activations' all-reduce
            add(into, part, dims.tp, costs.collective("all_reduce", dims.tp, reduced), at=at, waits=waits)

    def add_moe(into: list[float], at: float = tokens, waits: list[float] | None = None, dedup: bool = False) -> None:
        # tokens x top_k rows out and back; under tp the experts' hidden units split over
        # it (MoESpec.expert_tp: the layer's per-token time divided, its rows all-reduced
        # once each way) or replicated
        assert moe is not None
        split = dims.tp if moe.expert_tp else 1
        measured = f"moe/ep{dims.ep}"  # timed over ep groups of adjacent ranks, flat exchange
        split_measured = f"moe/tp{dims.tp}"  # timed with its experts split over adjacent ranks
        both_measured = f"moe/ep{dims.ep}tp{dims.tp}"  # both, ep groups tp apart as in the mesh
        spec = plan.config.moe  # the run's exchange (work.moe: the model's experts)
        two_level = dims.ep > 1 and (dedup or (spec is not None and spec.hierarchical))
        if dims.ep > 1 and dims.tp == 1 and not two_level and measured in costs.parts:
            add(into, measured, 1, group=dims.ep, at=at, waits=waits)
        elif dims.ep == 1 and split > 1 and split_measured in costs.parts:
            add(into, split_measured, 1, at=at, waits=waits)
        elif dims.ep > 1 and split > 1 and not two_level and both_measured in costs.parts:
            add(into, both_measured, 1, group=dims.ep * dims.tp, at=at, waits=waits)
        else:
            rows = at * cfg.d_model * costs.element_bytes * moe.top_k
            if two_level:
                comm = ep_exchange(costs, moe, cfg.d_model, at, grid, dedup)
            else:
                comm = 2 * costs.collective("all_to_all", dims.ep, rows, stride=dims.tp)
            if split > 1:
                comm += costs.collective("all_reduce", split, rows)
            # the rows it saves are whole on every tp rank, only the hidden units split:
            # counted whole (the budget errs safe)
            add(into, "moe", split, comm, saved_split=1, at=at, waits=waits)

    def moe_block(m: int, dedup: bool) -> tuple[list[float], list[float]]:
        # an MoE block over m micro-batches, its tokens deduplicated per node or not: its
        # compute ([fwd, bwd, bwd_input, saved, zb_bwd], summed over them) and each pass's
        # seconds end to end. Over several, `timeline` replays overlapped_block's order:
        # forward, one's attention computes while another's rows travel; backward, the
        # attention's backward takes the rows that return. The waits it leaves exposed join
        # the action's collectives
        attention, experts = [0.0] * 5, [0.0] * 5
        attention_waits, exchange = [0.0] * 3, [0.0] * 3
        add_dense("attention", attention, tokens / m, attention_waits)
        add_moe(experts, tokens / m, exchange, dedup)
        compute = [m * (a + e) for a, e in zip(attention, experts, strict=True)]
        if m == 1 or not hides:
            return compute, [compute[i] + m * (attention_waits[i] + exchange[i]) for i in range(3)]
        ends = []
        for i in range(3):
            dense_s = attention[i] + attention_waits[i]
            where = {"before_s": dense_s} if i == 0 else {"after_s": dense_s}
            ends.append(timeline([exchange[i] / 2] * m, [experts[i]] * m, **where).end_s)
        return compute, ends

    candidates = block_candidates(plan, tokens / cfg.seq_len, grid)
    hides = exchange_hides(costs)
    # every MoE block of the stage alike: the tuner's fastest, priced once
    chosen: tuple[list[float], list[float]] | None = None
    for layer in layers:
        before, dense_before = blocks[3], dense
        if moe is not None and moe.is_moe(layer):
            chosen = chosen or min((moe_block(*c) for c in candidates), key=lambda b: b[1][0] + b[1][1])
            compute, ends = chosen
            for i in range(5):
                blocks[i] += compute[i]
            for i in range(3):
                comms[i] += ends[i] - compute[i]
        else:
            add_dense("attention", blocks)
            add_dense("mlp", blocks)
        dense += costs.parts["attention"].params / dims.tp
        if moe is not None and moe.is_moe(layer):
            split = dims.tp if moe.expert_tp else 1
            router = cfg.d_model * moe.num_experts
            experts = (costs.parts["moe"].params - router) / (dims.ep * split)
            # over ep the experts are reduced over their replicas alone; at ep1 they are the
            # layer's own dense parameters (no expert group: `dp_rules.expert_parameters`
            # finds none), in its FSDP2 unit and the dense buckets
            expert += experts if dims.ep > 1 else 0.0
            dense += router + (0.0 if dims.ep > 1 else experts)
        else:
            dense += costs.parts["mlp"].params / dims.tp
        largest_block = max(largest_block, blocks[3] - before)
        units.append((dense - dense_before, True))
    if index >= first + body:
        # a head stage (vocab_stages): its rows' per-token work (its fixed cost per call
        # whole); over tp, its input gradient summed backward (the statistics are small)
        add(extras, "head", dims.pp * rows_tp)
        if rows_tp > 1:
            comms[1] += costs.collective("all_reduce", rows_tp, act)
            comms[2] += costs.collective("all_reduce", rows_tp, act)
        dense += costs.parts["head"].params / (dims.pp * rows_tp)
        units.append((costs.parts["head"].params / (dims.pp * rows_tp), True))
    elif index == n_stages - 1:
        # its vocabulary split over tp where tp divides it, as parallelize does (the "vocab"
        # style, the loss on the shards): per-token time and parameters divided, plus the
        # input gradient's all-reduce
        split_head = config.tensor_parallel and config.vocab_parallel_head and cfg.vocab_size % dims.tp == 0
        head = dims.tp if dims.tp > 1 and split_head else 1
        add(extras, "head", head)
        if head > 1:
            comms[1] += costs.collective("all_reduce", head, act)
            comms[2] += costs.collective("all_reduce", head, act)
        dense += costs.parts["head"].params / head
        units.append((costs.parts["head"].params / head, False))
    transient = 0.0
    if index in plan.config.recompute:
        # only each block's input is kept; backward runs its forward again first
        for i in (1, 2, 4):
            blocks[i] += blocks[0]
        blocks[3], transient = len(layers) * act, largest_block
        # the blocks' forward collectives run again too (recompute_layers wraps the blocks
        # alone: the embedding's row exchange does not)
        comms[1] += comms[0] - outside_blocks
        comms[2] += comms[0] - outside_blocks
    fwd, bwd, bwd_input, saved, zb_bwd = (b + e for b, e in zip(blocks, extras, strict=True))
    held = tuple((float(n), again) for n, again in units if n > 0)  # a module without parameters is no unit
    params = dense + expert + sharded
    return StageCost(fwd, bwd, bwd_input, zb_bwd, *comms, saved, transient, params, dense, expert, held, weight_comm)


def block_candidates(plan: Plan, sequences: float, grid: EpGrid | None) -> Sequence[tuple[int, bool]]:
    """The (micro-batches, deduplicated) ways ``plan``'s MoE blocks may run at ``sequences``
    per pipeline micro-batch, ``grid`` being its ep groups over the nodes (`ep_grid_of`):
    ``MoESpec.overlap`` and ``dedup`` as set; under ``pipeline_degree="auto"`` the tuner's
    candidates where the trainer tunes blocks (`BLOCK_MICROBATCHES` up to the sequences, where
    `tunes_blocks`, each also deduplicated where the groups span nodes evenly), of which the
    simulator takes the fastest block, as the tuner does. ConfigError for an overlap past
    the sequences, or a two-level exchange (hierarchical, dedup) over groups that lie
    unevenly on the nodes, as the trainer refuses it."""
    spec, config = plan.config.moe, plan.config
    if spec is None:
        return ((1, False),)
    if (spec.hierarchical or spec.dedup) and plan.dims.ep > 1 and grid is None:
        raise ConfigError(
            f"MoESpec.{'dedup' if spec.dedup else 'hierarchical'}: the expert-parallel groups of {plan.dims.ep} ranks "
            "do not lie evenly over the nodes; the two-level all-to-all needs as many ranks on each (launch equal "
            "ranks per node, or set it False)"
        )
    if spec.auto:
        if tunes_blocks(config, plan.dims):
            counts = [m for m in BLOCK_MICROBATCHES if m <= sequences]
            spans = grid is not None and grid.spans_nodes
            return [(m, False) for m in counts] + [(m, True) for m in counts if spans]
        return ((1, False),)
    if spec.overlap > sequences:
        raise ConfigError(
            f"MoESpec.overlap={spec.overlap} cuts each block's batch into whole sequences, but a pipeline "
            f"micro-batch holds {sequences:g}: lower overlap or microbatches"
        )
    return ((spec.overlap, spec.dedup),)


def ep_grid_of(dims: ParallelDims, costs: ModelCosts) -> EpGrid | None:
    """How the expert-parallel groups of ``dims`` lie over nodes of ``costs.ranks_per_node``
    consecutive ranks (`experts.ep_grid`)."""
    return _ep_grid(dims, costs.ranks_per_node)


@functools.lru_cache(maxsize=1024)
def _ep_grid(dims: ParallelDims, node: int) -> EpGrid | None:
    # every stage of every plan asks, and at 64 ranks laying the groups out took an eighth of
    # a search: once per layout and node size
    world = dims.world_size
    return ep_grid(dims.ep_groups(), [range(r, min(r + node, world)) for r in range(0, world, node)])


def spans_nodes(dims: ParallelDims, costs: ModelCosts) -> bool:
    """Whether every expert-parallel group of ``dims`` spans several nodes evenly, where
    the trainer weighs the two-level exchange (`experts.two_level_pays`)."""
    grid = ep_grid_of(dims, costs)
    return grid is not None and grid.spans_nodes


def distinct_nodes(num_experts: int, top_k: int, nodes: int) -> float:
    """The nodes a token's top_k distinct experts lie on, expected under uniform routing
    with the experts spread evenly over ``nodes``: nodes x (1 - C(E - E/nodes, k) / C(E, k))."""
    return nodes * (1 - comb(num_experts - num_experts // nodes, top_k) / comb(num_experts, top_k))


def ep_exchange(
    costs: ModelCosts, moe: MoESpec, d_model: int, tokens: float, grid: EpGrid | None, dedup: bool
) -> float:
    """Seconds of one pass's two-level exchanges (`sparta.comm.HierarchicalAllToAll`) over
    ``grid`` for ``tokens`` tokens, rows out and back. Plain (``MoESpec.hierarchical``): each
    all-to-all moves the tokens x top_k rows inside the node, then across. Deduplicated
    (``dedup``, `sparta.moe.overlapped_moe_block`): across, one row per token and node it
    needs (`distinct_nodes`), its k weights and k expert slots beside it out and the summed
    row back; inside, one row per pair each way."""
    assert grid is not None
    row = d_model * costs.element_bytes
    pairs = tokens * moe.top_k * row

    def inside(nbytes: float) -> float:
        return costs.collective("all_to_all", grid.local, nbytes, stride=grid.local_stride)

    def across(nbytes: float) -> float:
        return costs.collective("all_to_all", grid.nodes, nbytes, stride=grid.node_stride)

    if not dedup:
        return 2 * (inside(pairs) + across(pairs))
    needed = tokens * distinct_nodes(moe.num_experts, moe.top_k, grid.nodes)
    return across(needed * (row + 2 * moe.top_k * costs.element_bytes)) + across(needed * row) + 2 * inside(pairs)


def exchange_hides(costs: ModelCosts) -> bool:
    """Whether an MoE exchange waits on a resource of its own (the link, a GPU's copy
    engines) that a micro-batch's compute can hide: where each rank has a compute slot.
    Ranks that share a host's cores move their rows on those cores too, across a link or
    not: on 8 ranks over 2 cores, blocks over 2 micro-batches ran a pp4 dp2 ep2 plan (ep
    within a node) at 0.60 s a step against 0.46 s whole, and a dp8 ep8 plan (across the
    emulated cluster's 300 Mbit/s link) at 1.35 s against 0.89 s whole."""
    return costs.slots >= costs.ranks_per_host


def sparse_rows_exchange(
    costs: ModelCosts, cfg: DecoderConfig, dims: ParallelDims, tokens: float, tables: Sequence[float]
) -> tuple[float, float]:
    """Seconds of a micro-batch's row exchanges of the layers' first stage's row-sharded
    ``tables`` (parameters each; every `nn.Embedding` there made a SparseEmbedding over dp,
    `sparta.embedding.lookup`), forward and backward, for ``tokens`` ids a rank. Per table,
    forward: the id counts, the unique ids (int64) and their rows; backward: the rows'
    gradients. Unique ids are counted at their most, one per token up to the table's rows (the
    ids' skew is not in the workload)."""
    row = cfg.d_model * costs.element_bytes
    forward = backward = 0.0
    for params in tables:
        rows = params / cfg.d_model
        if rows <= 0:
            continue
        unique = min(tokens, rows)
        forward += costs.collective("all_to_all", dims.dp, dims.dp * 8, dims.tp)
        forward += costs.collective("all_to_all", dims.dp, unique * 8, dims.tp)
        forward += costs.collective("all_to_all", dims.dp, unique * row, dims.tp)
        backward += costs.collective("all_to_all", dims.dp, unique * row, dims.tp)
    return forward, backward


def embedding_tables(costs: ModelCosts, cfg: DecoderConfig) -> tuple[float, float]:
    """Parameters of the first stage's token table and of the rest of its embedding part (the
    decoder's learned positions)."""
    whole = costs.parts["embed"].params
    token = min(cfg.vocab_size * cfg.d_model, whole)
    return token, whole - token
