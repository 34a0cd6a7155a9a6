"""Documents at their own lengths for `sparta train` (``data.samples = "documents"``), grouped
into pipeline steps by DynaPipe's dynamic programme (`sparta.scheduling.bucketed_steps`).

The windows of `TokenBatches` cross document boundaries (a window may begin in one file and
end in the next, attending across) and never pad. Here each sample is one document, or a piece
of one:

- **Documents** end at token 0: the stdlib BPE's end-of-text (`data.END_OF_TEXT_ID`), which
  closes every file; in random tokens, one token in ``vocab_size``. A document is cut into
  pieces of at most ``seq_len + 1`` tokens (inputs plus shifted targets), consecutive pieces
  sharing one token so that every next-token pair is trained once; a one-token piece has no
  target and is dropped. Every 10th piece validates.
- **Steps.** Pool ``p`` (0, 1, ...) is ``global_batch`` training pieces drawn by a generator
  seeded by ``(seed, p)``. `bucketed_steps` cuts it, sorted by length, into steps: each one
  `ParallelModel.step` call of ``microbatches`` micro-batches of one shape, padded to the
  smallest of ``parallel.lengths`` that holds its longest piece, at most ``max_tokens =
  global_batch / (dp * microbatches) * L`` tokens a micro-batch (the windows' size, padded:
  L is the smallest length that holds ``seq_len``),
  minimising the predicted time over the ``pp`` stages on the model's FLOPs
  (`LengthCost.of_flops`). The pool's steps are shuffled (its generator), and the pools'
  steps in order make one sequence: optimizer step ``t`` runs entry ``t * dp + d`` on dp rank
  ``d``. So an optimizer step takes a varying number of pieces and tokens (a batch by token
  budget, as fairseq's ``max_tokens``), and its data is a function of ``(seed, t)`` and the
  run's configuration: a checkpoint's data position is its step, as with windows.

Padding takes targets of -100 (ignored), so under causal attention each piece trains alone.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sparta.errors import ConfigError
from sparta.parallel.data import END_OF_TEXT_ID
from sparta.scheduling.varlen import LengthCost, MicroBatch, bucketed_steps, collate


def document_pieces(tokens: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """(starts, ends) [P] int64 of the pieces of every document of ``tokens`` [N]: each at most
    ``seq_len + 1`` tokens and at least 2, ends exclusive, in stream order."""
    closes = (tokens == END_OF_TEXT_ID).nonzero().flatten() + 1
    bounds = [0, *closes.tolist()]
    if bounds[-1] != len(tokens):
        bounds.append(len(tokens))
    starts: list[int] = []
    ends: list[int] = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        for s in range(a, b - 1, seq_len):  # pieces overlap by one token: each pair trains once
            starts.append(s)
            ends.append(min(s + seq_len + 1, b))
    return torch.tensor(starts, dtype=torch.long), torch.tensor(ends, dtype=torch.long)


class DocumentBatches:
    """The steps of a run on documents, for every dp rank (see the module docstring).

    Args:
        tokens: the flat token stream [N] (int64), the same on every rank.
        seq_len: the model's input length: the longest piece has ``seq_len + 1`` tokens.
        seed: the run's seed.
        buckets: the padded lengths the pipeline takes (``parallel.lengths``; the longest at
            least ``seq_len``, as `RunConfig` checks).
        global_batch, dp, microbatches, stages: the run's (``stages`` = pp).
        cost: the time of one micro-batch by its shape, for the grouping.
    """

    def __init__(
        self,
        tokens: Tensor,
        seq_len: int,
        seed: int,
        buckets: tuple[int, ...],
        global_batch: int,
        dp: int,
        microbatches: int,
        stages: int,
        cost: LengthCost,
    ) -> None:
        starts, ends = document_pieces(tokens, seq_len)
        val = torch.arange(len(starts)) % 10 == 9
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.train = (starts[~val], ends[~val])
        self.val = (starts[val], ends[val])
        for name, (s, _) in (("training", self.train), ("validation", self.val)):
            if len(s) < global_batch:
                raise ConfigError(
                    f"the {name} split has {len(s)} document pieces, fewer than train.global_batch={global_batch}: "
                    "raise data.corpus_mb (or data.random_tokens) or lower train.global_batch"
                )
        # a whole piece (seq_len tokens) pads to the smallest bucket that holds it; longer
        # buckets hold nothing, and the budget is a window batch's once padded to that bucket
        # (at seq_len alone, a bucket past seq_len held no row when a micro-batch is one row)
        holding = [b for b in buckets if b >= seq_len]
        if not holding:
            raise ConfigError(
                f"buckets={list(buckets)}: none holds a whole piece of seq_len={seq_len} tokens; add {seq_len}"
            )
        longest = min(holding)
        self.buckets, self.global_batch, self.dp, self.microbatches, self.stages = (
            tuple(b for b in buckets if b <= longest),
            global_batch,
            dp,
            microbatches,
            stages,
        )
        self.max_tokens = global_batch // (dp * microbatches) * longest
        self.cost = cost
        # the sequence of steps so far: (pieces [n] as indices into the training split, micro-batches)
        self._steps: list[tuple[Tensor, list[MicroBatch]]] = []
        self._pools = 0

    def _entry(self, index: int) -> tuple[Tensor, list[MicroBatch]]:
        while len(self._steps) <= index:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self._pools)
            self._pools += 1
            pool = torch.randint(0, len(self.train[0]), (self.global_batch,), generator=generator)
            lengths = (self.train[1][pool] - self.train[0][pool] - 1).tolist()
            steps = bucketed_steps(lengths, self.cost, self.buckets, self.max_tokens, self.microbatches, self.stages)
            order = torch.randperm(len(steps), generator=generator).tolist()
            self._steps += [(pool, steps[k]) for k in order]
        return self._steps[index]

    def _pieces(self, split: tuple[Tensor, Tensor], indices: Tensor) -> list[Tensor]:
        return [self.tokens[a:b] for a, b in zip(split[0][indices].tolist(), split[1][indices].tolist(), strict=True)]

    def train_batch(self, step: int, global_batch: int, dp_rank: int, dp: int) -> tuple[Tensor, Tensor]:
        """dp rank ``dp_rank``'s step of optimizer step ``step``: (ids, targets) [rows, length]
        int64, ``microbatches`` micro-batches of one shape one after another, padded."""
        self._same(global_batch, dp)
        pool, mbs = self._entry(step * dp + dp_rank)
        samples = self._pieces(self.train, pool)
        parts = [collate(samples, mb) for mb in mbs]
        return torch.cat([ids for ids, _ in parts]), torch.cat([t for _, t in parts])

    def tokens_of(self, step: int) -> int:
        """Real (unpadded) input tokens of optimizer step ``step`` over every dp rank."""
        total = 0
        for d in range(self.dp):
            pool, mbs = self._entry(step * self.dp + d)
            lengths = self.train[1][pool] - self.train[0][pool] - 1
            total += sum(int(lengths[list(mb.samples)].sum()) for mb in mbs)
        return total

    def val_batch(self, index: int, batches: int, global_batch: int, dp_rank: int, dp: int) -> tuple[Tensor, Tensor]:
        """Batch ``index`` of ``batches`` fixed validation batches of ``global_batch`` pieces,
        spread evenly over the validation split; this dp rank's share, padded to its longest."""
        self._same(global_batch, dp)
        picks = torch.linspace(0, len(self.val[0]) - 1, batches * global_batch).long().chunk(batches)[index]
        local = global_batch // dp
        mine = picks[dp_rank * local : (dp_rank + 1) * local]
        samples = self._pieces(self.val, mine)
        longest = max(s.numel() - 1 for s in samples)
        return collate(samples, MicroBatch(tuple(range(len(samples))), len(samples), longest))

    def _same(self, global_batch: int, dp: int) -> None:
        if (global_batch, dp) != (self.global_batch, self.dp):
            raise ConfigError(
                f"DocumentBatches was built for global_batch={self.global_batch}, dp={self.dp}; asked for "
                f"global_batch={global_batch}, dp={dp}: build it with the run's global_batch and dp"
            )

    @property
    def mean_piece(self) -> float:
        """Mean input tokens of a training piece."""
        return float((self.train[1] - self.train[0] - 1).float().mean()) if len(self.train[0]) else math.nan
