"""The rows the communicator checks exchange: uneven splits with zeros, small integers exact
in every dtype, so each rank computes what it must receive (`comm_checks.py`,
`comm_agreement_checks.py`)."""

from __future__ import annotations

import torch

from sparta.comm import World

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.bool, torch.complex64, torch.int8]
WIDTH = 3


def splits(src: int, size: int, salt: int) -> list[int]:
    """Rows src sends to each destination; includes zeros for every salt."""
    return [(src + 2 * dst + salt) % 3 for dst in range(size)]


def block(src: int, dst: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows src sends dst: small integers, exact in every dtype."""
    base = torch.arange(n * WIDTH, dtype=torch.float32).view(n, WIDTH) + 16 * src + 4 * dst
    if dtype == torch.bool:
        return base.remainder(2).bool()
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype)
    return base.to(dtype)


def payload(world: World, salt: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[int], torch.Tensor, list[int]]:
    r, n = world.rank, world.size
    send = splits(r, n, salt)
    x = torch.cat([block(r, d, send[d], dtype) for d in range(n)])
    recv = [splits(s, n, salt)[r] for s in range(n)]
    expect = torch.cat([block(s, r, recv[s], dtype) for s in range(n)])
    return x, send, expect, recv
