"""Which rank owns which part of an embedding table, and the table's seeded initial values.

Row sharding gives rank r a contiguous range of the vocabulary (sizes differ by at most one
row); column sharding gives rank r the columns `[r * dim / world, (r + 1) * dim / world)` of
every row. Both are pure functions of (num_embeddings, embedding_dim, world size), so a
checkpoint written under one world size is re-cut under another without any collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparta.errors import ConfigError

SHARDINGS = ("row", "column")
_INIT_BLOCK_ROWS = 4096  # rows drawn per seeded generator; fixed so the table ignores world size


@dataclass(frozen=True)
class ShardLayout:
    """The cut of a `[num_embeddings, embedding_dim]` table over `world` ranks.

    `rank`'s shard is `table[row_start:row_end, col_start:col_end]`.
    """

    num_embeddings: int
    embedding_dim: int
    sharding: str
    world: int
    rank: int

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"sharding={self.sharding!r} is unknown; use one of {SHARDINGS}")
        if self.num_embeddings < 1 or self.embedding_dim < 1:
            raise ConfigError(
                f"num_embeddings={self.num_embeddings} and embedding_dim={self.embedding_dim} must both be >= 1"
            )
        if self.sharding == "row" and self.world > self.num_embeddings:
            raise ConfigError(
                f"row sharding of {self.num_embeddings} rows over a world of {self.world} ranks leaves ranks "
                f"without rows; use a vocabulary of at least {self.world} rows or sharding='column'"
            )
        if self.sharding == "column" and self.embedding_dim % self.world:
            raise ConfigError(
                f"column sharding needs embedding_dim ({self.embedding_dim}) divisible by the world size "
                f"({self.world}); pick a dim that is a multiple of {self.world} or use sharding='row'"
            )

    # ------------------------------------------------------------------ rows
    def row_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of the vocabulary rows `rank` holds (all rows under column sharding)."""
        if self.sharding == "column":
            return 0, self.num_embeddings
        base, extra = divmod(self.num_embeddings, self.world)
        start = rank * base + min(rank, extra)
        return start, start + base + (rank < extra)

    def row_boundaries(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Start row of ranks 1..world-1, on the ids' `device`, for
        `torch.bucketize(ids, ..., right=True)` -> owner."""
        return torch.tensor([self.row_range(r)[0] for r in range(1, self.world)], dtype=torch.int64, device=device)

    # --------------------------------------------------------------- columns
    @property
    def shard_dim(self) -> int:
        """Columns of each rank's shard."""
        return self.embedding_dim // self.world if self.sharding == "column" else self.embedding_dim

    def col_range(self, rank: int) -> tuple[int, int]:
        """The embedding columns ``(start, stop)`` rank ``rank`` holds (all of them when row-sharded)."""
        if self.sharding == "row":
            return 0, self.embedding_dim
        return rank * self.shard_dim, (rank + 1) * self.shard_dim

    # ---------------------------------------------------------------- shards
    @property
    def shard_shape(self) -> tuple[int, int]:
        """``[rows, columns]`` of this rank's shard."""
        start, end = self.row_range(self.rank)
        return end - start, self.shard_dim

    def cut(self, table: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full `[num_embeddings, embedding_dim]` table (a copy)."""
        (r0, r1), (c0, c1) = self.row_range(self.rank), self.col_range(self.rank)
        return table[r0:r1, c0:c1].clone()

    def join(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full table from every rank's shard, listed by rank."""
        return torch.cat(shards, dim=0 if self.sharding == "row" else 1)

    def seeded_shard(self, seed: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard of a N(0, 1) table drawn block by block from `seed`.

        Each block of `_INIT_BLOCK_ROWS` rows has its own generator, so the full table is
        the same for every world size and sharding, and a rank draws only the blocks its
        rows fall in (all of them under column sharding, keeping its columns).
        """
        (r0, r1), (c0, c1) = self.row_range(self.rank), self.col_range(self.rank)
        parts = []
        for block in range(r0 // _INIT_BLOCK_ROWS, (r1 - 1) // _INIT_BLOCK_ROWS + 1):
            b0 = block * _INIT_BLOCK_ROWS
            rows = min(_INIT_BLOCK_ROWS, self.num_embeddings - b0)
            gen = torch.Generator().manual_seed(seed + block)
            values = torch.randn(rows, self.embedding_dim, generator=gen, dtype=dtype)
            parts.append(values[max(r0 - b0, 0) : r1 - b0, c0:c1])
        return torch.cat(parts)
