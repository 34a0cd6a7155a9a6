"""Input checks that every rank agrees on before a collective moves any data.

A rank with bad input must not simply raise: its peers would enter the collective and hang.
Instead each rank encodes what it found (a problem code and two numbers) together with its
tensor's dtype and shape into a small int64 row, the rows are exchanged in one tiny
collective, and then every rank raises the same error, naming the offending rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from sparta.comm.dtypes import dtype_code, dtype_name
from sparta.errors import InputError

META_LEN = 8  # problem, a, b, c, dtype code, ndim, dim 0, product of the other dims


class Problem(IntEnum):
    NONE = 0
    SPLITS_LENGTH = 1  # a = len(splits), b = group size
    SPLITS_NEGATIVE = 2  # a = index, b = value
    SPLITS_SUM = 3  # a = sum of splits, b = dim 0 of the tensor
    RECV_SPLITS_LENGTH = 4  # a = len(recv_splits), b = group size
    RECV_SPLITS_NEGATIVE = 5  # a = index, b = value
    NOT_DIVISIBLE = 6  # a = dim 0, b = group size
    BAD_SRC = 7  # a = src, b = group size
    ZERO_DIM = 8  # a tensor without a dim 0 where splitting along dim 0 is needed
    RECV_MISMATCH = 9  # a = peer, b = recv_splits[peer], c = rows the peer sends


_MESSAGES = {
    Problem.SPLITS_LENGTH: "send_splits has {a} entries but the group has {b} ranks; give one split per rank",
    Problem.SPLITS_NEGATIVE: "send_splits[{a}] = {b} is negative; splits count rows and must be >= 0",
    Problem.SPLITS_SUM: "send_splits sum to {a} but the tensor has {b} rows along dim 0; make them sum to x.shape[0]",
    Problem.RECV_SPLITS_LENGTH: "recv_splits has {a} entries but the group has {b} ranks; give one per rank or None",
    Problem.RECV_SPLITS_NEGATIVE: "recv_splits[{a}] = {b} is negative; splits count rows and must be >= 0",
    Problem.NOT_DIVISIBLE: "dim 0 ({a}) is not divisible by the group size ({b}); pad the tensor to a multiple of {b}",
    Problem.BAD_SRC: "src = {a} is not a rank of this group of {b}; use 0 <= src < {b}",
    Problem.ZERO_DIM: "the tensor is 0-dimensional; this operation splits along dim 0, so reshape it to at least 1-D",
    Problem.RECV_MISMATCH: (
        "recv_splits[{a}] = {b} but rank {a} sends {c} rows; pass recv_splits=None to have them "
        "exchanged, or fix the splits"
    ),
}


@dataclass(frozen=True)
class Finding:
    problem: Problem = Problem.NONE
    a: int = 0
    b: int = 0
    c: int = 0

    def message(self) -> str:
        return _MESSAGES[self.problem].format(a=self.a, b=self.b, c=self.c)


OK = Finding()


def check_splits(splits: Sequence[int] | None, size: int, rows: int | None, recv: bool = False) -> Finding:
    if splits is None:
        return OK
    length, negative = (
        (Problem.RECV_SPLITS_LENGTH, Problem.RECV_SPLITS_NEGATIVE)
        if recv
        else (Problem.SPLITS_LENGTH, Problem.SPLITS_NEGATIVE)
    )
    if len(splits) != size:
        return Finding(length, len(splits), size)
    for i, s in enumerate(splits):
        if s < 0:
            return Finding(negative, i, int(s))
    if rows is not None and sum(splits) != rows:
        return Finding(Problem.SPLITS_SUM, int(sum(splits)), rows)
    return OK


def meta_row(x: torch.Tensor, finding: Finding) -> list[int]:
    dim0 = x.shape[0] if x.dim() > 0 else 1
    rest = x.numel() // dim0 if dim0 else int(torch.Size(x.shape[1:]).numel())
    return [int(finding.problem), finding.a, finding.b, finding.c, dtype_code(x.dtype), x.dim(), dim0, rest]


def raise_if_any(rows: torch.Tensor, op: str, rank: int, same_dim0: bool, same_rest: bool = True) -> None:
    """Raise one InputError from the exchanged meta rows `[size, META_LEN]` if any is bad.

    `op` names the operation, rank and group (Communicator._op).

    Every rank holds the same rows, so every rank raises the same error. `same_dim0` asks
    that every rank's tensor has the same dim 0 (all-reduce, reduce-scatter), `same_rest`
    that the trailing shape matches (everything but broadcast's receivers, which take the
    root's shape).
    """
    table = rows.tolist()
    for r, (problem, a, b, c, *_rest) in enumerate(table):
        if problem != Problem.NONE:
            who = "this rank" if r == rank else f"rank {r}"
            raise InputError(
                f"{op}: {who} passed invalid input: "
                f"{Finding(Problem(problem), a, b, c).message()}. Every rank raises this error."
            )
    first = table[0]
    for r, row in enumerate(table[1:], start=1):
        if row[4] != first[4]:
            raise InputError(
                f"{op}: rank 0 passed {dtype_name(first[4])} but rank {r} passed "
                f"{dtype_name(row[4])}; all ranks must pass the same dtype."
            )
        shape_differs = (same_rest and (row[5] != first[5] or row[7] != first[7])) or (same_dim0 and row[6] != first[6])
        if shape_differs:
            raise InputError(
                f"{op}: tensor shapes disagree between ranks: rank 0 has "
                f"{_shape_text(first)} and rank {r} has {_shape_text(row)}; "
                f"{'all dims' if same_dim0 else 'all dims but the first'} must match."
            )


def _shape_text(row: list[int]) -> str:
    return f"{row[5]}-D, dim 0 = {row[6]}, {row[7]} elements per row"
