"""Embedding input checks that every rank agrees on before rows move.

A rank with bad ids must not raise alone: its peers would wait in the next all-to-all
forever. Each forward already exchanges how many ids every rank sends to every other, so
each rank appends one flag (its ids are bad) to those counts: a healthy step pays nothing
more, and a bad one makes every rank raise the same error through `Communicator.agree`.
The table's configuration is agreed the same way, once, when the layer is built.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparta.comm import Communicator
from sparta.errors import ConfigError, InputError, SpartaError


def inspect_ids(ids: object, num_embeddings: int, table: str) -> InputError | None:
    """What is wrong with `ids` (the error, unraised), or None; talks to no other rank."""
    if not isinstance(ids, torch.Tensor):
        return InputError(f"{table} takes a tensor of integer ids; pass torch.tensor(ids, dtype=torch.long)")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        dtype = str(ids.dtype).removeprefix("torch.")
        return InputError(f"{table} got ids of dtype {dtype}; ids must be integers, use ids.long()")
    if ids.numel():
        bad = (ids < 0) | (ids >= num_embeddings)
        if bool(bad.any()):
            first = int(ids[bad].flatten()[0])
            return InputError(
                f"{table} got id {first}, outside its vocabulary 0..{num_embeddings - 1}; "
                "map unknown tokens to a valid id (e.g. an <unk> row) first"
            )
    return None


def _where(comm: Communicator, table: str) -> str:
    return f"{table} on {comm.where} [{comm.backend}]"


def _flagged(rows: Sequence[Sequence[int]]) -> list[int]:
    """The ranks whose row ends in a set flag."""
    return [r for r, row in enumerate(rows) if row[-1]]


def exchange_id_counts(
    comm: Communicator, send_counts: Sequence[int], error: InputError | None, table: str
) -> list[int]:
    """Send `send_counts[r]` to rank r and return what each rank sends here.

    Whether this rank's ids are bad (`error`) travels with the counts, so a bad id on any
    rank raises the same InputError on every rank after this single small all-to-all,
    before any id or row moves. Called by every rank of `comm` in the same order.
    """
    flag = int(error is not None)
    rows = torch.tensor([[int(c), flag] for c in send_counts], dtype=torch.int64)
    ones = [1] * comm.size
    got = comm.all_to_all(rows, ones, ones, check=False).tolist()  # type: ignore[union-attr]
    comm.agree(error, _where(comm, table), failed=_flagged(got))
    return [int(count) for count, _ in got]


def gather_with_verdict(comm: Communicator, value: int, error: InputError | None, table: str) -> list[int]:
    """Every rank's `value`, gathered with every rank's verdict on its ids.

    For callers with no count exchange to ride on (VocabParallelHead's targets): one
    all-gather of two integers per rank, after which a bad id anywhere raises the same
    InputError on every rank. Called by every rank of `comm` in the same order.
    """
    return [int(row[0]) for row in _gathered(comm, [value], error, _where(comm, table))]


def _gathered(comm: Communicator, values: Sequence[int], error: SpartaError | None, where: str) -> list[list[int]]:
    """Every rank's ``values`` and verdict, [rank][values..., failed]; ``error`` raised on
    every rank if any rank has one. One all-gather of a few integers per rank."""
    mine = torch.tensor([*values, int(error is not None)], dtype=torch.int64)
    rows = [g.tolist() for g in comm.all_gather(mine)]  # type: ignore[union-attr]
    comm.agree(error, where, failed=_flagged(rows))
    return rows


def agree_config(
    comm: Communicator, values: Sequence[int], names: Sequence[str], problem: ConfigError | None, table: str
) -> int:
    """Check that every rank built `table` with the same `values` and none hit a `problem`.

    `values` are integers describing the configuration, named by `names`, the last being
    this rank's initialisation seed; `problem` is this rank's own configuration error
    (unraised), or None. Every rank raises the same ConfigError if any rank has a problem or
    the values differ. Returns rank 0's seed. One all-gather of a few integers per rank.
    """
    where = _where(comm, table)
    rows = _gathered(comm, values, problem, where)
    for r, row in enumerate(rows[1:], start=1):
        for name, v0, vr in zip(names[:-1], rows[0][:-2], row[:-2], strict=True):
            if v0 != vr:
                raise ConfigError(
                    f"{where}: rank 0 built it with {name}={v0} but rank {r} with {name}={vr}; "
                    "every rank must construct the table with the same arguments"
                )
    return int(rows[0][-2])
