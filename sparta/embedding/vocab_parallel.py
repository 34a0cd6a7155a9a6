"""Vocabulary-parallel output layer and cross-entropy: rank r holds the rows of the output
projection for its vocabulary range and computes only those logits; the softmax statistics
(max and sum of exponentials per token) are combined across ranks, so no rank ever holds a
`[tokens, vocab]` logits tensor.

Two uses:
  * tokens replicated over `comm` (a tensor-parallel group): each rank's logits are
    `[tokens, vocab / world]`, 1/world of the full logits;
  * data parallel (`gather_tokens=True`): each rank's own tokens are gathered first, so the
    logits are `[all ranks' tokens, vocab / world]` (as many numbers as one rank's full
    logits) while the projection and its optimizer state shrink to vocab / world rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sparta.comm import Communicator
from sparta.embedding.checks import gather_with_verdict, inspect_ids
from sparta.embedding.layer import SparseEmbedding
from sparta.embedding.layout import ShardLayout
from sparta.errors import ConfigError, InputError


class _VocabParallelCE(torch.autograd.Function):
    """logits [T, V_r] (this rank's vocabulary columns), targets [T] -> losses [T] (float32;
    float64 for float64 logits).

    The softmax statistics are at least float32 whatever the logits' dtype: a half-precision sum of
    exponentials over a large vocabulary overflows (fp16: an infinite loss at 131,072 words)
    or rounds each rank's share before the ranks add them (bf16)."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, start: int, comm: Communicator, sum_grads: bool,
        agreed: bool,
    ) -> torch.Tensor:  # fmt: skip
        # agreed: T is the same on every rank, checked by the caller; else each collective checks it
        check, sizes = (False, [logits.shape[0]] * comm.size) if agreed else (None, None)
        ctx.dtype = logits.dtype
        logits = logits.detach().to(torch.promote_types(logits.dtype, torch.float32))
        local_max = logits.max(dim=1).values
        # the Communicator reduces by sum only: gather the [world, T] maxima and take the max
        top = torch.stack(comm.all_gather(local_max, sizes=sizes, check=check)).max(dim=0).values  # type: ignore[arg-type]
        exp = (logits - top.unsqueeze(1)).exp()
        local = targets - start
        mine = (local >= 0) & (local < logits.shape[1])
        safe = local.clamp(0, logits.shape[1] - 1)
        target_logit = torch.where(mine, logits.gather(1, safe.unsqueeze(1)).squeeze(1) - top, 0.0)
        stats = comm.all_reduce(torch.stack([exp.sum(dim=1), target_logit], dim=1), check=check)
        assert isinstance(stats, torch.Tensor)
        sum_exp, target_logit = stats.unbind(1)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(1)), safe, mine)
        ctx.comm, ctx.sum_grads, ctx.check = comm, sum_grads, check
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        softmax, safe, mine = ctx.saved_tensors
        grad = grad.to(softmax.dtype)
        if ctx.sum_grads:  # each rank's loss covers its own tokens: every rank needs all of them
            grad = ctx.comm.all_reduce(grad.contiguous(), check=ctx.check)
        out = softmax * grad.unsqueeze(1)
        out.scatter_add_(1, safe.unsqueeze(1), -(grad * mine).unsqueeze(1))
        return out.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, comm: Communicator, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token cross-entropy over a vocabulary split by columns across `comm`.

    logits: [T, V_r], this rank's columns `vocab_start .. vocab_start + V_r` of the full
    `[T, vocab]` logits; targets: [T] full-vocabulary ids, the same T tokens on every rank.
    Returns [T] losses (float32, float64 for float64 logits), equal to `F.cross_entropy(full_logits, targets,
    reduction="none", ignore_index=ignore_index)` on every rank: 0 where a target is
    ``ignore_index`` (padding), with no gradient there. The gradient reaches each rank's
    slice of the logits. Two small collectives forward (an all-gather of [T] maxima, an
    all-reduce of [T, 2]), none back.
    """
    return _masked_losses(logits, targets.long(), int(vocab_start), comm, False, False, ignore_index)[0]


def _masked_losses(
    logits: torch.Tensor, targets: torch.Tensor, start: int, comm: Communicator, sum_grads: bool, agreed: bool,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(losses [T], 0 where a target is ``ignore_index``, with no gradient there; the targets kept [T])."""
    kept = targets != ignore_index
    losses = _VocabParallelCE.apply(logits, torch.where(kept, targets, 0), start, comm, sum_grads, agreed)
    return losses * kept, kept


class _GatherTokens(torch.autograd.Function):
    """x [T_me, d] -> every rank's tokens [sum(counts), d]; backward sums each rank's block."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: list[int], comm: Communicator) -> torch.Tensor:
        ctx.counts, ctx.comm = counts, comm
        # counts are agreed already (gather_with_verdict): only the rows move
        return torch.cat(comm.all_gather(x.contiguous(), sizes=counts, check=False))  # type: ignore[arg-type]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        comm, mine = ctx.comm, ctx.counts[ctx.comm.rank]
        parts = comm.all_to_all(grad.contiguous(), ctx.counts, [mine] * comm.size, check=False)
        return parts.view(comm.size, mine, -1).sum(0), None, None  # type: ignore[union-attr]


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class VocabParallelHead(nn.Module):
    """`nn.Linear(in_features, num_embeddings, bias=False)` + cross-entropy, vocabulary-sharded.

    `head(hidden, targets)` with hidden [*, in_features] and targets [*] (this rank's
    tokens) returns the mean cross-entropy over this rank's tokens, equal to
    `F.cross_entropy(hidden @ W.T, targets)` with the full W. The shard's gradient is
    averaged over ranks (DDP's convention).

    Targets are checked on every rank together (ids in 0..num_embeddings-1, integer dtype,
    hidden's shape): a bad one on any rank raises the same InputError on every rank before
    any logits are computed or exchanged.

    tie: a row-sharded SparseEmbedding over the same `comm` whose table is the projection
        (weight tying); otherwise the head owns a shard initialised like nn.Linear.
    gather_tokens: True when each rank has its own tokens (data parallel); False when the
        tokens are the same on every rank of `comm` (tensor parallel), which skips the
        gather and keeps the loss's gradient as is.
    ignore_index: a target of this value (padding) adds no loss and no gradient, and the
        mean is over the other tokens, as `F.cross_entropy`'s. A rank whose targets are all
        ignored returns 0 with a zero gradient: `F.cross_entropy`'s NaN there would reach every
        rank's weights through the gradients' sums.
    """

    def __init__(
        self,
        in_features: int,
        num_embeddings: int,
        comm: Communicator,
        tie: SparseEmbedding | None = None,
        gather_tokens: bool = True,
        ignore_index: int = -100,
    ) -> None:
        super().__init__()
        self.comm, self.gather_tokens, self.ignore_index = comm, gather_tokens, ignore_index
        if tie is not None:
            if tie.sharding != "row" or tie.comm is not comm or tie.weight.shape[1] != in_features:
                raise ConfigError(
                    f"tie={tie.table_name} must be row-sharded over the same comm with dim {in_features} "
                    f"(it is {tie.sharding}-sharded with dim {tie.embedding_dim}); build it with sharding='row'"
                )
            self.layout = tie.layout
            self.tied = tie
        else:
            self.layout = ShardLayout(num_embeddings, in_features, "row", comm.size, comm.rank)
            bound = in_features**-0.5  # nn.Linear's default init range
            self.weight = nn.Parameter(torch.empty(self.layout.shard_shape).uniform_(-bound, bound))

    def shard(self) -> torch.Tensor:
        """This rank's `[rows of its vocabulary range, in_features]` projection."""
        return self.tied.weight if hasattr(self, "tied") else self.weight

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """hidden [*, d], targets [*] -> scalar mean loss over this rank's tokens."""
        x = hidden.reshape(-1, hidden.shape[-1])
        name = f"VocabParallelHead({x.shape[-1]}, {self.layout.num_embeddings}) targets"
        ids = torch.where(targets == self.ignore_index, 0, targets) if isinstance(targets, torch.Tensor) else targets
        error = inspect_ids(ids, self.layout.num_embeddings, name)
        if error is None and hidden.shape[:-1] != targets.shape:
            error = InputError(
                f"{name} got hidden states of {hidden.shape[:-1].numel()} tokens but {targets.numel()} targets; "
                "targets must have hidden's shape without its last dim"
            )
        counts = gather_with_verdict(self.comm, 0 if error is not None else x.shape[0], error, name)
        if not self.gather_tokens and len(set(counts)) > 1:  # counts are every rank's: all raise alike
            raise InputError(
                f"{name}: gather_tokens=False takes the same tokens on every rank, but the ranks hold {counts}; "
                "pass gather_tokens=True where each rank has its own tokens"
            )
        t = targets.reshape(-1)
        weight = self.shard()
        if self.gather_tokens:
            x = _GatherTokens.apply(x, counts, self.comm)
            t = torch.cat(self.comm.all_gather(t.long().contiguous(), sizes=counts, check=False))  # type: ignore[arg-type]
            weight = _ScaleGrad.apply(weight, 1.0 / self.comm.size)
        start = self.layout.row_range(self.comm.rank)[0]
        # the token counts are agreed (gather_with_verdict): the loss's collectives move data only
        logits = x @ weight.t()
        losses, kept = _masked_losses(logits, t.long(), start, self.comm, self.gather_tokens, True, self.ignore_index)
        if self.gather_tokens:
            first = sum(counts[: self.comm.rank])
            losses = losses[first : first + counts[self.comm.rank]]
            kept = kept[first : first + counts[self.comm.rank]]
        return losses.sum() / kept.sum().clamp(min=1)
