"""What every rank agrees on before a collective moves any data.

A rank with bad input must not simply raise: its peers would enter the collective and hang,
or pair their next message with the wrong one. So each rank describes its tensor (dtype and
shape) and whether its own arguments are valid in a small int64 row (`meta_row`); the rows
travel on a message the operation sends anyway where it has one (the all-to-all's split
exchange, the all-gather's size exchange), else on one small all-gather, and every rank
raises the same error. A rank's complaint travels as one flag: the reasons are gathered
(`Communicator.agree`) only when some rank raised a flag, so a healthy group pays nothing
for them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparta.comm.dtypes import dtype_code, dtype_name
from sparta.errors import (
    BackendUnavailableError,
    CollectiveError,
    CollectiveTimeoutError,
    ConfigError,
    InputError,
    SpartaError,
)

META_LEN = 5  # failed, dtype code, ndim, dim 0, elements per dim-0 row

# What an agreed error can be, by index; a rank raises the most derived one its error is.
ERROR_KINDS: tuple[type[SpartaError], ...] = (
    SpartaError,
    ConfigError,
    InputError,
    BackendUnavailableError,
    CollectiveError,
    CollectiveTimeoutError,
)
REASON_BYTES = 1024  # per rank, in the gather of reasons; longer reasons are cut


def meta_row(x: torch.Tensor, failed: bool) -> list[int]:
    """What every rank compares before data moves: [failed, dtype code, dims, dim 0, elements per row]."""
    dim0 = x.shape[0] if x.dim() > 0 else 1
    rest = x.numel() // dim0 if dim0 else int(torch.Size(x.shape[1:]).numel())
    return [int(failed), dtype_code(x.dtype), x.dim(), dim0, rest]


def failed_ranks(rows: Sequence[Sequence[int]]) -> list[int]:
    """The ranks whose meta row (or any row whose first entry is the flag) says they failed."""
    return [r for r, row in enumerate(rows) if row[0]]


def total_rows(rows: Sequence[Sequence[int]]) -> int:
    """The rows the whole group passes, from every rank's meta row (its dim 0)."""
    return sum(row[3] for row in rows)


def splits_problem(splits: Sequence[int] | None, size: int, rows: int | None, name: str) -> str | None:
    """What is wrong with `splits` (`name`: "send_splits" or "recv_splits"), or None."""
    if splits is None:
        return None
    if len(splits) != size:
        return f"{name} has {len(splits)} entries but the group has {size} ranks; give one per rank"
    for i, s in enumerate(splits):
        if s < 0:
            return f"{name}[{i}] = {s} is negative; splits count rows and must be >= 0"
    if rows is not None and sum(splits) != rows:
        return f"{name} sum to {sum(splits)} but the tensor has {rows} rows along dim 0; make them sum to x.shape[0]"
    return None


def as_tensor(x: object) -> tuple[torch.Tensor, str | None]:
    """`x` if it can be communicated; else an empty stand-in (for the metadata that goes to
    the peers) and what is wrong with it."""
    if not isinstance(x, torch.Tensor):
        return torch.empty(0), f"takes a torch.Tensor, got {type(x).__name__}"
    if dtype_code(x.dtype) == 0:
        return torch.empty(0), f"dtype {x.dtype} cannot be communicated; cast to a standard dtype"
    return x, None


def send_splits_of(
    x: torch.Tensor, send_splits: Sequence[int] | None, size: int, problem: str | None
) -> tuple[list[int], str | None]:
    """The rows ``x`` sends to each of ``size`` ranks (equal blocks when ``send_splits`` is
    None), and ``problem``, or else what is wrong with them."""
    if send_splits is None or x.dim() == 0:
        return [(x.shape[0] if x.dim() else 0) // size] * size, problem or blocks_problem(x, size)
    send = [int(s) for s in send_splits]
    return send, problem or splits_problem(send, size, x.shape[0], "send_splits")


def blocks_problem(x: torch.Tensor, size: int) -> str | None:
    """What keeps `x` from being cut into `size` equal blocks along dim 0, or None."""
    if x.dim() == 0:
        return "the tensor is 0-dimensional; this operation splits along dim 0, so reshape it to at least 1-D"
    if x.shape[0] % size:
        return (
            f"dim 0 ({x.shape[0]}) is not divisible by the group size ({size}); pad the tensor to a multiple of {size}"
        )
    return None


def recv_problem(expected: Sequence[int], incoming: Sequence[int]) -> str | None:
    """The first source whose rows differ from what the caller's recv_splits expect, or None."""
    for r, (e, i) in enumerate(zip(expected, incoming, strict=True)):
        if int(e) != int(i):
            return (
                f"recv_splits[{r}] = {e} but rank {r} sends {i} rows; pass recv_splits=None to have them "
                "exchanged, or fix the splits"
            )
    return None


def raise_if_inconsistent(rows: Sequence[Sequence[int]], op: str, same_dim0: bool) -> None:
    """Raise one InputError if the ranks' meta rows disagree on dtype or shape. Every rank
    holds the same rows, so every rank raises the same error. `same_dim0` asks that dim 0
    agrees too (all-reduce, reduce-scatter, broadcast), not only the trailing dims."""
    first = rows[0]
    for r, row in enumerate(rows[1:], start=1):
        if row[1] != first[1]:
            raise InputError(
                f"{op}: rank 0 passed {dtype_name(first[1])} but rank {r} passed "
                f"{dtype_name(row[1])}; all ranks must pass the same dtype. Every rank raises this error."
            )
        if row[2] != first[2] or row[4] != first[4] or (same_dim0 and row[3] != first[3]):
            raise InputError(
                f"{op}: tensor shapes disagree between ranks: rank 0 has {_shape_text(first)} and rank {r} "
                f"has {_shape_text(row)}; {'all dims' if same_dim0 else 'all dims but the first'} must match. "
                "Every rank raises this error."
            )


def _shape_text(row: Sequence[int]) -> str:
    return f"{row[2]}-D, dim 0 = {row[3]}, {row[4]} elements per row"


def encode_reason(error: SpartaError | None) -> torch.Tensor:
    """This rank's error as REASON_BYTES bytes: its kind's index, then its UTF-8 message."""
    buf = torch.zeros(REASON_BYTES, dtype=torch.uint8)
    if error is not None:
        kind = max(i for i, k in enumerate(ERROR_KINDS) if isinstance(error, k))
        text = str(error).encode()[: REASON_BYTES - 1]
        buf[0] = kind
        buf[1 : 1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return buf


def agreed_error(reasons: torch.Tensor, failed: Sequence[int], op: str) -> SpartaError:
    """The one error every rank raises, from every rank's `encode_reason` ([size, REASON_BYTES]);
    ranks with the same reason are named together."""
    rows = reasons.view(-1, REASON_BYTES)
    by_reason: dict[str, list[int]] = {}
    for r in failed:
        text = bytes(rows[r, 1:].tolist()).rstrip(b"\0").decode(errors="replace")
        by_reason.setdefault(text or "failed without giving a reason", []).append(r)
    said = "; ".join(f"rank {rs[0]}: {why}" if len(rs) == 1 else f"ranks {rs}: {why}" for why, rs in by_reason.items())
    kind = ERROR_KINDS[int(rows[failed[0], 0])]
    return kind(f"{op}: {said}. Every rank of the group raises this error.")


def disjoint_groups(groups: Sequence[Sequence[int]], size: int) -> list[list[int]]:
    """``groups`` of a communicator's ranks as sorted lists; InputError unless each is a
    non-empty set of ranks in ``0..size-1`` and no rank is in two of them."""
    clean = [sorted({int(r) for r in g}) for g in groups]
    seen: set[int] = set()
    for g in clean:
        if not g:
            raise InputError("split_groups: an empty group; every group needs at least one rank")
        bad = [r for r in g if not 0 <= r < size]
        if bad:
            raise InputError(f"split_groups: ranks {bad} are not in this group of {size} (0..{size - 1})")
        if seen & set(g):
            twice = sorted(seen & set(g))
            raise InputError(f"split_groups: rank(s) {twice} appear in two groups; groups must be disjoint")
        seen |= set(g)
    return clean
