"""The batches a ParallelModel takes: each rank's checked before anything moves, then padded
to its length's bucket, so that a pipeline's stages see the few shapes they were built for."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sparta.embedding.checks import inspect_ids
from sparta.errors import InputError
from sparta.scheduling.varlen import IGNORE_INDEX


class Batches:
    """The rules for ids and targets [B, T] int64 (`ParallelModel.step`, `evaluate`).

    microbatches: B must divide into them. lengths: the length buckets (ascending; T is
    padded to the smallest that holds it), or () for one length, ``seq_len``: fixed by the
    first batch where None. num_ids, num_classes: the token embedding's rows and the output
    head's classes, which ids and targets must fall in (None: not checked).
    """

    def __init__(
        self,
        microbatches: int,
        lengths: tuple[int, ...],
        seq_len: int | None,
        num_ids: int | None = None,
        num_classes: int | None = None,
    ) -> None:
        self.microbatches, self.lengths, self.seq_len = microbatches, lengths, seq_len
        self.num_ids, self.num_classes = num_ids, num_classes

    def problem(self, ids: Tensor, targets: Tensor) -> InputError | None:
        """What is wrong with this rank's batch (the error, unraised), or None; talks to no
        other rank."""
        shapes = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in (ids, targets)]
        if not isinstance(ids, Tensor) or not isinstance(targets, Tensor) or ids.dim() != 2 or shapes[0] != shapes[1]:
            return InputError(f"ids {shapes[0]} and targets {shapes[1]} must both be tensors [B, T]")
        batch, length = ids.shape
        if batch % self.microbatches:
            return InputError(
                f"a batch of {batch} sequences does not divide into microbatches={self.microbatches}: "
                f"give each rank a multiple of {self.microbatches}"
            )
        try:
            self.padded_length(length)
        except InputError as exc:
            return exc
        if self.num_ids is not None:
            problem = inspect_ids(ids, self.num_ids, "ParallelModel's ids")
            if problem is not None:
                return problem
        if self.num_classes is not None and targets.numel():
            if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
                return InputError(f"targets of dtype {targets.dtype} must be integer class indices: use targets.long()")
            bad = ((targets < 0) & (targets != IGNORE_INDEX)) | (targets >= self.num_classes)
            if bool(bad.any()):
                return InputError(
                    f"targets hold {int(targets[bad].flatten()[0])}, outside the output head's classes "
                    f"0..{self.num_classes - 1} ({IGNORE_INDEX} marks a position without loss): map them into range"
                )
        return None

    def padded(self, ids: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """A batch every dp rank's `problem` passed, padded to its length's bucket (ids with 0,
        targets with IGNORE_INDEX; the first such batch fixes ``seq_len`` where neither it nor
        ``lengths`` is set)."""
        length = ids.shape[1]
        if self.seq_len is None and not self.lengths:
            self.seq_len = length
        pad = self.padded_length(length) - length
        if pad:
            ids = nn.functional.pad(ids, (0, pad), value=0)
            targets = nn.functional.pad(targets, (0, pad), value=IGNORE_INDEX)
        return ids, targets

    def padded_length(self, length: int) -> int:
        """The length a batch of ``length`` tokens is padded to: the smallest of ``lengths``
        that holds it, else ``seq_len`` (fixed by the first batch a step or evaluation ran;
        ``length`` itself before that)."""
        if self.lengths:
            if length > self.lengths[-1]:
                raise InputError(
                    f"a batch of length {length} exceeds the longest of lengths={list(self.lengths)}: cut it, or add "
                    f"a length of at least {length}"
                )
            return next(n for n in self.lengths if n >= length)
        if self.seq_len is None:
            return length
        if length > self.seq_len:
            raise InputError(
                f"a batch of length {length} exceeds the pipeline's sequence length {self.seq_len} (fixed at the "
                "first step, or by ParallelConfig.seq_len): cut it, or set seq_len to the longest"
            )
        return self.seq_len
