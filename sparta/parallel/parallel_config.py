"""`ParallelConfig`: how `parallelize` cuts and wraps a model for the 3D trainer, validated.

Its fields are data (schedule names, stage indices, strategy names); `check` adds the rules
that need the layout's degrees. Nothing here touches a process group, so every rank raises
the same ConfigError before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparta.errors import ConfigError
from sparta.parallel.dims import ParallelDims
from sparta.parallel.dp_rules import check_strategy
from sparta.parallel.experts import MoESpec
from sparta.parallel.pipeline import ZERO_BUBBLE, check_schedule

EMBEDDINGS = ("dense", "sparse")


@dataclass(frozen=True)
class ParallelConfig:
    """How `parallelize` cuts and wraps the model (the degrees are the Layout's).

    schedule: a torch.distributed.pipelining schedule (pipeline.SCHEDULES).
    microbatches: micro-batches per step; each rank's batch must divide by it.
    stages_per_rank: pipeline stages per rank (virtual stages; 2 for V schedules).
    split_points: layer names where stages 1.. begin, or None to balance by measured time.
    data_parallel: "ddp" | "fsdp" | "horovod" | "sparta" (see data_parallel.py).
    embedding: "dense" keeps nn.Embedding (replicated, all-reduced); "sparse" makes each a
        row-sharded SparseEmbedding over the data-parallel group.
    moe: MoESpec to turn MLPs into expert-parallel MoE layers, or None.
    tensor_parallel: apply the model's ``tp_plan`` when tp > 1.
    vocab_parallel_head: with tensor_parallel and tp > 1, split the output head by vocabulary
        over tp and compute the loss on the shards (see `tp_plan_of`); False keeps the head
        whole on every tp rank.
    seq_len: pad batches to this length (None: the first batch's length).
    lengths: the padded lengths the pipeline takes, instead of one ``seq_len``: a batch is
        padded to the smallest that holds it. torch's PipelineStage fixes its shapes at its
        first step, so each batch shape [B, length] gets its own stages and schedule over the
        same modules, built at its first batch, each with its own receive buffers (memory):
        keep the shapes few (`sparta.scheduling.bucketed_steps` makes a few per length).
    bucket_mb: bucket size of the "sparta" data-parallel strategy, MiB.
    bucket_per_layer: "sparta" closes a bucket at most every 1 / (layers + 1) of a rank's dense
        gradients (but never under 256 KiB, and at most bucket_mb; at a parameter's end), so
        that most layers' gradients are all-reduced while the layers before them run backward; False: buckets of
        bucket_mb only, so a model whose dense gradients fit one sends them all after
        backward (DeepSpeed's way; MoE GPT on 2 emulated nodes at 300 Mbit/s, dp4: 2.60 s a
        step with it, 2.82 s without).
    find_unused_parameters: "ddp" only: let torch DDP look for dense parameters no loss
        reached each step (its own flag; it walks the autograd graph every step, so leave it
        off unless the model has such parameters, which DDP otherwise refuses at the next
        step). The other strategies count those gradients as zero without being told.
        `parallelize` turns it on itself where a pipeline runs GPipe, an interleaved
        schedule or 1F1B with as many micro-batches as stages: there DDP's first bucket
        rebuild fails (`dp_rules.ddp_needs_find_unused`).
    vocab_stages: vocabulary parallelism over the pipeline ranks (vocab_stages.py): the
        output head split by vocabulary rows into pp stages, one per pipeline rank (the last
        round of a looped schedule, the second arm of a V), so the last stage stops carrying
        the whole head; the layers fill the other stages. Needs stages_per_rank >= 2 and an
        untied bias-free head. Under tp > 1 with ``vocab_parallel_head`` each stage's rows
        are cut over tp too; without, they are whole on every tp rank.
    embedding_stages: the same for the input embedding, at the front: the token embedding
        split by vocabulary rows into pp stages (global stages 0 .. pp - 1), so the first
        stage stops holding the whole table. Needs a looped schedule and stages_per_rank >= 3
        with vocab_stages (>= 2 without), and a plain ``nn.Embedding`` as the model's first
        child. The layers' stages then begin at global index pp (split_points and recompute
        name them as before: split points by layer, recompute by global stage index).
    recompute: global indices (0 .. pp * stages_per_rank - 1) of the stages whose ``layers.*``
        blocks keep only their inputs in forward and recompute the rest in backward
        (activation checkpointing, chosen per stage as Merak's stage-aware recomputation:
        stages with spare memory recompute less). Losses and gradients are unchanged; each
        recomputed block costs one more forward per micro-batch, but many more under the
        zero-bubble schedules: torch's weight-gradient pass runs one autograd.grad per
        parameter group, each recomputing the block (torch 2.13: 1 + 8 forwards per Decoder
        block, 1 + 9 with an MoE MLP). MoE layers re-issue their all-to-alls in each
        recomputation, in the same order on every rank; not with the "sigmoid" router,
        whose forward moves its balancing bias.
    """

    schedule: str = "1F1B"
    microbatches: int = 1
    stages_per_rank: int = 1
    split_points: tuple[str, ...] | None = None
    data_parallel: str = "sparta"
    embedding: str = "dense"
    moe: MoESpec | None = None
    tensor_parallel: bool = True
    vocab_parallel_head: bool = True
    seq_len: int | None = None
    lengths: tuple[int, ...] = ()
    bucket_mb: float = 25.0
    bucket_per_layer: bool = True
    find_unused_parameters: bool = False
    vocab_stages: bool = False
    embedding_stages: bool = False
    recompute: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.split_points is not None:
            object.__setattr__(self, "split_points", tuple(self.split_points))
        if not isinstance(self.recompute, (tuple, list)):
            raise ConfigError(f"recompute={self.recompute!r} must be a list of stage indices, e.g. [0] or []")
        for index in self.recompute:
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise ConfigError(f"recompute={list(self.recompute)} holds {index!r}: stage indices are integers >= 0")
        if len(set(self.recompute)) != len(self.recompute):
            raise ConfigError(f"recompute={list(self.recompute)} names a stage twice: list each stage once")
        object.__setattr__(self, "recompute", tuple(sorted(self.recompute)))
        if self.embedding not in EMBEDDINGS:
            raise ConfigError(f"embedding={self.embedding!r} is unknown; choose one of {', '.join(EMBEDDINGS)}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise ConfigError(f"seq_len={self.seq_len!r} must be a positive integer or None")
        self._check_lengths()
        if not self.bucket_mb > 0:
            raise ConfigError(f"bucket_mb={self.bucket_mb} must be > 0")
        if not isinstance(self.bucket_per_layer, bool):
            raise ConfigError(f"bucket_per_layer={self.bucket_per_layer!r}; use True or False")
        if self.find_unused_parameters and self.data_parallel != "ddp":
            raise ConfigError(
                f"find_unused_parameters=True is torch DDP's flag; data_parallel={self.data_parallel!r} counts the "
                "gradient of a parameter no loss reached as zero already: leave it False, or use 'ddp'"
            )
        check_schedule(self.schedule, 1, self.microbatches, self.stages_per_rank)

    def _check_lengths(self) -> None:
        if not isinstance(self.lengths, (tuple, list)):
            raise ConfigError(f"lengths={self.lengths!r} must be a list of sequence lengths, e.g. [128, 256, 512]")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.lengths):
            raise ConfigError(f"lengths={list(self.lengths)}: every length must be a positive integer")
        if len(set(self.lengths)) != len(self.lengths):
            raise ConfigError(f"lengths={list(self.lengths)} names a length twice: list each once")
        if self.lengths and self.seq_len is not None:
            raise ConfigError(
                f"seq_len={self.seq_len} and lengths={list(self.lengths)} both set: give seq_len for one padded "
                "length, or lengths for several"
            )
        object.__setattr__(self, "lengths", tuple(sorted(self.lengths)))

    def check(self, dims: ParallelDims, n_layers: int | None = None, backend: str | None = None) -> None:
        """ConfigError unless this configuration can run ``dims`` (and a model of ``n_layers``
        layers, on the world engine ``backend``, where given). Pure: call it on every rank
        before any collective; `parallelize` calls it too."""
        check_schedule(self.schedule, dims.pp, self.microbatches, self.stages_per_rank)
        check_strategy(self.data_parallel, self.schedule in ZERO_BUBBLE, dims.tp, backend)
        if self.moe is not None and self.moe.num_experts % dims.ep:
            raise ConfigError(
                f"MoESpec.num_experts={self.moe.num_experts} does not divide over ep={dims.ep} ranks: pick a multiple"
            )
        if dims.ep > 1 and self.moe is None:
            raise ConfigError(f"ep={dims.ep} but ParallelConfig.moe is None: there are no experts to split; set ep=1")
        if self.moe is not None and self.moe.auto and dims.ep == 1:
            raise ConfigError(
                "MoESpec.pipeline_degree='auto' tunes the experts' row exchange, but ep=1 leaves every expert on its "
                "rank (no exchange): set ep > 1, or pipeline_degree=1"
            )
        if self.moe is not None and self.moe.overlap_asked:
            why = overlap_refusal(self, dims)
            if why is not None:
                raise ConfigError(f"MoESpec.{self.moe.overlap_asked}: {why}; leave it off")
        stages = dims.pp * self.stages_per_rank
        body, first = self.body_stages(dims.pp), self.first_body(dims.pp)
        apart = [n for n in ("embedding_stages", "vocab_stages") if getattr(self, n)]
        if apart and self.stages_per_rank < 1 + len(apart):
            raise ConfigError(
                f"{' and '.join(apart)} put(s) {len(apart)} stage(s) on each pipeline rank beside its layers' stages: "
                f"needs stages_per_rank >= {1 + len(apart)} (got {self.stages_per_rank}) and a schedule of that many "
                "stages per rank (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble; V-shaped ones hold 2)"
            )
        if apart and self.recompute and not first <= self.recompute[0] <= self.recompute[-1] < first + body:
            wrong = next(i for i in self.recompute if not first <= i < first + body)
            raise ConfigError(
                f"recompute={list(self.recompute)} names stage {wrong}, an embedding or head stage "
                f"({' and '.join(apart)}), which has no layers to recompute: use indices {first}..{first + body - 1}"
            )
        if self.recompute and self.recompute[-1] >= stages:
            raise ConfigError(
                f"recompute={list(self.recompute)} names stage {self.recompute[-1]}, but the pipeline has {stages} "
                f"stage(s) (pp={dims.pp} x stages_per_rank={self.stages_per_rank}): use indices 0..{stages - 1}"
            )
        if self.recompute and self.moe is not None and self.moe.balances_by_load:
            # its forward moves the balancing bias in place: a recomputation would route with
            # the moved bias (other experts than the forward chose) and move it a second time
            raise ConfigError(
                f"recompute={list(self.recompute)} with MoESpec.router='sigmoid' would route the recomputation "
                "with a bias its forward already moved: set recompute=[] or pick another router"
            )
        if n_layers is not None and body > n_layers:
            heads = f", {stages - body} of them {' and '.join(apart)}" if apart else ""
            rest = f" for the other {body}" if apart else ""
            raise ConfigError(
                f"{stages} pipeline stages (pp={dims.pp} x stages_per_rank={self.stages_per_rank}{heads}) but the "
                f"model has {n_layers} layers{rest}: every stage needs one; lower pp or stages_per_rank"
            )

    def body_stages(self, pp: int) -> int:
        """How many stages hold the model's layers: all ``pp * stages_per_rank`` of them, less
        the ``pp`` head stages of ``vocab_stages`` and the ``pp`` of ``embedding_stages``."""
        return pp * (self.stages_per_rank - self.vocab_stages - self.embedding_stages)

    def first_body(self, pp: int) -> int:
        """The global index of the first stage holding layers (pp under ``embedding_stages``)."""
        return pp if self.embedding_stages else 0


def overlap_refusal(config: ParallelConfig, dims: ParallelDims) -> str | None:
    """Why the trainer cannot run its blocks over micro-batches (`MoESpec.overlap`, or the
    tuner's candidates) under ``config`` and ``dims``, or None. Pure."""
    if dims.ep == 1:
        return "ep=1 keeps every expert on its rank, so no rows travel to overlap"
    if config.tensor_parallel and dims.tp > 1 and config.moe is not None and config.moe.expert_tp:
        return f"tp={dims.tp} splits the experts' hidden units (expert_tp), whose partial sums run per layer"
    if config.schedule in ZERO_BUBBLE:
        return f"schedule {config.schedule!r} splits each backward into input and weight passes"
    if config.recompute:
        return f"recompute={list(config.recompute)} would run the micro-batches' exchanges again in backward"
    return None


def tunes_blocks(config: ParallelConfig, dims: ParallelDims) -> bool:
    """Whether ``pipeline_degree="auto"`` also times the MoE blocks over micro-batches: where
    they can overlap at all, and not under fsdp, where timing a block would run its unit's
    gathers outside the step. Pure."""
    return overlap_refusal(config, dims) is None and config.data_parallel != "fsdp"
