"""Seeded data whose collective results are known exactly, computed on every rank locally.

Rank r's element k is ((k * a + r * b + c) mod m) - h, with a, b, c drawn from `--seed`:
small integers, so every sum over ranks is exact in the dtype (h is chosen so that n * h
stays within the dtype's exact integers: 2^24 for float32, 256 for bfloat16, 2048 for
float16), and any element of any rank can be computed without that rank's data. A wrong
byte anywhere shows as a wrong element, whichever engine or algorithm moved it; ranks less
than m apart (m = 2h + 1) hold different buffers, so a block delivered from the wrong rank
shows too.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from sparta.errors import ConfigError

EXACT = {  # largest magnitude below which every integer is exact (or representable)
    torch.float32: 1 << 24,
    torch.float64: 1 << 53,
    torch.float16: 2048,
    torch.bfloat16: 256,
    torch.int8: 127,
    torch.uint8: 255,
    torch.int32: (1 << 31) - 1,
    torch.int64: (1 << 63) - 1,
}


@dataclass(frozen=True)
class Oracle:
    """Values for `ranks` ranks in `dtype` on `device`, drawn from `seed`."""

    seed: int
    ranks: int
    dtype: torch.dtype
    device: torch.device

    @property
    def _params(self) -> tuple[int, int, int, int, int]:
        rng = random.Random(self.seed)
        a, b, c = rng.randrange(1, 1 << 16), rng.randrange(1, 1 << 16), rng.randrange(0, 1 << 16)
        # past EXACT ranks no sum is exact (`summed` refuses); the values then need no bound
        h = min(30, EXACT[self.dtype] // self.ranks) if self.sums_exact else 30
        unsigned = self.dtype == torch.uint8
        m = h + 1 if unsigned else 2 * h + 1
        while math.gcd(a, m) != 1:  # k * a mod m then runs through every residue: no constant buffer
            a += 1
        while math.gcd(b, m) != 1:  # ranks less than m apart then hold different buffers
            b += 1
        return a, b, c, m, 0 if unsigned else h

    @property
    def sums_exact(self) -> bool:
        """Whether a sum over the ranks can be exact in the dtype (one unit each, at least)."""
        return EXACT[self.dtype] >= self.ranks

    def values(self, rank: int, start: int, length: int) -> torch.Tensor:
        """Elements [start, start + length) of rank `rank`'s buffer, as int64."""
        a, b, c, m, h = self._params
        k = torch.arange(start, start + length, dtype=torch.int64, device=self.device)
        return (k * a + rank * b + c) % m - h

    def buffer(self, rank: int, length: int) -> torch.Tensor:
        return self.values(rank, 0, length).to(self.dtype)

    def summed(self, start: int, length: int) -> torch.Tensor:
        """Elements [start, start + length) of the sum of every rank's buffer."""
        if not self.sums_exact:
            raise ConfigError(
                f"-d {str(self.dtype).removeprefix('torch.')} on {self.ranks} ranks: a sum over them is not exact in "
                f"this dtype (integers up to {EXACT[self.dtype]}), so a reduction cannot be checked; check the "
                "reductions with -d float32, or on fewer ranks"
            )
        total = torch.zeros(length, dtype=torch.int64, device=self.device)
        for r in range(self.ranks):
            total += self.values(r, start, length)
        return total.to(self.dtype)

    def gathered(self, pieces: list[tuple[int, int, int]]) -> torch.Tensor:
        """(rank, start, length) slices, concatenated: what an all-gather or all-to-all delivers."""
        parts = [self.values(r, s, n) for r, s, n in pieces]
        out = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=self.device)
        return out.to(self.dtype)
