"""Hybrid data parallelism in three lines: sharded embeddings move rows by all-to-all, the
dense rest of the model is all-reduced by torch DDP, Horovod, or sparta.comm's PriorityQueue.

    world = sparta.init()
    model, opt = parallelize(model, world.comm, lambda ps: torch.optim.Adam(ps, lr=1e-3))
    loss = model(batch); loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from sparta.comm import Communicator
from sparta.comm.priority import QueueConfig
from sparta.embedding.layer import SparseEmbedding
from sparta.embedding.optim import HybridOptimizer
from sparta.embedding.queued import QueuedGradients
from sparta.errors import ConfigError

DATA_PARALLEL = ("auto", "ddp", "horovod", "sparta")
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def swap_embeddings(model: nn.Module, comm: Communicator, sharding: str = "row") -> list[str]:
    """Replace every `nn.Embedding` of `model` by a SparseEmbedding over `comm`, in place.

    The tables start from rank 0's values (one broadcast per table), as DDP starts every
    replica from rank 0's. Each keeps its padding row and `requires_grad`, and takes its
    module path as its name in error messages. Returns the swapped modules' paths.
    Collective: every rank of `comm` calls it on the same model.
    """
    swapped = []
    for path, module in list(model.named_modules()):
        if type(module) is not nn.Embedding:
            continue
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise ConfigError(
                f"{path}: nn.Embedding with max_norm, scale_grad_by_freq or sparse=True has no sharded "
                "equivalent; build it without those options"
            )
        table = comm.broadcast(module.weight.detach().contiguous(), src=0)
        assert isinstance(table, torch.Tensor)
        emb = SparseEmbedding.from_pretrained(
            table, not module.weight.requires_grad, module.padding_idx, sharding, comm, name=path
        )
        parent_path, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent_path), attr, emb)
        swapped.append(path)
    return swapped


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
    **ddp_kwargs: Any,
) -> tuple[nn.Module, HybridOptimizer]:
    """Swap `model`'s embeddings for SparseEmbeddings and data-parallelise the rest.

    data_parallel: "ddp" wraps the model in DistributedDataParallel over the torch engine's
        process group, with the shards excluded from its buckets; "horovod" wraps the dense
        parameters' optimizer in `hvd.DistributedOptimizer` (the shards get their own);
        "sparta" averages dense gradients through sparta.comm's PriorityQueue on any engine
        (keyed by parameter order, chunked by `queue_config`); "auto" picks DDP on the torch
        engine, Horovod on the Horovod engine, "sparta" on MPI.
    make_optimizer: builds a torch optimizer from parameters (called once or twice).
    Returns (model to call, optimizer to step). Gradients follow DDP's convention: averaged
    over ranks, so training matches one process on the global batch.
    """
    mode = _resolve(data_parallel, comm)
    swap_embeddings(model, comm, sharding)
    sharded = set(sharded_parameter_names(model))
    named = list(model.named_parameters())
    shards = [p for n, p in named if n in sharded]
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
        queued = QueuedGradients(model, dense, comm, queue_config)
        return model, HybridOptimizer({"all": make_optimizer([p for _, p in named])}, queued.synchronize)
    import horovod.torch as hvd

    dense_opt = hvd.DistributedOptimizer(
        make_optimizer([p for _, p in dense]),
        named_parameters=dense,
        process_set=comm.process_set,  # type: ignore[attr-defined]
    )
    return model, HybridOptimizer({"sparse": make_optimizer(shards), "dense": dense_opt})


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
