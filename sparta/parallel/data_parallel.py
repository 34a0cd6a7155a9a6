"""Data parallelism for the 3D trainer: one piece, four strategies, three kinds of parameter.

After a pipeline step every rank holds, for each of its parameters, the sum over its
micro-batches of the gradient of each micro-batch's mean loss. `DataParallel.finish` turns
that into the gradient of the mean loss over the global batch (dp ranks x micro-batches):

- dense parameters (replicated on the dp ranks; under TP, each rank's shard): averaged over
  the dp group, divided by the micro-batches;
- experts of expert-parallel MoE layers: the all-to-all backward already summed the
  gradients of every rank of the expert-parallel group, so they are summed over the
  expert's replicas only (``dp / ep`` ranks, never all dp: averaging them with other
  experts is the bug of pytorch/pytorch#160285) and divided by ``dp x micro-batches``;
- SparseEmbedding shards: their all-to-all already averaged over the dp group; divided by
  the micro-batches.

Strategies (for the dense parameters; experts and shards are always handled as above):
- "ddp": torch DistributedDataParallel around each stage module, the experts and shards
  excluded from its buckets. Its reduction runs in AccumulateGrad hooks, which zero-bubble
  schedules bypass, and it takes no DTensor: so it refuses those schedules and tp > 1.
- "fsdp": FSDP2 (``fully_shard``) on each layer and the stage, over the dp mesh, experts and
  shards ignored; torch's pipelining drives its reduce-scatter. Under zero-bubble schedules
  ``reshard_after_forward=False`` (with the default, their W gradients come out wrong:
  pytorch/pytorch#164756).
- "horovod": Horovod's grouped all-reduce over the dp process set after the step (the
  DistributedOptimizer's hooks would fire once per micro-batch, and not at all for
  zero-bubble W gradients). Needs the Horovod engine (horovodrun).
- "sparta": buckets of ``bucket_mb`` sent by the world's engine (any engine, MPI included)
  as soon as backward has accumulated every micro-batch into all of a bucket's parameters,
  so they overlap the rest of backward; buckets go in a fixed order (the reverse of the
  model's), and whatever hooks never completed (zero-bubble W gradients) goes at `finish`.

`DataParallel` owns its hooks; `close()` removes them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sparta.comm import Handle
from sparta.embedding import SparseEmbedding
from sparta.errors import ConfigError
from sparta.moe import MoELayer
from sparta.parallel.dims import Layout

STRATEGIES = ("ddp", "fsdp", "horovod", "sparta")


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters of the experts of ``module``'s expert-parallel MoE layers (``comm`` set)."""
    layers = [m for m in module.modules() if isinstance(m, MoELayer) and m.comm is not None]
    return [p for m in layers for p in m.experts.parameters()]


def shard_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The shards of ``module``'s SparseEmbeddings that are sharded over a group."""
    tables = [m for m in module.modules() if isinstance(m, SparseEmbedding) and m.comm is not None]
    return [p for m in tables for p in m.parameters()]


def check_strategy(strategy: str, zero_bubble: bool, tp: int, backend: str | None = None) -> None:
    """ConfigError unless ``strategy`` can run here (on engine ``backend``, where given). Pure."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"data_parallel={strategy!r} is unknown; choose one of {', '.join(STRATEGIES)}")
    if strategy == "ddp" and zero_bubble:
        raise ConfigError(
            "data_parallel='ddp' cannot run under a zero-bubble schedule: DDP reduces in AccumulateGrad hooks, "
            "which their weight-gradient passes never fire; use data_parallel='fsdp' or 'sparta'"
        )
    if strategy == "ddp" and tp > 1:
        raise ConfigError(
            f"data_parallel='ddp' with tp={tp}: torch DDP takes no DTensor parameters; use 'fsdp' (FSDP2 composes "
            "with tensor parallelism) or 'sparta'"
        )
    if strategy == "horovod" and backend not in (None, "horovod"):
        raise ConfigError(
            f"data_parallel='horovod' needs the Horovod engine (launch with horovodrun), but the world runs "
            f"{backend!r}; use 'sparta', which runs on every engine"
        )


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    handle: Handle[torch.Tensor] | None = None


class DataParallel:
    """Gradient reduction over ``layout``'s data-parallel groups (see the module docstring).

    Call `wrap` on each stage module before building its PipelineStage, `start` before each
    step, `finish` after it (collective over the dp group: every rank of it calls it).
    """

    def __init__(
        self, layout: Layout, strategy: str, microbatches: int, zero_bubble: bool, bucket_mb: float = 25.0
    ) -> None:
        check_strategy(strategy, zero_bubble, layout.dims.tp, layout.world.backend)
        self.layout, self.strategy, self.microbatches = layout, strategy, microbatches
        self.zero_bubble, self.bucket_bytes = zero_bubble, int(bucket_mb * 2**20)
        self.experts: list[nn.Parameter] = []
        self.shards: list[nn.Parameter] = []
        self.dense: list[nn.Parameter] = []
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[nn.Parameter, int] = {}
        self._arrivals: dict[nn.Parameter, int] = {}
        self._issued = 0
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def wrap(self, module: nn.Module) -> nn.Module:
        """Take charge of ``module``'s gradients; returns the module the stage should run."""
        experts, shards = expert_parameters(module), shard_parameters(module)
        special = set(experts) | set(shards)
        self.experts += experts
        self.shards += shards
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            names = [n for n, p in module.named_parameters() if p in special]
            # the one way DDP takes parameters it must not reduce (as sparta.embedding.parallelize does)
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
            module = DistributedDataParallel(
                module, process_group=self.layout.mesh.get_group("dp"), broadcast_buffers=False
            )
        elif self.strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            mesh, reshard = self.layout.dp_mesh, not self.zero_bubble
            for layer in getattr(module, "layers", {}).values():
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, ignored_params=special)
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, ignored_params=special)
        # after wrapping: FSDP2 replaces the parameters by sharded ones
        dense = [p for p in module.parameters() if p.requires_grad and p not in special]
        self.dense += dense
        if self.strategy == "sparta":
            self._add_buckets(dense)
        return module

    def _add_buckets(self, params: list[nn.Parameter]) -> None:
        # backward produces the last layers' gradients first: bucket in reverse order
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):
            current.append(p)
            size += _local(p).numel() * p.element_size()
            if size >= self.bucket_bytes:
                self._buckets.append(_Bucket(current))
                current, size = [], 0
        if current:
            self._buckets.append(_Bucket(current))
        for index, bucket in enumerate(self._buckets):
            for p in bucket.params:
                self._bucket_of[p] = index
        self._hooks += [p.register_post_accumulate_grad_hook(self._arrived) for p in params]

    def start(self) -> None:
        """Begin a step (before the schedule runs)."""
        self._arrivals = {}
        self._issued = 0
        for bucket in self._buckets:
            bucket.handle = None

    def _arrived(self, p: torch.Tensor) -> None:
        self._arrivals[p] = self._arrivals.get(p, 0) + 1  # type: ignore[index]
        # buckets leave in index order on every rank, as soon as each is complete
        while self._issued < len(self._buckets) and all(
            self._arrivals.get(q, 0) == self.microbatches for q in self._buckets[self._issued].params
        ):
            self._issue(self._buckets[self._issued])
            self._issued += 1

    def _issue(self, bucket: _Bucket) -> None:
        flat = torch.cat([_local_grad(p).reshape(-1) for p in bucket.params])
        bucket.handle = self.layout.dp.all_reduce(flat, op="sum", async_op=True)  # type: ignore[assignment]

    def finish(self) -> None:
        """Complete this step's reductions and scale every gradient to the global-batch mean."""
        dims, mb = self.layout.dims, self.microbatches
        with torch.no_grad():
            if self.strategy == "sparta":
                for bucket in self._buckets[self._issued :]:
                    self._issue(bucket)
                self._issued = len(self._buckets)
                for bucket in self._buckets:
                    assert bucket.handle is not None
                    _scatter(bucket.handle.wait(), bucket.params, 1.0 / (dims.dp * mb))
            elif self.strategy == "horovod":
                self._horovod_all_reduce([p for p in self.dense if p.grad is not None], 1.0 / (dims.dp * mb))
            else:  # ddp, fsdp: torch averaged over dp
                _scale([p for p in self.dense if p.grad is not None], 1.0 / mb)
            experts = [p for p in self.experts if p.grad is not None]
            if self.layout.expert_dp is not None and experts:
                flat = torch.cat([_local_grad(p).reshape(-1) for p in experts])
                _scatter(self.layout.expert_dp.all_reduce(flat, op="sum"), experts, 1.0 / (dims.dp * mb))  # type: ignore[arg-type]
            else:
                _scale(experts, 1.0 / (dims.dp * mb))
            _scale([p for p in self.shards if p.grad is not None], 1.0 / mb)

    def _horovod_all_reduce(self, params: list[nn.Parameter], scale: float) -> None:
        import horovod.torch as hvd

        grads = [_local_grad(p) for p in params]
        process_set = self.layout.dp.process_set  # type: ignore[attr-defined]
        reduced = hvd.grouped_allreduce(grads, op=hvd.Sum, process_set=process_set, postscale_factor=scale)
        for grad, value in zip(grads, reduced, strict=True):
            grad.copy_(value)

    def replicas(self, p: nn.Parameter) -> int:
        """How many ranks of this stage hold the same values as this rank's ``p`` (for norms)."""
        dims = self.layout.dims
        if p in set(self.experts):
            split = dims.ep
        elif p in set(self.shards):
            split = dims.dp
        elif isinstance(p, DTensor):
            split = 1
            for size, placement in zip(p.device_mesh.shape, p.placements, strict=True):
                split *= size if placement.is_shard() else 1
        else:
            split = 1
        return dims.dp * dims.tp // split

    def close(self) -> None:
        """Remove the gradient hooks (the "sparta" strategy's)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_grad(p: nn.Parameter) -> torch.Tensor:
    assert p.grad is not None
    return _local(p.grad)


def _scale(params: Iterable[nn.Parameter], factor: float) -> None:
    for p in params:
        _local_grad(p).mul_(factor)


def _scatter(flat: torch.Tensor, params: list[nn.Parameter], factor: float) -> None:
    offset = 0
    for p in params:
        grad = _local_grad(p)
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad)).mul_(factor)
        offset += grad.numel()
