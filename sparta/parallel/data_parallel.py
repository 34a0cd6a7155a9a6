"""Data parallelism: one piece, four strategies, three kinds of parameter. The only owner of
gradient hooks in Sparta.

After a step every rank holds, for each of its parameters, the sum over its micro-batches of
the gradient of each micro-batch's mean loss. `DataParallel.finish` turns that into the
gradient of the mean loss over the global batch (dp ranks x micro-batches):

- dense parameters (replicated on the dp ranks; under TP, each rank's shard): averaged over
  the dp group, divided by the micro-batches;
- experts of expert-parallel MoE layers: the all-to-all backward already summed the
  gradients of every rank of the expert-parallel group, so they are summed over the
  expert's replicas only (``dp / ep`` ranks, never all dp: averaging them with other
  experts is the bug of pytorch/pytorch#160285) and divided by ``dp x micro-batches``;
- shards of SparseEmbeddings and VocabParallelHeads: their all-to-all already averaged over
  the dp group; divided by the micro-batches.

Experts whose hidden units are split over tp (``GroupedExperts.split_ff``) follow the same
rules: the tp ranks hold different slices, so no sum runs over tp, and `replicas` does not
count the tp ranks for them.

`wrap` refuses (ConfigError) an expert-parallel MoE layer whose group is not the layout's
``ep`` and a sharded table or head whose group is not its ``dp``: their gradients would be
scaled for another group than the one they were summed over, i.e. silently averaged with
other experts' or other shards' (a Hugging Face GPT-2 moeified over one group and
data-parallel over another trained 2.6e-3 away from one process in 5 steps that way).

Strategies (for the dense parameters; experts and shards are always handled as above):
- "ddp": torch DistributedDataParallel around each module, the experts and shards excluded
  from its buckets. Its reduction runs in AccumulateGrad hooks, which zero-bubble schedules
  bypass, and it takes no DTensor: so it refuses those schedules and tp > 1. Under schedules
  whose first step runs two backwards of a stage with no forward between them, `parallelize`
  turns its find_unused_parameters on (`dp_rules.ddp_needs_find_unused`).
- "fsdp": FSDP2 (``fully_shard``) over the dp mesh on the units of `fsdp_units` (each
  layer; the token embedding; the final norm and head together, not resharded after
  forward) and the module, experts and shards ignored; torch's pipelining drives its
  reduce-scatter. Under zero-bubble schedules
  ``reshard_after_forward=False`` (with the default, their W gradients come out wrong:
  pytorch/pytorch#164756).
- "horovod": Horovod's grouped all-reduce over the dp process set at `finish` (the
  DistributedOptimizer's hooks would fire once per micro-batch, and not at all for
  zero-bubble W gradients). Needs the Horovod engine (horovodrun).
- "sparta": buckets of ``bucket_mb`` on the world's engine (any engine, MPI included), each
  sent as soon as backward has accumulated every micro-batch into all of its parameters, so
  they overlap the rest of backward; whatever hooks never completed (zero-bubble W
  gradients, a parameter no loss used) goes at `finish`. With ``queue=True`` (the default)
  the buckets are tasks of a `sparta.comm.PriorityQueue` over the dp group (EmbRace's 2D
  scheduling: keyed by their position in the next forward, chunked by ``queue_config``), and
  with ``microbatches == 1`` the SparseEmbeddings' row exchanges are tasks of the same queue
  (`SparseEmbedding.defer_gradients`): backward hands them over and goes on, and the rows,
  first in the next forward, overtake every dense chunk not yet issued. ``queue=False``
  sends the buckets straight to the engine in backward order and exchanges the rows inside
  backward (`parallelize` takes the queue only where such rows share it: alone, its flow
  control only stalled the hooks). Either way the bucket sizes are agreed across the dp
  ranks once, at the first step, and each bucket is summed in place (donated), with no
  per-step check or copy. ``partition`` (a `sparta.scheduling.GradientPartition`) replaces the buckets by
  the cost model's pieces, released into the network gaps of an MoE layer's pipelined
  backward (`sparta.scheduling.GapRelease`; give the layer ``dp.watch(exchange)``). The
  buckets and their hooks are `grad_buckets.GradBuckets`.

Without a pipeline, in a plain training loop (any model; a Communicator per group from
`build_layout`):

    layout = build_layout(ParallelDims(dp=world.size, ep=4), world)
    moeify(model, 8, 2, comm=layout.ep, ep_size=4)            # experts over 4 ranks
                                    # (router="sigmoid" with dp > ep: stats_comm=layout.dp)
    swap_embeddings(model, layout.dp)                          # tables sharded over dp
    dp = DataParallel(layout, "sparta", microbatches=1, zero_bubble=False)
    model = dp.wrap(model)                                     # DDP-wrapped for "ddp"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)      # a plain torch optimizer
    for ids, targets in data:                                  # this rank's share of the batch
        dp.start(); loss = loss_fn(model(ids), targets); loss.backward(); dp.finish()
        opt.step(); opt.zero_grad()                            # = one process on the global batch
    dp.close()

With gradient accumulation pass ``microbatches=N`` and run N forward/backward pairs between
`start` and `finish` (under "ddp", `model.no_sync()` spares the first N-1 all-reduces).

What went, and why (issue 23): the deferred dense step (each dense module stepped in the
next forward's pre-hook, so that the lookups overlapped the last dense all-reduces). What it
can hide is the dense all-reduce still running when backward ends, and with the queue
issuing chunks during backward that was little: on the embedding benchmark's model (2
ranks, vocabulary 50,000, 8 x 512 Zipf ids, a 512-512-512 block, 256 KiB chunks) the wait
for the dense gradients after backward took 1.3 ms (median of 24 steps; max 32 ms) of a
0.3-1.1 s step, on this shared 2-core machine. Against that: a pre-hook on every module,
stale weights for code reading them between steps, ``.grad`` holding the local gradient,
no LBFGS, and nothing to defer in the trainer at all, whose global-norm clipping reads
every reduced gradient before any step.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sparta.comm import Exchange, Handle
from sparta.comm.priority import PriorityQueue, QueueConfig, TaskKey
from sparta.embedding import SparseEmbedding
from sparta.errors import ConfigError, InputError
from sparta.moe import GroupedExperts
from sparta.parallel.dims import Layout
from sparta.parallel.dp_rules import check_groups, check_strategy, expert_parameters, fsdp_units, shard_parameters
from sparta.parallel.grad_buckets import GradBuckets, local_grad, local_tensor, scale_grads, unflatten_into
from sparta.parallel.vocab_stages import VocabShard
from sparta.scheduling.grad_sync import GapRelease
from sparta.scheduling.partition import GradientPartition
from sparta.scheduling.trace import ObservedExchange


class DataParallel:
    """Gradient reduction over ``layout``'s data-parallel groups (see the module docstring).

    microbatches: forward/backward pairs per step (the pipeline's micro-batches, or
        gradient accumulation); zero_bubble: the schedule computes weight gradients apart
        (hooks never see them). bucket_mb: "sparta"'s bucket size in MiB; bucket_shares:
        "sparta" closes a bucket at most every 1 / bucket_shares of the dense gradients
        (`GradBuckets`).
    queue: "sparta" sends through a PriorityQueue (True) or straight to the engine (False);
        queue_config: its chunking and schedule. partition / openings: "sparta" sends the
        dense gradients in these pieces, released in an MoE layer's backward gaps (see
        `watch`), instead of buckets. find_unused_parameters: "ddp" only, torch DDP's flag (for
        dense parameters some step's loss does not reach).
    Call `wrap` on each module that trains (each pipeline stage) before its first forward,
    `start` before each step's backward, `finish` after it (collective over the dp group:
    every rank of it calls it), `close` at the end.
    """

    def __init__(
        self,
        layout: Layout,
        strategy: str,
        microbatches: int,
        zero_bubble: bool,
        bucket_mb: float = 25.0,
        *,
        queue: bool = True,
        queue_config: QueueConfig | None = None,
        partition: GradientPartition | None = None,
        openings: Sequence[int] = (),
        find_unused_parameters: bool = False,
        bucket_shares: int = 1,
    ) -> None:
        check_strategy(strategy, zero_bubble, layout.dims.tp, layout.world.backend)
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ConfigError(f"DataParallel(microbatches={microbatches!r}): use a positive integer")
        if not bucket_mb > 0:
            raise ConfigError(f"DataParallel(bucket_mb={bucket_mb!r}): use a positive size in MiB")
        if not isinstance(bucket_shares, int) or isinstance(bucket_shares, bool) or bucket_shares < 1:
            raise ConfigError(f"DataParallel(bucket_shares={bucket_shares!r}): use a positive integer")
        sparta_only = partition is not None or queue_config is not None or not queue or bucket_shares != 1
        if strategy != "sparta" and sparta_only:
            raise ConfigError(
                "queue, queue_config, partition and bucket_shares choose how data_parallel='sparta' sends; "
                f"with {strategy!r} leave them out, or pass strategy 'sparta'"
            )
        if find_unused_parameters and strategy != "ddp":
            raise ConfigError(
                f"DataParallel(find_unused_parameters=True) is torch DDP's flag; {strategy!r} counts the gradient of "
                "a parameter no loss reached as zero already: leave it False, or use strategy 'ddp'"
            )
        if partition is not None and bucket_shares != 1:
            raise ConfigError("partition= cuts the dense gradients itself: leave bucket_shares out, or the partition")
        if partition is not None and (zero_bubble or microbatches > 1):
            raise ConfigError(
                "partition= releases gradient pieces into one backward's network gaps: it needs microbatches=1 and "
                "no zero-bubble schedule; leave it out (buckets) for pipelines"
            )
        self.layout, self.strategy, self.microbatches = layout, strategy, microbatches
        self.zero_bubble, self.bucket_bytes = zero_bubble, int(bucket_mb * 2**20)
        self.find_unused_parameters = find_unused_parameters
        # one data-parallel rank and no table rows to queue: nothing to send, only the scaling (a
        # sum over one rank would still copy every gradient twice: 10% of a small MoE model's step)
        self._alone = (
            layout.dims.dp == 1 and partition is None
            and (strategy == "horovod" or (strategy == "sparta" and (not queue or microbatches > 1)))
        )  # fmt: skip
        self.experts: list[nn.Parameter] = []
        self.shards: list[nn.Parameter] = []
        self.dense: list[nn.Parameter] = []
        self._expert_set: set[nn.Parameter] = set()
        self._shard_set: set[nn.Parameter] = set()
        self._tp_split: set[nn.Parameter] = set()  # experts' weights cut over tp (distinct per tp rank)
        self._names: dict[nn.Parameter, str] = {}
        self._order: dict[nn.Parameter, int] = {}  # position in the forward, over every wrapped module
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._started = False
        # "sparta"
        self.queue = PriorityQueue(layout.dp, queue_config) if strategy == "sparta" and queue else None
        self.tables: list[tuple[SparseEmbedding, TaskKey]] = []
        self.release = GapRelease(partition, openings) if partition is not None else None
        self.buckets = (
            GradBuckets(
                layout.dp,
                microbatches,
                self.bucket_bytes,
                self.queue,
                self.release,
                self._order,
                self._names,
                bucket_shares,
            )
            if strategy == "sparta" and not self._alone
            else None
        )

    # ------------------------------------------------------------------ setup
    def wrap(self, module: nn.Module) -> nn.Module:
        """Take charge of ``module``'s gradients; returns the module to run (DDP-wrapped
        under "ddp"). Checks first (ConfigError), then, under "sparta" and "horovod", sets
        the dense parameters to the dp group's first rank's (DDP does the same)."""
        check_groups(module, self.layout)
        experts, shards = expert_parameters(module), shard_parameters(module)
        special = set(experts) | set(shards)
        self.experts += experts
        self.shards += shards
        self._expert_set.update(experts)
        self._shard_set.update(shards)
        for name, p in module.named_parameters():
            self._names.setdefault(p, name)
            self._order.setdefault(p, len(self._order))
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            names = [n for n, p in module.named_parameters() if p in special]
            # the one way DDP takes parameters it must not reduce
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
            # no buffer broadcast each forward: it would be one more collective per micro-batch,
            # and the one buffer Sparta keeps (the sigmoid router's bias) starts equal and stays
            # so through its own counts' all-reduce. torch 2.13 names the flag
            # forward_sync_buffers (broadcast_buffers warns there); torch >= 2.4 before it has
            # only broadcast_buffers
            accepted = inspect.signature(DistributedDataParallel.__init__).parameters
            flag = "forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers"
            module = DistributedDataParallel(
                module,
                process_group=self.layout.mesh.get_group("dp"),
                find_unused_parameters=self.find_unused_parameters,
                **{flag: False},
            )
        elif self.strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            mesh, reshard = self.layout.dp_mesh, not self.zero_bubble
            for units, after in fsdp_units(module, special):
                fully_shard(units, mesh=mesh, reshard_after_forward=reshard and after, ignored_params=special)
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, ignored_params=special)
        # after wrapping: FSDP2 replaces the parameters by sharded ones
        dense = [p for p in module.parameters() if p.requires_grad and p not in special]
        split = [m for m in module.modules() if isinstance(m, GroupedExperts)]
        self._tp_split.update(p for m in split for _, p in m.split_weights())
        # vocabulary stages' rows cut over tp (vocab_stages.py): each tp rank holds others
        self._tp_split.update(m.weight for m in module.modules() if isinstance(m, VocabShard) and m.split_over_tp)
        self.dense += dense
        if self.strategy in ("sparta", "horovod"):
            self._broadcast(dense)
        if self.buckets is not None:
            self._hooks += self.buckets.add(dense)
            if self.queue is not None and self.microbatches == 1:
                for path, m in module.named_modules():
                    if isinstance(m, SparseEmbedding) and m.comm is not None and m.weight.requires_grad:
                        key = TaskKey(self._order[m.weight], f"table {len(self.tables)} {path}")
                        m.defer_gradients(self.queue, key)
                        self.tables.append((m, key))
        return module

    @torch.no_grad()
    def _broadcast(self, params: list[nn.Parameter]) -> None:
        if self.layout.dims.dp == 1 or not params:
            return
        for dtype in dict.fromkeys(p.dtype for p in params):
            group = [p for p in params if p.dtype == dtype]
            flat = torch.cat([local_tensor(p.detach()).reshape(-1) for p in group])
            got = self.layout.dp.broadcast(flat, src=0)
            assert isinstance(got, torch.Tensor)
            unflatten_into(got, [(local_tensor(p.data), 0, local_tensor(p).numel()) for p in group])

    def watch(self, exchange: Exchange) -> ObservedExchange:
        """``exchange`` (the MoE layer's, any sparta.comm.Exchange) reporting its transfers to
        the partition's release: hand the layer / pipeline this instead (needs partition=)."""
        if self.release is None:
            raise ConfigError("DataParallel.watch needs partition= (the pieces released into the exchange's gaps)")
        return self.release.watch(exchange)

    # ------------------------------------------------------------------- step
    def start(self) -> None:
        """Begin a step (before its backward runs; its forward may come before or after)."""
        self._started = True
        if self.buckets is None:
            return
        self.buckets.start()
        if self.queue is not None:
            keys = self.buckets.keys + [key for _, key in self.tables]
            # declared ready as backward makes them: the last layers' first, the tables' last
            ready = sorted(keys, key=lambda k: (-k.priority, k.name))
            self.queue.expect(keys, ready)

    def finish(self) -> None:
        """Complete this step's reductions and scale every gradient to the global-batch mean.
        Collective over the dp group (and the experts' replicas)."""
        if not self._started:
            raise InputError("DataParallel.finish() without start(); call start() before each step's backward")
        self._started = False
        dims, mb = self.layout.dims, self.microbatches
        with torch.no_grad():
            # a parameter no loss reached counts zero, so that every rank sends the same tensors
            # (the experts always: their sum over replicas is ours under every strategy)
            ours = self.dense if self.strategy in ("sparta", "horovod") and not self._alone else []
            for p in (*ours, *self.experts):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            experts = self._start_experts()
            if self.buckets is not None:
                self._finish_sparta(self.buckets, 1.0 / (dims.dp * mb))
            elif self._alone:
                scale_grads([p for p in self.dense if p.grad is not None], 1.0 / mb)
            elif self.strategy == "horovod":
                self._horovod_all_reduce([p for p in self.dense if p.grad is not None], 1.0 / (dims.dp * mb))
            else:  # ddp, fsdp: torch averaged over dp
                scale_grads([p for p in self.dense if p.grad is not None], 1.0 / mb)
            if experts is not None:
                params, handle = experts
                unflatten_into(handle.wait(), [(local_grad(p), 0, local_grad(p).numel()) for p in params])
            scale_grads([p for p in self.experts if p.grad is not None], 1.0 / (dims.dp * mb))
            scale_grads([p for p in self.shards if p.grad is not None], 1.0 / mb)

    def _start_experts(self) -> tuple[list[nn.Parameter], Handle[torch.Tensor]] | None:
        """The experts' sum over their replicas, issued (None where they have none)."""
        experts = [p for p in self.experts if p.grad is not None]
        if self.layout.expert_dp is None or not experts:
            return None
        flat = torch.cat([local_grad(p).reshape(-1) for p in experts])
        return experts, self.layout.expert_dp.all_reduce(flat, op="sum", async_op=True)  # type: ignore[return-value]

    def _finish_sparta(self, buckets: GradBuckets, scale: float) -> None:
        buckets.complete_rest()
        for table, key in self.tables:
            if self.queue is not None and self.queue.expects(key):  # no lookup this step: an empty exchange
                empty = table.weight.new_zeros(0, table.embedding_dim)
                zeros = [0] * self.layout.dp.size
                self.queue.submit(key, empty, op="all_to_all", send_splits=zeros, recv_splits=zeros).wait()
        buckets.finish(scale)
        for table, _ in self.tables:
            table.finish_gradients()

    def _horovod_all_reduce(self, params: list[nn.Parameter], scale: float) -> None:
        grads = [local_grad(p) for p in params]
        reduced = self.layout.dp.grouped_sum(grads, scale)  # type: ignore[attr-defined]
        for grad, value in zip(grads, reduced, strict=True):
            grad.copy_(value)

    # ---------------------------------------------------------------- queries
    def replicas(self, p: nn.Parameter) -> int:
        """How many ranks of this stage hold the same values as this rank's ``p`` (for norms)."""
        dims = self.layout.dims
        if p in self._expert_set:
            split = dims.ep
        elif p in self._shard_set:
            split = dims.dp
        elif isinstance(p, DTensor):
            split = 1
            for size, placement in zip(p.device_mesh.shape, p.placements, strict=True):
                # any placement but Replicate splits (Shard, and FSDP2's _StridedShard under TP)
                split *= 1 if placement.is_replicate() else size
        else:
            split = 1
        if p in self._tp_split:
            split *= dims.tp
        return dims.dp * dims.tp // split

    def close(self) -> None:
        """Remove the gradient hooks and hand the tables' exchanges back to their backward."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for table, _ in self.tables:
            table.defer_gradients(None)
        self.tables = []
        self._started = False
        if self.buckets is not None:
            self.buckets.stop()
