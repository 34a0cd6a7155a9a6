"""The exchange interface: what moves rows among the ranks of a group, whatever carries them.

`Communicator` (one engine's group), `HierarchicalAllToAll` (intra-node, then inter-node)
and `sparta.scheduling.TracedExchange` (records each transfer) all subclass `Exchange`, so
code that only moves rows (the MoE layer, the pipeline, `sparta.comm.all_to_all`) takes any
of them and uses nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from sparta.comm.handle import Handle


@dataclass(frozen=True)
class PendingAllToAll:
    """A started all-to-all: `handle.wait()` gives the received rows; `send_splits` and
    `recv_splits` are the rows per rank both ways as settled on every rank (the reverse
    exchange, e.g. autograd's backward, swaps them and needs no split exchange)."""

    handle: Handle[torch.Tensor]
    send_splits: list[int]
    recv_splits: list[int]


class Exchange(Protocol):
    """An uneven all-to-all over `size` ranks.

    size: ranks in the group. rank: this process's index in it. ranks: their ranks in the
    world, in group order. where: how error messages name this rank and group.
    """

    size: int
    rank: int
    ranks: tuple[int, ...]

    @property
    def where(self) -> str: ...

    def start_all_to_all(
        self,
        x: torch.Tensor,
        send_splits: Sequence[int] | None = None,
        recv_splits: Sequence[int] | None = None,
        check: bool | None = None,
    ) -> PendingAllToAll:
        """Validate, settle the splits and start moving the rows (see `all_to_all`)."""
        ...

    def all_to_all(
        self,
        x: torch.Tensor,
        send_splits: Sequence[int] | None = None,
        recv_splits: Sequence[int] | None = None,
        async_op: bool = False,
        check: bool | None = None,
    ) -> torch.Tensor | Handle[torch.Tensor]:
        """Rows `x[sum(send_splits[:r]) : sum(send_splits[:r+1])]` go to rank r.

        x: [n, *rest]. send_splits: rows per destination rank (None = n / size each).
        recv_splits: rows per source rank; None exchanges them first (one small message,
        which also carries every rank's dtype, row shape and verdict on its splits), but for
        equal blocks (send_splits None too) with checks off, where every rank's n is taken
        to be the same, as torch's all_to_all_single takes it, and n / size come from each.
        Returns [sum(recv_splits), *rest], rows ordered by source rank, or with `async_op`
        a Handle whose `wait()` does. `check=False` skips the input agreement when the
        caller knows every rank's input is consistent; None follows `CommConfig.check_inputs`.
        """
        handle = self.start_all_to_all(x, send_splits, recv_splits, check).handle
        return handle if async_op else handle.wait()
