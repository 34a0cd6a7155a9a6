"""What data parallelism (data_parallel.py) decides before it wraps anything: its strategies,
which of a module's parameters are experts and which are shards (the two kinds it does not
reduce over the whole dp group), FSDP2's units, and the checks that refuse a strategy the
schedule or engine cannot run, or groups its gradient scaling would get wrong. All pure: no
collective, so every rank can fail alike before the first one.
"""

from __future__ import annotations

from torch import nn

from sparta.embedding import SparseEmbedding, VocabParallelHead
from sparta.errors import ConfigError
from sparta.moe import MoELayer
from sparta.parallel.dims import Layout
from sparta.parallel.vocab_stages import VocabShard

STRATEGIES = ("ddp", "fsdp", "horovod", "sparta")


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters of the experts of ``module``'s expert-parallel MoE layers (``comm`` set)."""
    layers = [m for m in module.modules() if isinstance(m, MoELayer) and m.comm is not None]
    return [p for m in layers for p in m.experts.parameters()]


def fsdp_units(module: nn.Module, ignored: set[nn.Parameter]) -> list[tuple[list[nn.Module], bool]]:
    """The modules FSDP2 shards as units of their own under "fsdp", in forward order, each with
    whether it may reshard after forward (the module itself is the last unit, holding the
    rest). A decoder's layers are one unit each; its untied token embedding another; its
    final norm and output head one together, kept gathered from forward to backward (backward
    needs them first: resharding would only gather them again at once, unoverlapped). A tied
    head stays in the module's own unit. Children whose every parameter is ``ignored``
    (shards, experts) are no unit, nor a vocabulary stage's rows (`VocabShard`): the
    embedding stages read their weight in their own forward, which would find it sharded
    (a unit is gathered when its own forward runs), so they stay in the stage's unit."""

    def owned(*children: nn.Module | None) -> list[nn.Module]:
        kept = [c for c in children if isinstance(c, nn.Module) and not isinstance(c, VocabShard)]
        mine = [p for c in kept for p in c.parameters() if p not in ignored]
        return kept if mine else []

    emb, norm, head = (getattr(module, name, None) for name in ("tok_emb", "norm", "output"))
    tied = isinstance(emb, nn.Module) and isinstance(head, nn.Module)
    tied = tied and any(p is q for p in emb.parameters() for q in head.parameters())  # type: ignore[union-attr]
    units = [] if tied else [(owned(emb), True)]
    units += [([layer], True) for layer in getattr(module, "layers", {}).values() if owned(layer)]
    if not tied:
        units.append((owned(norm, head) if owned(head) else [], False))
    return [(u, after) for u, after in units if u]


def shard_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The shards of ``module``'s SparseEmbeddings and VocabParallelHeads sharded over a
    group (a tied head's shard is its table's, listed once)."""
    tables = [m for m in module.modules() if isinstance(m, (SparseEmbedding, VocabParallelHead)) and m.comm is not None]
    return list(dict.fromkeys(p for m in tables for p in m.parameters()))


def ddp_needs_find_unused(schedule: str, pp: int, microbatches: int, stages_here: int) -> bool:
    """Whether torch DDP runs with ``find_unused_parameters=True`` under this schedule, whatever
    the configuration says: the flag is DDP's public switch that also skips its first step's
    bucket rebuild, which fails here. torch 2.13 records each gradient hook for the rebuild
    until a stage's next forward; a stage that runs two backwards with no forward between them
    in its first step (GPipe and the interleaved schedules with several micro-batches, 1F1B
    with as many micro-batches as stages) records every parameter twice, and the next step
    stops in ``reducer.cpp`` ("rebuilt parameter indices size is not same as original"). The
    price is a walk of the autograd graph from each forward's output. 1F1B with more
    micro-batches than stages runs a forward after each stage's first backward, and one stage
    alone (pp 1, ``stages_here`` 1: `ParallelModel` runs no schedule) a forward before each
    backward: no flag."""
    if microbatches == 1 or (pp == 1 and stages_here == 1):
        return False
    return not (schedule == "1F1B" and microbatches > pp)


def check_strategy(strategy: str, zero_bubble: bool, tp: int, backend: str | None = None) -> None:
    """ConfigError unless ``strategy`` can run here (on engine ``backend``, where given). Pure."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"data_parallel={strategy!r} is unknown; choose one of {', '.join(STRATEGIES)}")
    if strategy == "ddp" and zero_bubble:
        raise ConfigError(
            "data_parallel='ddp' cannot run under a zero-bubble schedule: DDP reduces in AccumulateGrad hooks, "
            "which their weight-gradient passes never fire; use data_parallel='fsdp' or 'sparta'"
        )
    if strategy == "ddp" and tp > 1:
        raise ConfigError(
            f"data_parallel='ddp' with tp={tp}: torch DDP takes no DTensor parameters; use 'fsdp' (FSDP2 composes "
            "with tensor parallelism) or 'sparta'"
        )
    if strategy == "horovod" and backend not in (None, "horovod"):
        raise ConfigError(
            f"data_parallel='horovod' needs the Horovod engine (launch with horovodrun), but the world runs "
            f"{backend!r}; use 'sparta', which runs on every engine"
        )


def check_groups(module: nn.Module, layout: Layout) -> None:
    """ConfigError unless every expert-parallel MoE layer of ``module`` shards over the
    ranks of ``layout.ep`` and every sharded table or head over those of ``layout.dp``
    (what `finish`'s scaling assumes). Pure: call it before any collective."""
    ep = tuple(layout.ep.ranks) if layout.ep is not None else None
    dp = tuple(layout.dp.ranks)
    for path, m in module.named_modules():
        if isinstance(m, MoELayer) and m.comm is not None and tuple(m.comm.ranks) != ep:
            raise ConfigError(
                f"MoE layer {path or m.name!r} splits its experts over world ranks {list(m.comm.ranks)}, but the "
                f"layout's expert-parallel group is {list(ep) if ep else 'none (ep=1)'}: data parallelism would sum "
                "and scale its expert gradients for another group, i.e. average them with other experts'. Build the "
                f"layers with comm=layout.ep (ParallelDims(ep={m.comm.size}))"
            )
        if isinstance(m, (SparseEmbedding, VocabParallelHead)) and m.comm is not None and tuple(m.comm.ranks) != dp:
            raise ConfigError(
                f"{type(m).__name__} {path!r} is sharded over world ranks {list(m.comm.ranks)}, but the layout's "
                f"data-parallel group is {list(dp)}: its gradient is averaged over its own group only, so data "
                "parallelism over another would mix shards. Shard it over layout.dp (swap_embeddings(model, layout.dp))"
            )
