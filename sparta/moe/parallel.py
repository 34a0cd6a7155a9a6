"""Expert parallelism: send each expert's rows to the rank that holds it, and back.

Rank ``r`` of an ``ep_size`` communicator holds global experts ``[r * L, (r + 1) * L)``
with ``L = num_experts / ep_size``. Dispatch leaves the rows sorted by global expert, hence
already grouped by destination rank: ``send_splits[r]`` is the sum of the counts of rank
``r``'s experts. The exchanges and counts of a layer with ``ep_size > 1`` all go through
here (the layer itself calls ``sparta.comm`` only for its tp all-reduces and its stats).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import Tensor

from sparta.comm import all_to_all
from sparta.comm.dtypes import dtype_code, dtype_name
from sparta.errors import InputError, SpartaError
from sparta.moe.experts import GroupedExperts
from sparta.scheduling.chunks import PipelineDegrees
from sparta.scheduling.pipeline import pipelined_exchange

if TYPE_CHECKING:
    from sparta.comm import Communicator, Exchange


@dataclass
class ExchangedCounts:
    """What the counts exchange tells a rank: ``recv_counts`` ``[ep_size, L]`` int64 (row
    ``s``: the rows source rank ``s`` sends each local expert, on the counts' device), the
    row splits of the exchange both ways (host ints), and ``stats`` summed over the ranks."""

    recv_counts: Tensor
    send_splits: list[int]
    recv_splits: list[int]
    stats: Tensor | None


def exchange_expert_counts(
    counts: Tensor,
    comm: Communicator,
    layer: str,
    rows_like: Tensor | None = None,
    error: SpartaError | None = None,
    stats: Tensor | None = None,
    check: bool = True,
) -> ExchangedCounts:
    """Send ``counts`` ``[E]`` (rows per global expert) to the ranks holding those experts;
    returns what every rank receives (``ExchangedCounts``), with the sum over ranks of ``stats``.

    Each message also carries a flag and the dtype and width of the rows to come. A rank that
    rejected its input (``error``, its unraised error) still takes part, flagged, and
    ``Communicator.agree`` then raises the same error on every rank instead of leaving them
    to wait forever in the next collective (a healthy group pays nothing for it); rows that
    differ in dtype or width between ranks raise here too. Every rank then knows the row
    exchanges agree, and they skip the communicator's own input check.

    ``stats`` ``[S]`` int64 (the same ``S`` on every rank) rides along to every rank, so that
    counts summed over the group (the layer's ``last_stats``) cost no collective of their own:
    every small collective costs a round trip.

    ``check=False`` skips the communicator's check that every rank sends the same layout
    (``E``, ``S``): a layer checks its first exchange and trusts the later ones, whose layout
    its configuration fixes. Every rank must pass the same ``check``.
    """
    ep_size = comm.size
    local = counts.numel() // ep_size
    flag = int(error is not None)
    meta = [flag, 0, 0] if rows_like is None else [flag, dtype_code(rows_like.dtype), rows_like.shape[1]]
    extra = counts.new_tensor(meta) if stats is None else torch.cat([counts.new_tensor(meta), stats])
    width = local + extra.numel()
    send = torch.cat([counts.view(ep_size, local), extra.expand(ep_size, -1)], dim=1)
    splits = [width] * ep_size
    recv = comm.all_to_all(send.reshape(-1), splits, splits, check=check).view(ep_size, width)
    # The one host synchronisation of the exchange: the splits of the row exchanges.
    table = torch.cat([recv.reshape(-1), counts.view(ep_size, local).sum(dim=1)]).tolist()
    rows = [table[s * width : (s + 1) * width] for s in range(ep_size)]
    comm.agree(error, f"MoE layer {layer!r} on {comm.where}", failed=[s for s, row in enumerate(rows) if row[local]])
    kinds = {(dtype_name(int(row[local + 1])), int(row[local + 2])) for row in rows}
    if len(kinds) > 1:
        raise InputError(
            f"MoE layer {layer!r}: the ranks of {comm.where} send rows of different (dtype, width): "
            f"{sorted(kinds)}; run the layer in the same dtype on every rank"
        )
    return ExchangedCounts(
        recv_counts=recv[:, :local],
        send_splits=[int(n) for n in table[ep_size * width :]],
        recv_splits=[int(sum(row[:local])) for row in rows],
        stats=None if stats is None else recv[:, local + 3 :].sum(dim=0),
    )


T = TypeVar("T")


def fail_together(
    step: Callable[[], T],
    num_experts: int,
    stats_len: int,
    comm: Communicator | None,
    layer: str,
    device: torch.device,
    check: bool = True,
) -> T:
    """Run ``step``, a local stage before the layer's first collective (input checks,
    routing). If it raises a ``SpartaError`` on one rank, that rank still joins the counts
    exchange (with ``stats_len`` zero stats, the length the other ranks send, and their
    ``check``) with its error, so that every rank of ``comm`` raises the same error instead
    of hanging."""
    try:
        return step()
    except SpartaError as err:
        if comm is None:
            raise
        # Counts live on the input's device, and engines pick the transport by device.
        zeros = torch.zeros(num_experts + stats_len, dtype=torch.int64, device=device)
        exchange_expert_counts(zeros[:num_experts], comm, layer, error=err, stats=zeros[num_experts:], check=check)
        raise AssertionError("unreachable: the counts exchange raises the agreed error") from err


def expert_parallel(
    rows: Tensor,
    counts: Tensor,
    exchanged: ExchangedCounts,
    experts: GroupedExperts,
    comm: Communicator,
    degrees: PipelineDegrees | None = None,
    exchange: Exchange | None = None,
) -> Tensor:
    """Run ``rows`` ``[N, d]``, grouped by global expert (``counts`` ``[E]`` int64), through
    the experts of every rank: ``[N, d]``, the same rows' expert outputs in the same order.
    ``exchanged`` is what ``exchange_expert_counts`` returned for these counts. Differentiable:
    the backward sends the gradients back along the reverse all-to-all.

    ``degrees`` cuts the row exchanges into chunks so that chunk ``i + 1`` travels while
    chunk ``i`` is computed (forward and backward separately, ``sparta.scheduling``);
    ``exchange`` moves the rows instead of ``comm`` (a ``HierarchicalAllToAll`` over the
    same ranks). Collectives, identical in order on every rank: the rows and the outputs
    (one all-to-all each, or one per chunk); their layout was agreed by the counts exchange.
    """
    ep_size, local = comm.size, experts.num_experts
    route = exchange or comm

    def compute(received: Tensor, chunk_counts: Tensor) -> Tensor:
        # Received rows come grouped by (source rank, local expert).
        return experts.forward_blocks(received, chunk_counts.reshape(ep_size, local).to(received.device))

    if degrees is not None and (degrees.forward > 1 or degrees.backward > 1):
        params = [p for _, p in experts.named_weights()]
        recv_counts = exchanged.recv_counts.reshape(-1)
        return pipelined_exchange(rows, counts, compute, route, degrees, params, recv_counts)
    send, recv = exchanged.send_splits, exchanged.recv_splits
    received = all_to_all(rows, send, recv, route, check=False)
    return all_to_all(compute(received, exchanged.recv_counts), recv, send, route, check=False)
