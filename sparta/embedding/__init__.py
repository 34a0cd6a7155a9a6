"""sparta.embedding: EmbRace-style sharded embeddings whose communication is sparse.

    emb = SparseEmbedding(50_000, 512, sharding="row", comm=world.comm)   # drop-in nn.Embedding
    y = emb(ids)                       # ids [batch, seq] per rank -> [batch, seq, 512]

Only the rows a step touches move (all-to-all to their owners, forward and backward); the
dense rest of a model stays on DDP / Horovod / PriorityQueue all-reduce (see `parallelize`).
VocabParallelHead and vocab_parallel_cross_entropy shard the output layer by vocabulary.
`state_dict()` is local (each rank's shard); `full_state_dict(model)`, called on every rank,
gathers the whole tables for a checkpoint saved from one rank.
"""

from sparta.embedding.checkpoint import full_state_dict
from sparta.embedding.layer import SparseEmbedding
from sparta.embedding.layout import SHARDINGS, ShardLayout
from sparta.embedding.optim import HybridOptimizer
from sparta.embedding.parallelize import parallelize, sharded_parameter_names, swap_embeddings
from sparta.embedding.queued import QueuedGradients
from sparta.embedding.vocab_parallel import VocabParallelHead, vocab_parallel_cross_entropy

__all__ = [
    "SHARDINGS",
    "HybridOptimizer",
    "QueuedGradients",
    "ShardLayout",
    "SparseEmbedding",
    "VocabParallelHead",
    "full_state_dict",
    "parallelize",
    "sharded_parameter_names",
    "swap_embeddings",
    "vocab_parallel_cross_entropy",
]
