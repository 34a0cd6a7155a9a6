"""Bad input refused on every rank before any row moves, and what the input agreement costs
in engine calls (none of its own where a collective exchanges sizes anyway). Run by
`comm_checks.py`; `engine_calls` is also used by `hier_checks.py`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from comm_payloads import payload
from runner import raises

from sparta.comm import Communicator, World
from sparta.errors import ConfigError, InputError


def check_bad_input_raises_everywhere(world: World) -> None:
    r, n = world.rank, world.size
    c = world.comm
    bad_rank = 1
    with raises(InputError, "rank 1: send_splits has 2 entries but the group has 4 ranks"):
        c.all_to_all(torch.ones(2), [1, 1] if r == bad_rank else [2, 0, 0, 0])
    with raises(InputError, r"send_splits\[0\] = -1 is negative"):
        c.all_to_all(torch.ones(0), [-1, 1, 0, 0] if r == bad_rank else [0] * n)
    with raises(InputError, "send_splits sum to 4 but the tensor has 3 rows"):
        c.all_to_all(torch.ones(3), [1, 1, 1, 1] if r == bad_rank else [3, 0, 0, 0])
    with raises(InputError, "rank 0 passed float32 but rank 1 passed int64"):
        c.all_to_all(torch.ones(n, dtype=torch.int64 if r == bad_rank else torch.float32))
    with raises(InputError, r"recv_splits\[0\] = 2 but rank 0 sends 1 rows"):
        c.all_to_all(torch.ones(n), [1] * n, [2, 0, 1, 1] if r == bad_rank else [1] * n)
    with raises(InputError, "tensor shapes disagree"):
        c.all_reduce(torch.ones(3 if r == bad_rank else 2))
    with raises(InputError, "tensor shapes disagree"):
        c.all_gather(torch.ones(2, 3 if r == bad_rank else 2))
    with raises(InputError, "dim 0 \\(5\\) is not divisible by the group size"):
        c.reduce_scatter(torch.ones(5))
    with raises(InputError, "src = 7 is not a rank of this group"):
        c.broadcast(torch.ones(1), src=7)
    with raises(InputError, "op='avg' needs a floating dtype"):
        c.all_reduce(torch.ones(2, dtype=torch.int64), op="avg")
    with raises(InputError, "cannot reduce dtype torch.uint64"):
        c.all_reduce(torch.ones(2, dtype=torch.uint64))
    with raises(InputError, "unknown reduction op 'max'"):
        c.all_reduce(torch.ones(2), op="max")
    with raises(InputError, "rank 1: takes a torch.Tensor, got list"):
        c.all_reduce([1.0] if r == bad_rank else torch.ones(1))  # type: ignore[arg-type]
    with raises(InputError, "rank 1: unknown reduction op 'max'"):
        c.all_reduce(torch.ones(2), op="max" if r == bad_rank else "sum")
    with raises(InputError, "groups must be disjoint"):
        c.split_groups([[0, 1], [1, 2]])
    # past an engine's bound on one call (MPI's 32-bit counts; set low here, on every engine,
    # to be reached): the one rank over it is refused on all, before any row moves
    c.max_call_rows = 64
    try:
        with raises(InputError, r"rank 1: the \w+ engine moves at most 64 rows a call each way, and this rank's "
                                r"part is 80"):  # fmt: skip
            c.all_to_all(torch.ones(80 if r == bad_rank else n), [80, 0, 0, 0] if r == bad_rank else [1] * n)
        # past the bound in bytes, MPI counts in units of a divisor of every count (a row at
        # least): more bytes than the bound go through whole; only a call of more units than it
        # (odd byte counts) is refused, on every rank
        rows = (torch.arange(24.0 * n) + 1000 * r).view(6 * n, 4)  # 96 n bytes
        want = torch.cat([(torch.arange(24.0 * n) + 1000 * s).view(6 * n, 4)[6 * r : 6 * r + 6] for s in range(n)])
        with engine_calls(c) as calls:
            assert torch.equal(c.all_to_all(rows), want)
        assert calls == [A2A, GATHER, A2A], calls  # 6 n^2 rows in all, past 64: the receives agreed on first
        # a receive past the bound, which its rank learns only from the exchanged splits:
        # refused on every rank before any row moves, checked or not
        for check in (True, False):
            past = rf"rank 1: the \w+ engine moves at most 64 rows a call each way, and this rank's part is {33 * n}"
            with engine_calls(c) as calls, raises(InputError, past):
                c.all_to_all(torch.ones(33), [33 if s == bad_rank else 0 for s in range(n)], check=check)
            assert calls == [A2A, GATHER, GATHER], (check, calls)  # the splits, the verdicts, the reason
        ones = torch.ones(1000, dtype=torch.uint8)
        assert torch.equal(c.broadcast(torch.full((1000,), r, dtype=torch.uint8), src=1), ones)
        gathered = c.all_gather(rows)
        assert all(torch.equal(g, (torch.arange(24.0 * n) + 1000 * s).view(6 * n, 4)) for s, g in enumerate(gathered))
        if c.backend == "mpi":
            with raises(InputError, r"the MPI engine moves at most 64 units a call .* here 1\), asked for 133"):
                c.all_gather(torch.ones(33 + (r == 0), dtype=torch.uint8))
    finally:
        del c.max_call_rows  # the engine's own bound again
    # and the communicator still works after all of that
    assert c.all_reduce(torch.tensor([1.0])).item() == n


@contextmanager
def engine_calls(comm: Communicator) -> Iterator[list[str]]:
    """The engine primitives `comm` runs inside the block, in order (the engine's own calls
    run unchanged; this only records their names)."""
    calls: list[str] = []
    names = ("_all_to_all_bytes", "_all_gather_bytes", "_broadcast_bytes", "_all_reduce")
    for name in names:
        real = getattr(comm, name)
        setattr(comm, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    try:
        yield calls
    finally:
        for name in names:
            delattr(comm, name)


A2A, GATHER, REDUCE = "_all_to_all_bytes", "_all_gather_bytes", "_all_reduce"


def check_agreement_rides_on_exchanged_data(world: World) -> None:
    """The input agreement costs no round of its own where a collective exchanges sizes
    anyway (all-to-all without recv_splits, all-gather), one small all-gather elsewhere,
    and a round for the reasons only when some rank has one; bad input moves no data."""
    c, r, n = world.comm, world.rank, world.size
    x, send, expect, recv = payload(world, 1, torch.float32)
    with engine_calls(c) as calls:
        assert torch.equal(c.all_to_all(x, send), expect)
    assert calls == [A2A, A2A], calls  # splits with everyone's dtype, shape and verdict; rows
    with engine_calls(c) as calls:
        assert torch.equal(c.all_to_all(x, send, recv, check=False), expect)
    assert calls == [A2A], calls
    # equal blocks: checked, the splits go round with the verdicts; unchecked, only the rows
    blocks = torch.arange(2 * n, dtype=torch.float32) + 100 * r
    want = torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + 100 * s for s in range(n)])
    for check, rounds in ((True, [A2A, A2A]), (False, [A2A])):
        with engine_calls(c) as calls:
            assert torch.equal(c.all_to_all(blocks, check=check), want), check
        assert calls == rounds, (check, calls)
    with engine_calls(c) as calls:
        assert torch.equal(c.all_to_all(x, send, recv), expect)
    assert calls == [A2A, GATHER, A2A], calls  # every rank's verdict on the recv_splits it was given
    with engine_calls(c) as calls:
        assert [t.item() for t in c.all_gather(torch.tensor([r]))] == list(range(n))
    assert calls == [GATHER, GATHER], calls
    with engine_calls(c) as calls:
        assert c.all_reduce(torch.tensor([1.0])).item() == n
        assert c.all_reduce(torch.tensor([1.0]), check=False).item() == n
    assert calls == [GATHER, REDUCE, REDUCE], calls
    with engine_calls(c) as calls, raises(InputError, "rank 0 passed float32 but rank 1 passed int64"):
        c.all_to_all(torch.ones(n, dtype=torch.int64 if r == 1 else torch.float32))
    assert calls == [A2A], calls  # found on the split exchange: no rows moved
    with engine_calls(c) as calls, raises(InputError, r"rank 2: send_splits\[1\] = -3 is negative"):
        c.all_to_all(torch.ones(n), [1, -3, 5, 1] if r == 2 else [1] * n)
    assert calls == [A2A, GATHER], calls  # flags on the split exchange, then the reasons
    with engine_calls(c) as calls, raises(InputError, "rank 3: op='avg' needs a floating dtype"):
        c.all_reduce(torch.ones(2, dtype=torch.int64 if r == 3 else torch.float32), op="avg")
    assert calls == [GATHER, GATHER], calls


def check_agree_names_every_failing_rank(world: World) -> None:
    """`Communicator.agree`: one error on every rank, of the failing rank's kind, each failing
    rank's reason, ranks with the same reason together; a flag carried by the caller's own
    exchange makes a healthy round free."""
    c, r = world.comm, world.rank
    c.agree(None, "nothing wrong")
    mine = ConfigError(f"table {r} is too big") if r in (1, 3) else None
    with raises(ConfigError, r"^my layer: rank 1: table 1 is too big; rank 3: table 3 is too big\. Every rank"):
        c.agree(mine, "my layer")
    same = InputError("ids out of range") if r != 0 else None
    with raises(InputError, r"my layer: ranks \[1, 2, 3\]: ids out of range\."):
        c.agree(same, "my layer")
    flags = c.all_to_all(torch.tensor([int(same is not None)] * world.size), check=False)
    with engine_calls(c) as calls, raises(InputError, r"ranks \[1, 2, 3\]: ids out of range"):
        c.agree(same, "my layer", failed=[s for s, f in enumerate(flags.tolist()) if f])
    assert calls == [GATHER], calls  # only the reasons
    with engine_calls(c) as calls:
        c.agree(None, "my layer", failed=[])
    assert calls == [], calls
