"""Embedding input checks that every rank agrees on before rows move.

A rank with bad ids must not raise alone: its peers would wait in the next all-to-all
forever. Each forward already exchanges how many ids every rank sends to every other, so
each rank appends what it found (a problem code and two numbers) to those counts; after
that one small all-to-all every rank knows every rank's verdict and raises the same error.
The table's configuration is agreed the same way, once, when the layer is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from sparta.comm import Communicator
from sparta.comm.dtypes import dtype_code, dtype_name
from sparta.errors import ConfigError, InputError


class IdProblem(IntEnum):
    NONE = 0
    NOT_A_TENSOR = 1  # ids is not a torch.Tensor
    NOT_INTEGER = 2  # a = dtype code
    OUT_OF_RANGE = 3  # a = the first bad id, b = num_embeddings
    SHAPE_MISMATCH = 4  # a = hidden's tokens, b = targets' (VocabParallelHead)


@dataclass(frozen=True)
class IdFinding:
    problem: IdProblem = IdProblem.NONE
    a: int = 0
    b: int = 0

    def message(self, table: str) -> str:
        if self.problem == IdProblem.NOT_A_TENSOR:
            return f"{table} takes a tensor of integer ids; pass torch.tensor(ids, dtype=torch.long)"
        if self.problem == IdProblem.NOT_INTEGER:
            return f"{table} got ids of dtype {dtype_name(self.a)}; ids must be integers, use ids.long()"
        if self.problem == IdProblem.SHAPE_MISMATCH:
            return (
                f"{table} got hidden states of {self.a} tokens but {self.b} targets; "
                "targets must have hidden's shape without its last dim"
            )
        return (
            f"{table} got id {self.a}, outside its vocabulary 0..{self.b - 1}; "
            f"map unknown tokens to a valid id (e.g. an <unk> row) first"
        )


def inspect_ids(ids: object, num_embeddings: int) -> IdFinding:
    """What is wrong with `ids`, without talking to any other rank."""
    if not isinstance(ids, torch.Tensor):
        return IdFinding(IdProblem.NOT_A_TENSOR)
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        return IdFinding(IdProblem.NOT_INTEGER, dtype_code(ids.dtype))
    if ids.numel():
        bad = (ids < 0) | (ids >= num_embeddings)
        if bool(bad.any()):
            return IdFinding(IdProblem.OUT_OF_RANGE, int(ids[bad].flatten()[0]), num_embeddings)
    return IdFinding()


def raise_if_bad(findings: Sequence[IdFinding], rank: int, table: str, where: str) -> None:
    """Raise one InputError naming the first rank whose finding is a problem."""
    for r, finding in enumerate(findings):
        if finding.problem != IdProblem.NONE:
            who = "this rank" if r == rank else f"rank {r}"
            raise InputError(f"{where}: {who}: {finding.message(table)}. Every rank raises this error.")


def exchange_counts(comm: Communicator, send_counts: Sequence[int], finding: IdFinding, table: str) -> list[int]:
    """Send `send_counts[r]` to rank r and return what each rank sends here.

    The verdict on this rank's ids travels with the counts, so a bad id on any rank raises
    the same InputError on every rank after this single small all-to-all, before any id or
    row moves. Called by every rank of `comm` in the same order.
    """
    mine = [int(finding.problem), finding.a, finding.b]
    table_rows = torch.tensor([[int(c), *mine] for c in send_counts], dtype=torch.int64)
    ones = [1] * comm.size
    got = comm.all_to_all(table_rows, ones, ones, check=False)
    rows = got.tolist()  # type: ignore[union-attr]
    findings = [IdFinding(IdProblem(p), a, b) for _, p, a, b in rows]
    raise_if_bad(findings, comm.rank, table, f"{table} on {comm.where} [{comm.backend}]")
    return [int(row[0]) for row in rows]


def gather_with_verdict(comm: Communicator, value: int, finding: IdFinding, table: str) -> list[int]:
    """Every rank's `value`, gathered with every rank's verdict on its ids.

    For callers with no count exchange to ride on (VocabParallelHead's targets): one
    all-gather of four integers per rank, after which a bad id anywhere raises the same
    InputError on every rank. Called by every rank of `comm` in the same order.
    """
    mine = torch.tensor([int(value), int(finding.problem), finding.a, finding.b], dtype=torch.int64)
    rows = [g.tolist() for g in comm.all_gather(mine)]  # type: ignore[union-attr]
    findings = [IdFinding(IdProblem(p), a, b) for _, p, a, b in rows]
    raise_if_bad(findings, comm.rank, table, f"{table} on {comm.where} [{comm.backend}]")
    return [int(row[0]) for row in rows]


def agree_config(comm: Communicator, values: Sequence[int], names: Sequence[str], problem: str, table: str) -> int:
    """Check that every rank built `table` with the same `values` and none hit a `problem`.

    `values` are integers describing the configuration, named by `names`, the last being
    this rank's initialisation seed; `problem` is this rank's own configuration error
    message, or "". Every rank raises the same ConfigError if any rank has a problem or the
    values differ. Returns rank 0's seed. One all-gather of a few bytes per rank.
    """
    numbers = torch.tensor(list(values), dtype=torch.int64).view(torch.uint8)
    text = torch.tensor(list(problem.encode()), dtype=torch.uint8)
    got = comm.all_gather(torch.cat([numbers, text]))
    where = f"{table} on {comm.where} [{comm.backend}]"
    width = numbers.numel()
    rows = [g[:width].clone().view(torch.int64).tolist() for g in got]  # type: ignore[union-attr]
    for r, g in enumerate(got):  # type: ignore[arg-type]
        if g.numel() > width:
            who = "this rank" if r == comm.rank else f"rank {r}"
            raise ConfigError(f"{where}: {who}: {bytes(g[width:].tolist()).decode()}. Every rank raises this error.")
    for r, got_r in enumerate(rows[1:], start=1):
        for name, v0, vr in zip(names[:-1], rows[0][:-1], got_r[:-1], strict=True):
            if v0 != vr:
                raise ConfigError(
                    f"{where}: rank 0 built it with {name}={v0} but rank {r} with {name}={vr}; "
                    "every rank must construct the table with the same arguments"
                )
    return int(rows[0][-1])
