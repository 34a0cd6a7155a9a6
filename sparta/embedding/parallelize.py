"""Hybrid data parallelism in three lines: sharded embeddings move rows by all-to-all, the
dense rest of the model is all-reduced by torch DDP, Horovod, or sparta.comm's PriorityQueue.

    world = sparta.init()
    model, opt = parallelize(model, world.comm, lambda ps: torch.optim.Adam(ps, lr=1e-3))
    loss = model(batch); loss.backward(); opt.step(); opt.zero_grad()

With `tie_output=True` an output projection that shares its weight with an embedding
(`head.weight = tok.weight`) becomes a VocabParallelHead tied to the swapped table; the
model then calls it as `loss = head(hidden, targets)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from sparta.comm import Communicator
from sparta.comm.priority import QueueConfig
from sparta.embedding.deferred import DeferredDenseStep
from sparta.embedding.layer import SparseEmbedding
from sparta.embedding.optim import HybridOptimizer
from sparta.embedding.queued import QueuedGradients
from sparta.embedding.vocab_parallel import VocabParallelHead
from sparta.errors import ConfigError

DATA_PARALLEL = ("auto", "ddp", "horovod", "sparta")
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def swap_embeddings(model: nn.Module, comm: Communicator, sharding: str = "row", tie_output: bool = False) -> list[str]:
    """Replace every `nn.Embedding` of `model` by a SparseEmbedding over `comm`, in place.

    The tables start from rank 0's values (one broadcast per table), as DDP starts every
    replica from rank 0's. Each keeps its padding row and `requires_grad`, and takes its
    module path as its name in error messages. Returns the swapped modules' paths.
    tie_output: replace each bias-free `nn.Linear` whose weight is an embedding's weight by
        a VocabParallelHead tied to the swapped table (called as `head(hidden, targets)`);
        without it such a tie is an error, since swapping would silently untie it.
    Collective: every rank of `comm` calls it on the same model.
    """
    ties = _tied_outputs(model, tie_output, sharding)
    swapped, tables = [], {}
    for path, module in list(model.named_modules()):
        if type(module) is not nn.Embedding:
            continue
        if module.max_norm is not None or module.scale_grad_by_freq:
            raise ConfigError(
                f"{path}: nn.Embedding with max_norm or scale_grad_by_freq has no sharded "
                "equivalent; build it without those options"
            )
        table = comm.broadcast(module.weight.detach().contiguous(), src=0)
        assert isinstance(table, torch.Tensor)
        emb = SparseEmbedding.from_pretrained(
            table, not module.weight.requires_grad, module.padding_idx, sharding, comm, name=path, sparse=module.sparse
        )
        _replace(model, path, emb)
        swapped.append(path)
        tables[path] = emb
    for head_path, (emb_path, linear) in ties.items():
        _replace(
            model, head_path, VocabParallelHead(linear.in_features, linear.out_features, comm, tie=tables[emb_path])
        )
    return swapped


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_path), attr, module)


def _tied_outputs(model: nn.Module, tie_output: bool, sharding: str) -> dict[str, tuple[str, nn.Linear]]:
    """{linear path: (embedding path, linear)} for the output projections sharing a table's weight.

    Checked before anything is swapped or sent, on every rank alike (the model is the same).
    """
    tables = {id(m.weight): path for path, m in model.named_modules() if type(m) is nn.Embedding}
    ties = {
        path: (tables[id(m.weight)], m)
        for path, m in model.named_modules()
        if isinstance(m, nn.Linear) and id(m.weight) in tables
    }
    if ties and not tie_output:
        raise ConfigError(
            f"{sorted(ties)} share their weight with {sorted(e for e, _ in ties.values())}; swapping the table would "
            "untie them: pass tie_output=True (the projection becomes a VocabParallelHead) or untie them"
        )
    if tie_output and not ties:
        raise ConfigError(
            "tie_output=True but no nn.Linear shares its weight with an nn.Embedding; tie them first "
            "(head.weight = emb.weight) or pass tie_output=False"
        )
    for path, (_, linear) in ties.items():
        if linear.bias is not None or sharding != "row":
            raise ConfigError(
                f"{path}: a tied output projection becomes a VocabParallelHead, which needs bias=False and "
                f"sharding='row' (got bias={linear.bias is not None}, sharding={sharding!r}); build it so"
            )
    return ties


def sharded_parameter_names(model: nn.Module) -> list[str]:
    """Names (as in `model.named_parameters()`) of the SparseEmbedding shards."""
    return [
        f"{path}.{name}" if path else name
        for path, module in model.named_modules()
        if isinstance(module, SparseEmbedding)
        for name, _ in module.named_parameters(recurse=False)
    ]


def parallelize(
    model: nn.Module,
    comm: Communicator,
    make_optimizer: OptimizerFactory,
    data_parallel: str = "auto",
    sharding: str = "row",
    queue_config: QueueConfig | None = None,
    tie_output: bool = False,
    defer_dense_step: bool = False,
    **ddp_kwargs: Any,
) -> tuple[nn.Module, HybridOptimizer]:
    """Swap `model`'s embeddings for SparseEmbeddings and data-parallelise the rest.

    data_parallel: "ddp" wraps the model in DistributedDataParallel over the torch engine's
        process group, with the shards excluded from its buckets; "horovod" wraps the dense
        parameters' optimizer in `hvd.DistributedOptimizer` (the shards get their own);
        "sparta" sends every gradient through sparta.comm's PriorityQueue on any engine
        (dense all-reduces and the tables' all-to-alls overlapping backward, see queued.py;
        chunked and scheduled by `queue_config`); "auto" picks DDP on the torch engine,
        Horovod on the Horovod engine, "sparta" on MPI.
    tie_output: turn an output projection tied to an embedding into a VocabParallelHead
        tied to the swapped table (see swap_embeddings).
    defer_dense_step: with data_parallel="sparta", `opt.step()` steps the tables and returns;
        each dense module steps just before the next forward calls it, so that forward's
        lookups overlap the dense all-reduces still in flight. Same numerics; off by default
        because code reading dense weights between `opt.step()` and the next forward (an
        EMA of the weights) must call `opt.flush()` first (see deferred.py).
    make_optimizer: builds a torch optimizer from parameters (called once or twice).
    Returns (model to call, optimizer to step). Gradients follow DDP's convention: averaged
    over ranks, so training matches one process on the global batch.
    """
    mode = _resolve(data_parallel, comm)
    if defer_dense_step and mode != "sparta":
        raise ConfigError(
            f"defer_dense_step=True needs data_parallel='sparta' (the PriorityQueue's all-reduces), but "
            f"data_parallel={data_parallel!r} runs {mode!r} on this engine; pass data_parallel='sparta'"
        )
    swap_embeddings(model, comm, sharding, tie_output)
    sharded = set(sharded_parameter_names(model))
    named = list(model.named_parameters())
    shards = [p for n, p in named if n in sharded and p.requires_grad]
    dense = [(n, p) for n, p in named if n not in sharded]
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        DDP._set_params_and_buffers_to_ignore_for_model(model, sorted(sharded))
        wrapped = DDP(model, process_group=comm.pg, **ddp_kwargs)  # type: ignore[attr-defined]
        return wrapped, HybridOptimizer({"all": make_optimizer([p for _, p in named])})
    with torch.no_grad():  # every replica starts from rank 0's dense weights
        for _, p in dense:
            p.copy_(comm.broadcast(p.detach().contiguous(), src=0))  # type: ignore[arg-type]
    if mode == "sparta":
        queued = QueuedGradients(model, comm, queue_config)
        parts = {"sparse": shards, "dense": [p for _, p in dense]}
        opts = {k: make_optimizer(ps) for k, ps in parts.items() if ps}
        if defer_dense_step and "dense" in opts:
            deferred = DeferredDenseStep(model, opts["dense"], queued)
            return model, HybridOptimizer(opts, {"sparse": queued.finish_tables}, deferred)
        return model, HybridOptimizer(opts, {"sparse": queued.finish_tables, "dense": queued.finish_dense})
    import horovod.torch as hvd

    dense_opt = hvd.DistributedOptimizer(
        make_optimizer([p for _, p in dense]),
        named_parameters=dense,
        process_set=comm.process_set,  # type: ignore[attr-defined]
    )
    return model, HybridOptimizer({**({"sparse": make_optimizer(shards)} if shards else {}), "dense": dense_opt})


def _resolve(data_parallel: str, comm: Communicator) -> str:
    if data_parallel not in DATA_PARALLEL:
        raise ConfigError(f"data_parallel={data_parallel!r} is unknown; use one of {DATA_PARALLEL}")
    needs = {"ddp": "torch", "horovod": "horovod"}
    auto = {"torch": "ddp", "horovod": "horovod"}.get(comm.backend, "sparta")
    mode = auto if data_parallel == "auto" else data_parallel
    if mode in needs and needs[mode] != comm.backend:
        raise ConfigError(
            f"data_parallel={data_parallel!r} cannot run over a {comm.backend!r} communicator: DDP needs "
            "sparta.init(backend='torch') (torchrun), Horovod needs backend='horovod' (horovodrun); "
            "data_parallel='sparta' runs on every engine"
        )
    return mode
