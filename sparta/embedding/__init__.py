"""sparta.embedding: EmbRace-style sharded embeddings whose communication is sparse.

    emb = SparseEmbedding(50_000, 512, sharding="row", comm=world.comm)   # drop-in nn.Embedding
    y = emb(ids)                       # ids [batch, seq] per rank -> [batch, seq, 512]

Only the rows a step touches move (all-to-all to their owners, forward and backward).
`swap_embeddings(model, comm)` swaps a model's tables in place; the dense rest of the model is
data-parallel through `sparta.parallel.DataParallel` (DDP, Horovod, or the PriorityQueue, in
which the tables' row exchanges are tasks too).
VocabParallelHead and vocab_parallel_cross_entropy shard the output layer by vocabulary.
`state_dict()` is local (each rank's shard); `full_state_dict(model)`, called on every rank,
gathers the whole tables for a checkpoint saved from one rank.
"""

from sparta.embedding.checkpoint import full_state_dict
from sparta.embedding.layer import SparseEmbedding
from sparta.embedding.layout import SHARDINGS, ShardLayout
from sparta.embedding.swap import sharded_parameter_names, swap_embeddings
from sparta.embedding.vocab_parallel import VocabParallelHead, vocab_parallel_cross_entropy

__all__ = [
    "SHARDINGS",
    "ShardLayout",
    "SparseEmbedding",
    "VocabParallelHead",
    "full_state_dict",
    "sharded_parameter_names",
    "swap_embeddings",
    "vocab_parallel_cross_entropy",
]
