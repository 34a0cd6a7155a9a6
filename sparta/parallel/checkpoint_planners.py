"""DCP planners for chunks of global tensors that a rank writes and reads at their offsets
(`Piece`: a SparseEmbedding or VocabParallelHead shard, or its optimizer state, under the
whole table's checkpoint key; see `checkpoint_state`).

``PieceSavePlanner`` / ``PieceLoadPlanner`` subclass DCP's public ``DefaultSavePlanner`` /
``DefaultLoadPlanner`` and add one write or read item per piece; DCP reads each chunk from
whatever chunks the checkpoint holds (its own resharding of overlapping regions), so a table
saved under one layout loads under any other, or into a plain ``nn.Embedding``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@dataclass(frozen=True)
class Piece:
    """A chunk of a global tensor that this rank writes or reads: ``local`` at ``offsets``."""

    local: Tensor
    offsets: tuple[int, ...]
    size: tuple[int, ...]


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus chunks of global tensors that this rank writes at
    their offsets (``pieces``: SparseEmbedding and VocabParallelHead shards and their
    optimizer state, keyed by their checkpoint key)."""

    def __init__(self, pieces: dict[str, Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [
            WriteItem(
                index=MetadataIndex(key, torch.Size(piece.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(piece.offsets), piece.local.shape),
                    properties=TensorProperties.create_from_tensor(piece.local),
                    size=torch.Size(piece.size),
                ),
            )
            for key, piece in self.pieces.items()
        ]
        self.plan = SavePlan([*plan.items, *items], storage_data=plan.storage_data, planner_data=plan.planner_data)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Tensor | io.BytesIO:
        piece = self.pieces.get(write_item.index.fqn)
        if piece is not None:
            return piece.local
        return super().resolve_data(write_item)


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus chunks of global tensors (``pieces``) that this rank
    reads in place from whatever chunks the checkpoint holds (DCP's own resharding of
    overlapping regions)."""

    def __init__(self, pieces: dict[str, Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items: list[ReadItem] = []
        for key, piece in self.pieces.items():
            md = self.metadata.state_dict_metadata[key] if self.metadata is not None else None
            assert isinstance(md, TensorStorageMetadata)
            chunk = ChunkStorageMetadata(torch.Size(piece.offsets), piece.local.shape)
            items.extend(create_read_items_for_chunk_list(key, md, [chunk]))
        return LoadPlan([*plan.items, *items], storage_data=plan.storage_data, planner_data=plan.planner_data)

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        piece = self.pieces.get(read_item.dest_index.fqn)
        if piece is None:
            return super().resolve_tensor(read_item)
        region = piece.local
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            region = region.narrow(dim, start, length)
        return region
