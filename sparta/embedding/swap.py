"""The layer swap: every `nn.Embedding` of a model becomes a `SparseEmbedding` sharded over a
Communicator (and, with `tie_output=True`, a tied output projection a VocabParallelHead).

    layout = sparta.parallel.build_layout(sparta.parallel.ParallelDims(dp=world.size), world)
    swap_embeddings(model, layout.dp)                 # collective: every rank, the same model

Data parallelism for the rest of the model (and the shards' scaling under micro-batches) is
`sparta.parallel.DataParallel`'s; `sharded_parameter_names` tells other wrappers which
parameters are shards that must not be all-reduced.
"""

from __future__ import annotations

import torch
from torch import nn

from sparta.comm import Communicator
from sparta.embedding.layer import SparseEmbedding
from sparta.embedding.vocab_parallel import VocabParallelHead
from sparta.errors import ConfigError


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
