"""ShardLayout and the one-process SparseEmbedding, without launching ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparta.comm.priority import QueueConfig
from sparta.embedding import ShardLayout, SparseEmbedding
from sparta.errors import ConfigError, InputError


@pytest.mark.parametrize("world", [1, 3, 4, 7])
def test_row_ranges_cover_the_vocabulary_and_cut_join_round_trips(world: int) -> None:
    table = torch.randn(10, 14)
    for sharding in ("row", "column") if 14 % world == 0 else ("row",):
        layouts = [ShardLayout(10, 14, sharding, world, r) for r in range(world)]
        assert torch.equal(layouts[0].join([lay.cut(table) for lay in layouts]), table)
    ranges = [ShardLayout(10, 14, "row", world, r).row_range(r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == 10
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    owners = torch.bucketize(torch.arange(10), ShardLayout(10, 14, "row", world, 0).row_boundaries(), right=True)
    assert all(ranges[o][0] <= i < ranges[o][1] for i, o in enumerate(owners.tolist()))


def test_seeded_table_ignores_world_size_and_sharding() -> None:
    vocab = 9000  # more than one init block
    full = ShardLayout(vocab, 4, "row", 1, 0).seeded_shard(5, torch.float32)
    for world, sharding in ((3, "row"), (2, "column"), (4, "column")):
        parts = [ShardLayout(vocab, 4, sharding, world, r).seeded_shard(5, torch.float32) for r in range(world)]
        assert torch.equal(ShardLayout(vocab, 4, sharding, world, 0).join(parts), full)


def test_bad_configurations_name_the_value_and_the_fix() -> None:
    with pytest.raises(ConfigError, match="embedding_dim \\(10\\) divisible by the world size \\(4\\)"):
        ShardLayout(100, 10, "column", 4, 0)
    with pytest.raises(ConfigError, match="over a world of 8 ranks"):
        ShardLayout(5, 10, "row", 8, 0)
    with pytest.raises(ConfigError, match="sharding='diagonal' is unknown"):
        ShardLayout(5, 10, "diagonal", 1, 0)
    with pytest.raises(ConfigError, match="padding_idx=7 is outside"):
        SparseEmbedding(5, 2, padding_idx=7)
    with pytest.raises(ConfigError, match="chunk_bytes=0"):
        QueueConfig(chunk_bytes=0)


def test_one_process_is_nn_embedding() -> None:
    table = torch.randn(20, 6)
    emb = SparseEmbedding.from_pretrained(table, freeze=False, padding_idx=-1)
    ref = torch.nn.Embedding.from_pretrained(table.clone(), freeze=False, padding_idx=19)
    ids = torch.tensor([[1, 19, 1], [0, 5, 19]])
    emb(ids).square().sum().backward()
    ref(ids).square().sum().backward()
    assert torch.equal(emb.weight.grad, ref.weight.grad)
    assert torch.equal(emb.state_dict()["weight"], table)
    with pytest.raises(InputError, match="got id 20, outside its vocabulary 0..19"):
        emb(torch.tensor([20]))
    with pytest.raises(InputError, match="dtype float32; ids must be integers"):
        emb(ids.float())
    torch.testing.assert_close(emb(ids), F.embedding(ids, table))
