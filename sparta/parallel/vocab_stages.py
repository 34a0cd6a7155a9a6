"""Vocabulary parallelism over the pipeline ranks: the output head as ``pp`` extra stages
at the end of the pipeline and, optionally, the input embedding as ``pp`` at its start.

Why: the output head costs ``2 x tokens x d_model x vocab`` FLOPs forward (twice that
backward) and holds ``vocab x d_model`` weights plus ``tokens x vocab`` logits, all on the
last stage. At a 256k vocabulary that stage is the pipeline's bottleneck in time and memory
(Vocabulary Parallelism, arXiv 2411.05288: 5-51 % more throughput, lower peak memory, by
splitting the vocabulary layers evenly over all pipeline ranks).

How, with torch's own schedules (they take no new kinds of pass): the head is cut by
vocabulary into ``pp`` shards, and shard ``k`` becomes global stage ``S - pp + k`` of a
pipeline of ``S = pp x stages_per_rank`` stages, so that every pipeline rank holds exactly one
shard (the last "round" of a looped schedule, the second arm of a V). The model's layers
fill the first ``S - pp`` stages. Each shard stage computes its slice of the logits and
folds it into the running softmax statistics of every token, the online-softmax recurrence:

    m' = max(m, max_j l_j)          (held constant for autograd: the loss does not depend on it)
    s' = s * exp(m - m') + sum_j exp(l_j - m')
    z' = z + l_target   where the target falls in this shard, else z

and hands ``[h, m', s', z']`` ([b, T, d_model + 3], float32) to the next shard; the last
returns each token's loss ``m + log s - z`` ([b, T]), which `token_loss` averages over the
non-padding tokens. This equals ``cross_entropy`` on the whole logits, and autograd carries
every shard's gradient back through ``h``, so the schedule's backward needs nothing new.
The final norm (the children between ``layers`` and the head) runs on shard 0.

Targets: torch hands them to the last stage's loss only, and every shard needs them (to pick
its target logits). ``ParallelModel`` gives each shard the step's targets, cut into
micro-batches (`HeadStage.feed`), which its forwards take in order: every torch schedule runs
a stage's forwards in micro-batch order, plus one shape-inference forward at a schedule's
first step (`feed(..., inference=True)` puts micro-batch 0 first for it). A count that does
not match raises rather than pairing a micro-batch with another's targets.

Tensor parallelism: where the tp head would be split (``vocab_parallel_head``), each stage's
rows are cut over the tp ranks too; the ranks hold ``h`` alike, so the statistics are summed
over tp forward (its maximum gathered) and ``h``'s gradient backward (Megatron's g and f).

Cost: ``pp`` more stage hops of ``[b, T, d_model + 3]`` float32 per micro-batch (the paper
broadcasts ``h`` to every rank instead), and the schedule's bubble grows by the shards'
stages, which are each 1/pp of the head.

The input embedding (``embedding_stages``) the same way, at the front: embedding stage ``k``
(global stage ``k``, on pipeline rank ``k``) holds rows ``k`` of the token embedding, adds
the rows of the ids in its range to the running sum and hands ``[sum, ids]`` ([b, T,
d_model + 1] float32, the ids exact below 2^24) on. The first layers' stage keeps the
model's own embedding code (position embeddings, scaling, dropout) with its token embedding
replaced by `TakenRows`, which takes the sum instead of looking ids up. This balances the
table's memory (rows, gradients, optimizer state); its compute is small either way. Under
tp the rows split over tp as well, their lookups summed over tp.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from sparta.comm import Communicator, all_reduce_backward, all_reduce_forward
from sparta.errors import ConfigError, InputError
from sparta.scheduling.varlen import IGNORE_INDEX

from .pipeline import ModelParts

STATS = 3  # m, s, z per token


class VocabShard(nn.Module):
    """Rows ``start .. start + rows`` of an output head or a token embedding ``[vocab_size,
    d_model]`` (no bias). ``forward(h [..., d_model]) -> logits [..., rows]`` in the weight's
    dtype. Its checkpoint key is the whole table's (``<name>.weight``, this shard a chunk at
    row ``start``), so a plain ``nn.Linear`` / ``nn.Embedding`` of one process loads it.
    ``split_over_tp``: the stage's rows are cut further over the tp ranks (each holds others)."""

    def __init__(self, weight: Tensor, start: int, vocab_size: int, split_over_tp: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.start, self.vocab_size, self.split_over_tp = start, vocab_size, split_over_tp

    def forward(self, h: Tensor) -> Tensor:
        return nn.functional.linear(h.to(self.weight.dtype), self.weight)


class HeadStage(nn.Module):
    """Pipeline stage ``shard`` of ``shards``: the head's vocabulary rows of this shard (under
    the head's own name, e.g. ``output``), and on shard 0 the model's final norm (under its
    own names). Takes ``h [b, T, d_model]`` (shard 0) or ``[b, T, d_model + 3]``; returns
    ``[b, T, d_model + 3]`` float32, or per-token losses ``[b, T]`` on the last shard."""

    def __init__(
        self,
        pre: dict[str, nn.Module],
        head_name: str,
        head: VocabShard,
        shard: int,
        shards: int,
        tp: Communicator | None = None,
    ) -> None:
        super().__init__()
        for name, module in pre.items():
            self.add_module(name, module)
        self.add_module(head_name, head)
        self.pre, self.head_name = tuple(pre), head_name
        self.shard, self.shards, self.tp = shard, shards, tp
        self._targets: deque[Tensor] = deque()

    @property
    def head(self) -> VocabShard:
        """This stage's rows of the output head."""
        module = self.get_submodule(self.head_name)
        assert isinstance(module, VocabShard)
        return module

    def feed(self, targets: Sequence[Tensor], inference: bool = False) -> None:
        """The targets [b, T] of the coming forwards, one per micro-batch in order;
        ``inference``: the stage's first step, whose shape inference runs one more forward
        on micro-batch 0 first. Raises if targets of an earlier step were left over."""
        if self._targets:
            raise InputError(
                f"pipeline head stage {self.shard}: {len(self._targets)} micro-batches of targets were fed but never "
                "run; a step or evaluation stopped half-way, or ran fewer forwards than micro-batches"
            )
        self._targets.extend([targets[0]] if inference else [])
        self._targets.extend(targets)

    def drop_pending(self) -> None:
        """Forget the targets a step or evaluation that stopped half-way left."""
        self._targets.clear()

    @property
    def pending(self) -> int:
        """Targets fed and not yet taken by a forward (0 after a whole step)."""
        return len(self._targets)

    def forward(self, x: Tensor) -> Tensor:
        if not self._targets:
            raise InputError(
                f"pipeline head stage {self.shard} ran a forward without targets: ParallelModel.step and evaluate "
                "feed them; run the pipeline through those"
            )
        targets = self._targets.popleft()
        if self.shard == 0:
            h = x
            for name in self.pre:
                h = self.get_submodule(name)(h)
            h = h.float()
        else:
            h, (m, s, z) = x[..., :-STATS], x[..., -STATS:].unbind(-1)
        # split over tp: every tp rank holds h alike and its own rows, so h's gradient is the
        # sum of the ranks' (Megatron's f), and the statistics the sum of theirs (its g)
        logits = self.head(h if self.tp is None else all_reduce_backward(h, self.tp)).float()
        local = targets.to(logits.device) - self.head.start
        mine = (local >= 0) & (local < logits.shape[-1])
        picked = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        picked = torch.where(mine, picked, 0.0)
        top = logits.detach().amax(-1)
        if self.tp is not None:
            # the tp ranks hold the same tokens (replicated activations): only the maxima move
            sizes = [top.shape[0]] * self.tp.size
            top = torch.stack(self.tp.all_gather(top.contiguous(), sizes=sizes, check=False)).amax(0)  # type: ignore[arg-type]
        if self.shard > 0:
            top = torch.maximum(m.detach(), top)
        partial = torch.stack([(logits - top.unsqueeze(-1)).exp().sum(-1), picked], dim=-1)
        if self.tp is not None:
            partial = all_reduce_forward(partial, self.tp)
        if self.shard == 0:
            m, s, z = top, partial[..., 0], partial[..., 1]
        else:
            s = s * (m.detach() - top).exp() + partial[..., 0]
            m, z = top, z + partial[..., 1]
        if self.shard == self.shards - 1:
            return m + s.log() - z
        return torch.cat([h, torch.stack([m, s, z], dim=-1)], dim=-1)


class EmbeddingStage(nn.Module):
    """Pipeline stage ``shard`` of ``shards`` of the input embedding: its vocabulary rows
    (under the embedding's own name, e.g. ``tok_emb``). Takes ids [b, T] (shard 0) or
    ``[b, T, d_model + 1]``; returns ``[b, T, d_model + 1]`` float32 (running sum, ids)."""

    def __init__(
        self,
        name: str,
        rows: VocabShard,
        shard: int,
        shards: int,
        padding_idx: int | None = None,
        tp: Communicator | None = None,
    ) -> None:
        super().__init__()
        self.add_module(name, rows)
        self.name, self.shard, self.shards, self.tp = name, shard, shards, tp
        # the table's padding row, where this shard holds it: its gradient stays zero
        local = None if padding_idx is None else padding_idx - rows.start
        self.padding_idx = local if local is not None and 0 <= local < rows.weight.shape[0] else None

    def forward(self, x: Tensor) -> Tensor:
        rows = self.get_submodule(self.name)
        assert isinstance(rows, VocabShard)
        if self.shard == 0:
            ids, total = x, None
        else:
            ids, total = x[..., -1].long(), x[..., :-1]
        local = ids - rows.start
        mine = (local >= 0) & (local < rows.weight.shape[0])
        found = nn.functional.embedding(local.clamp(0, rows.weight.shape[0] - 1), rows.weight, self.padding_idx)
        found = found.float() * mine.unsqueeze(-1)
        if self.tp is not None:  # each tp rank looked up its own rows: their sum, used alike
            found = all_reduce_forward(found, self.tp)
        total = found if total is None else total + found
        return torch.cat([total, ids.unsqueeze(-1).float()], dim=-1)


class TakenRows(nn.Module):
    """The token embedding of the first layers' stage under ``embedding_stages``: takes the
    embedding stages' ``[b, T, d_model + 1]`` and returns the summed rows [b, T, d_model] in
    ``dtype`` (the table's), as the table's lookup would. ``takes_vectors`` tells the model's
    forward that its input is this, not ids."""

    takes_vectors = True

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: Tensor) -> Tensor:
        return x[..., :-1].to(self.dtype)


def token_loss(losses: Tensor, targets: Tensor) -> Tensor:
    """The mean of the last head stage's per-token ``losses`` [b, T] over the tokens whose
    target is not padding: what ``cross_entropy(..., ignore_index=IGNORE_INDEX)`` returns."""
    keep = targets.to(losses.device) != IGNORE_INDEX
    return torch.where(keep, losses, 0.0).sum() / keep.sum()


def check_head(model: nn.Module, parts: ModelParts) -> str:
    """The name of ``model``'s output head (the last child after ``layers``), checked to be an
    untied ``nn.Linear`` without bias; ConfigError otherwise. Pure."""
    if not parts.last:
        raise ConfigError(
            f"{type(model).__name__} has no children after `layers`: vocab_stages splits the output head, which "
            "must be the last child registered (an nn.Linear to the vocabulary)"
        )
    name = parts.last[-1]
    head = model.get_submodule(name)
    # the exact class: a subclass's own forward (a scale, a cap) would not run in the head stages
    if type(head) is not nn.Linear or head.bias is not None:
        raise ConfigError(
            f"vocab_stages splits the output head {name!r} by vocabulary rows; it must be a plain nn.Linear without "
            f"bias, not {type(head).__name__}{' with a bias' if type(head) is nn.Linear else ''}"
        )
    tied = [n for n, p in model.named_parameters(remove_duplicate=False) if p is head.weight and not n.startswith(name)]
    if tied:
        raise ConfigError(
            f"the output head {name!r} shares its weight with {tied[0]}: its vocabulary rows cannot move to other "
            "pipeline ranks while the tie holds; untie it (sparta.parallel.hf adapters: untie=True)"
        )
    return name


EXACT_IDS = 2**24  # float32's integers are exact up to here


def check_embedding(model: nn.Module, parts: ModelParts) -> str:
    """The name of ``model``'s token embedding (the first child before ``layers``), checked to
    be a plain ``nn.Embedding`` (no max_norm, scale_grad_by_freq or sparse gradients, which
    depend on the whole batch's ids); ConfigError otherwise. Pure."""
    name = parts.first[0] if parts.first else None
    table = model.get_submodule(name) if name else None
    if type(table) is not nn.Embedding:  # as the head: a subclass's forward would not run
        raise ConfigError(
            f"embedding_stages splits the token embedding by vocabulary rows; {type(model).__name__}'s first child "
            f"before `layers` must be a plain nn.Embedding, not {type(table).__name__}"
        )
    extras = {"max_norm": table.max_norm is not None, "scale_grad_by_freq": table.scale_grad_by_freq,
              "sparse": table.sparse}  # fmt: skip
    if any(extras.values()):
        raise ConfigError(
            f"embedding_stages splits {name!r} by vocabulary rows, which its {[k for k, v in extras.items() if v]} "
            "cannot follow (each depends on the whole batch's ids): build the table without them"
        )
    if table.num_embeddings > EXACT_IDS:  # the ids travel between the stages as float32
        raise ConfigError(
            f"embedding_stages hands the ids on as float32, exact up to {EXACT_IDS:,}, but {name!r} has "
            f"{table.num_embeddings:,} rows: turn embedding_stages off for this vocabulary"
        )
    assert name is not None
    return name


def shard_rows(vocab_size: int, shards: int) -> list[tuple[int, int]]:
    """The vocabulary rows ``(start, stop)`` of each shard, as even as integers allow."""
    if vocab_size < shards:
        raise ConfigError(
            f"{vocab_size} vocabulary rows cannot be split into {shards} parts (one per pipeline rank, and per tp "
            "rank where the stages split over tp): lower pp or tp"
        )
    base, extra = divmod(vocab_size, shards)
    bounds = [0]
    for k in range(shards):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return list(zip(bounds, bounds[1:], strict=False))


def _rows(weight: Tensor, shard: int, shards: int, tp: Communicator | None) -> VocabShard:
    """Stage ``shard``'s rows of ``weight`` [vocab, d], cut further over ``tp`` (this rank's)."""
    start, stop = shard_rows(weight.shape[0], shards)[shard]
    if tp is not None:
        a, b = shard_rows(stop - start, tp.size)[tp.rank]
        start, stop = start + a, start + b
    return VocabShard(weight[start:stop], start, weight.shape[0], split_over_tp=tp is not None)


def embedding_stage(
    model: nn.Module, parts: ModelParts, shard: int, shards: int, tp: Communicator | None = None
) -> EmbeddingStage:
    """Embedding stage ``shard`` of ``shards`` cut from ``model`` (copies: the model is
    untouched); its rows cut further over ``tp`` where given."""
    name = check_embedding(model, parts)
    table = model.get_submodule(name)
    assert isinstance(table, nn.Embedding)
    return EmbeddingStage(name, _rows(table.weight, shard, shards, tp), shard, shards, table.padding_idx, tp)


def head_stage(
    model: nn.Module, parts: ModelParts, shard: int, shards: int, tp: Communicator | None = None
) -> HeadStage:
    """Head stage ``shard`` of ``shards`` cut from ``model`` (copies: the model is untouched);
    its rows cut further over ``tp`` where given."""
    name = check_head(model, parts)
    head = model.get_submodule(name)
    assert isinstance(head, nn.Linear)
    pre = {n: copy.deepcopy(model.get_submodule(n)) for n in parts.last[:-1]} if shard == 0 else {}
    return HeadStage(pre, name, _rows(head.weight, shard, shards, tp), shard, shards, tp)
