"""ParallelModel: this rank's stages of a parallelized model and the step that trains them."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import get_total_norm

from sparta.errors import InputError, SpartaError
from sparta.moe import MoELayer
from sparta.parallel.auto_schedule import AutoSchedule
from sparta.parallel.batches import Batches
from sparta.parallel.data_parallel import DataParallel
from sparta.parallel.dims import Layout
from sparta.parallel.experts import first_forwards_keep_loads
from sparta.parallel.forward_only import PeerStageFailure, forward_only
from sparta.parallel.pipeline import stage_owner
from sparta.parallel.stage_failure import lost_peer_stage, peer_stage_failure
from sparta.parallel.vocab_stages import HeadStage, token_loss
from sparta.scheduling.varlen import IGNORE_INDEX

if TYPE_CHECKING:
    from sparta.parallel.parallel_config import ParallelConfig
    from sparta.parallel.parallelize import ParallelPlan

# the tp style of an output head whose vocabulary is split over tp (parallelize's tp plan)
VOCAB_STYLE = "vocab"
# a rank's state after a validation pass: its stage failed, or a pipeline peer's failure reached it
_ORIGIN, _RELAY = 2, 1


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of logits [b, T, vocab] against targets [b, T], padding ignored.
    Logits split over the vocabulary (a DTensor, under `loss_parallel`) give the same loss,
    returned as the local tensor every tp rank holds alike."""
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    # a copy, not to_local()'s view: zero-bubble schedules detach the loss in place after
    # their input-gradient pass, which a view refuses
    return loss.to_local().clone() if isinstance(loss, DTensor) else loss


def step_loss(config: ParallelConfig) -> Callable[[Tensor, Tensor], Tensor]:
    """What the last stage's output and the targets give the loss by: under vocabulary
    stages the head stage hands on per-token losses already (`token_loss`), else logits."""
    return token_loss if config.vocab_stages else loss_fn


class ParallelModel:
    """This rank's part of the model and the step that trains it (built by `parallelize`).

    parts: this rank's stage modules (names as in the full model; possibly DDP/FSDP-wrapped).
    plan: the ParallelPlan (data). schedule: builds a torch pipelining schedule over fresh
    stages of ``parts``; called once per batch shape (`schedules` holds them), never where
    the model is one stage (`one_stage`). heads: this
    rank's head stages under ``config.vocab_stages`` (unwrapped), fed each step's targets.
    auto: the MoE layers whose co-scheduler degrees the first step tunes
    (``MoESpec.pipeline_degree="auto"``; `auto.plans` holds what each layer took), or None.
    num_ids, num_classes: the token embedding's rows and the output head's classes, which
    each batch's ids and targets are checked against (None: not checked; `batches` holds
    the rules a batch is checked and padded by).
    """

    def __init__(
        self,
        layout: Layout,
        config: ParallelConfig,
        parts: list[nn.Module],
        schedule: Callable[[], object],
        data_parallel: DataParallel,
        plan: ParallelPlan,
        has_first: bool,
        has_last: bool,
        heads: list[HeadStage] | None = None,
        auto: AutoSchedule | None = None,
        num_ids: int | None = None,
        num_classes: int | None = None,
    ) -> None:
        self.layout, self.config, self.parts, self._new_schedule = layout, config, parts, schedule
        # (batch, padded length) -> the schedule whose stages were shaped by such batches
        self.schedules: dict[tuple[int, int], object] = {}
        self.data_parallel, self.plan, self.heads = data_parallel, plan, heads or []
        self._loss_fn = step_loss(config)
        self._stepped: set[tuple[int, int]] = set()  # shapes whose schedule inferred its shapes
        self.has_first, self.has_last = has_first, has_last
        self._vocab_parallel = has_last and VOCAB_STYLE in plan.tp_plan.values()
        self.auto = auto
        self.batches = Batches(config.microbatches, tuple(config.lengths), config.seq_len, num_ids, num_classes)

    def param_groups(self) -> list[dict[str, Any]]:
        """This rank's parameters as optimizer groups, one per kind of tensor: plain tensors
        (experts, table shards, a replicated layer) and DTensors per device mesh (TP, FSDP2).
        torch's fused and foreach optimizers take one kind per call, and a plan mixes them
        ("got mixed torch.Tensor and DTensor"), so hand them these:
        ``torch.optim.AdamW(pm.param_groups(), lr=3e-4, fused=True)``. Groups are in first-
        parameter order and hold only ``{"params": [...]}``; add per-group options freely."""
        groups: dict[DeviceMesh | None, list[nn.Parameter]] = {}
        for p in self.parameters():
            groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        return [{"params": params} for params in groups.values()]

    def _loss_context(self) -> AbstractContextManager[None]:
        # the head's logits stay split over the vocabulary: torch's vocab-parallel cross-entropy
        return loss_parallel() if self._vocab_parallel else nullcontext()

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, each once. For an optimizer use `param_groups`: on CUDA,
        torch's optimizers default to foreach, which fails on plain tensors mixed with DTensors."""
        seen: set[nn.Parameter] = set()
        for module in self.parts:
            for p in module.parameters():
                if p not in seen:
                    seen.add(p)
                    yield p

    def moe_layers(self) -> list[MoELayer]:
        """This rank's MoE layers (for expert-load logging)."""
        return [m for module in self.parts for m in module.modules() if isinstance(m, MoELayer)]

    def train(self, mode: bool = True) -> ParallelModel:
        """Every stage module of this rank into training (or eval) mode, as `nn.Module.train`."""
        for module in self.parts:
            module.train(mode)
        return self

    def step(self, ids: Tensor, targets: Tensor) -> float:
        """Forward and backward over this rank's batch: ids, targets [B, T] int64, the same on
        the ranks of one data-parallel rank (pp and tp peers). Leaves in ``.grad`` the
        gradient of the mean loss over the global batch (every dp rank's B sequences) and
        returns that loss, from the last stage, on every rank. Does not step an optimizer.
        A bad batch on any rank (its shape, an id past the token embedding, a target past the
        head) raises the same InputError on every rank before anything else moves."""
        problem = self.batches.problem(ids, targets)
        shape = None if problem else (ids.shape[0], self.batches.padded_length(ids.shape[1]))
        new = self._agree_batch(problem, "ParallelModel.step", new=not self.one_stage and shape not in self.schedules)
        ids, targets = self.batches.padded(ids, targets)
        self.data_parallel.start()
        losses: list[Tensor] = []
        tune = self.auto is not None and self.auto.pending
        with self._loss_context(), self.auto.recording() if tune else nullcontext():  # type: ignore[union-attr]
            if self.one_stage:
                self._step_one_stage(ids, targets, losses)
            else:
                schedule = self._schedule(ids.shape[0], ids.shape[1], new)
                inference = tuple(ids.shape) not in self._stepped
                self._feed_heads(targets, inference)
                self._stepped.add(tuple(ids.shape))  # type: ignore[arg-type]
                args = (ids.to(self.layout.device),) if self.has_first else ()
                kwargs = {"target": targets.to(self.layout.device), "losses": losses} if self.has_last else {}
                # no outputs back: the last stage would keep every micro-batch's logits alive and
                # concatenate them (a copy of [B, T, vocab] a step) for a caller that reads losses only
                try:
                    with first_forwards_keep_loads(self.parts) if inference else nullcontext():
                        schedule.step(*args, return_outputs=False, **kwargs)  # type: ignore[attr-defined]
                except BaseException as exc:
                    self._drop_targets()  # a step that stopped half-way leaves none for the next
                    if lost_peer_stage(exc):
                        layout = self.layout
                        raise peer_stage_failure(
                            exc,
                            layout.world.rank,
                            self.plan.stage_ids,
                            dist.get_process_group_ranks(layout.pp_group),
                            layout.world.comm.config.timeout_s,
                        ) from exc
                    raise
        self._check_heads()
        self.data_parallel.finish()
        if tune:
            self.auto.tune()  # type: ignore[union-attr]
        return self._global_mean(losses)[0]

    @property
    def one_stage(self) -> bool:
        """The whole model is this rank's one stage (pp = 1, no vocabulary stages): `step`
        runs it without a pipelining schedule."""
        return self.layout.dims.pp == 1 and len(self.parts) == 1

    def _step_one_stage(self, ids: Tensor, targets: Tensor, losses: list[Tensor]) -> None:
        """Each micro-batch's forward and backward straight through the one stage (gradient
        accumulation), as a schedule of one stage would run them but for the data-parallel
        wrappers: torch's schedules turn FSDP2's gradient reduction off for every
        micro-batch and run it after the step's last backward, unoverlapped
        (`PipelineStage.perform_reduce_grad`); here FSDP2 reduce-scatters each unit's
        gradients as the last micro-batch's backward leaves it, and DDP's buckets go as they
        fill on the last one, as in a plain training loop (torchtitan's without pp)."""
        (module,) = self.parts
        m, device = self.config.microbatches, self.layout.device
        pieces = zip(ids.to(device).tensor_split(m), targets.to(device).tensor_split(m), strict=True)
        for i, (x, t) in enumerate(pieces):
            last = i == m - 1
            if isinstance(module, FSDPModule):
                # gathered from a backward to the next micro-batch's forward, reduced on the
                # last: m + 1 gathers a unit, as under torch's schedules (and the planner's model)
                module.set_requires_gradient_sync(last)
                module.set_reshard_after_backward(last)
            quiet = module.no_sync() if isinstance(module, DistributedDataParallel) and not last else nullcontext()
            with quiet:
                loss = self._loss_fn(module(x), t)
                loss.backward()
            losses.append(loss.detach())

    @torch.no_grad()
    def evaluate(self, ids: Tensor, targets: Tensor) -> float:
        """Forward only over this rank's batch (as `step` takes it); the mean loss over the
        global batch, from the last stage, on every rank. Touches no gradient.

        Failures: a bad batch raises as in `step`. A stage that fails raises its own error on
        its rank; every other rank raises one SpartaError naming the ranks where failures
        began and their reasons (its pipeline's forward-only pass ends early, the others'
        run to the end, and all meet at the loss's all-reduce, which carries who failed).
        A failure inside a collective with other pipelines' ranks (an expert exchange) ends at
        that communicator's timeout instead."""
        self._agree_batch(self.batches.problem(ids, targets), "ParallelModel.evaluate")
        ids, targets = self.batches.padded(ids, targets)
        m, dims, config = self.config.microbatches, self.layout.dims, self.config
        failure: Exception | None = None
        losses: list[Tensor] = []
        self._feed_heads(targets, inference=False)
        try:
            # not the schedule's eval(): torch 2.13's fails under V-shaped schedules (forward_only.py)
            with self._loss_context():
                losses = forward_only(
                    dict(zip(self.plan.stage_ids, self.parts, strict=True)),
                    dims.pp * config.stages_per_rank,
                    partial(stage_owner, config.schedule, dims.pp, stages_per_rank=config.stages_per_rank),
                    self.layout.pp_group if dims.pp > 1 else None,
                    ids.to(self.layout.device).tensor_split(m),
                    targets.to(self.layout.device).tensor_split(m),
                    self._loss_fn,
                )
            self._check_heads()
        except Exception as exc:
            failure = exc
            self._drop_targets()
        state = 0 if failure is None else _RELAY if isinstance(failure, PeerStageFailure) else _ORIGIN
        try:
            mean, states = self._global_mean(losses, state)
        except Exception:
            if failure is not None:
                # this rank's own error first, with the all-reduce's failure as its context
                raise failure  # noqa: B904
            raise
        origins = [r for r, s in enumerate(states) if s == _ORIGIN] or [r for r, s in enumerate(states) if s]
        if origins:
            self._agree_failure(failure, state, origins)
        return mean

    def _agree_failure(self, failure: Exception | None, state: int, origins: list[int]) -> None:
        """Raise on every rank after a failed forward-only pass: where it began (``origins``,
        world ranks), the rank's own error; elsewhere the one error naming them all."""
        comm = self.layout.world.comm
        reason: SpartaError | None = None
        if state == _ORIGIN and failure is not None:
            reason = (
                failure if isinstance(failure, SpartaError) else SpartaError(f"{type(failure).__name__}: {failure}")
            )
        try:
            comm.agree(reason, "ParallelModel.evaluate (the validation pass)", failed=origins)
        except SpartaError:
            if state == _ORIGIN and failure is not None:
                raise failure from None
            raise

    def _feed_heads(self, targets: Tensor, inference: bool) -> None:
        """Every head stage of this rank takes the step's targets, one per micro-batch
        (vocab_stages.py); ``inference``: the schedule's first step, whose shape inference
        runs one forward more."""
        chunks = targets.to(self.layout.device).tensor_split(self.config.microbatches)
        for head in self.heads:
            head.feed(chunks, inference)

    def _agree_batch(self, problem: InputError | None, op: str, new: bool = False) -> bool:
        """Collective over dp, before anything else moves: every rank raises ``problem``'s
        kind naming each dp rank whose batch is bad (a batch's pp and tp ranks hold it alike,
        so every group of the world agrees). Returns whether any dp rank's ``new`` is set (a
        batch shape it has no schedule for). One all-gather of two integers per rank (none
        where dp is 1)."""
        dp = self.layout.dp
        if dp.size == 1:  # agree() asks no engine of a group of one unless some rank failed
            dp.agree(problem, op)
            return new
        mine = torch.tensor([int(problem is not None), int(new)], dtype=torch.int64)
        rows = [row.tolist() for row in dp.all_gather(mine, sizes=[2] * dp.size, check=False)]  # type: ignore[union-attr]
        dp.agree(problem, op, failed=[r for r, row in enumerate(rows) if row[0]])
        return any(row[1] for row in rows)

    def _drop_targets(self) -> None:
        for head in self.heads:
            head.drop_pending()

    def _check_heads(self) -> None:
        left = {head.shard: head.pending for head in self.heads if head.pending}
        if left:
            self._drop_targets()
            raise InputError(
                f"head stages {sorted(left)} ran fewer forwards than micro-batches ({left} targets left): the "
                "schedule did not run each micro-batch once; vocab_stages needs every stage's forwards in order"
            )

    def _global_mean(self, losses: list[Tensor], state: int = 0) -> tuple[float, list[int]]:
        """The mean over the global batch of the last stage's micro-batch losses, and every
        world rank's ``state`` (0: fine), in one all-reduce."""
        comm, device = self.layout.world.comm, self.layout.device
        both = torch.zeros(1 + comm.size, dtype=torch.float64, device=device)
        if losses:
            both[0] = torch.stack(losses).detach().double().mean()
        both[1 + comm.rank] = state
        total = comm.all_reduce(both, op="sum", check=False).tolist()  # type: ignore[union-attr]
        dims = self.layout.dims
        return total[0] / (dims.dp * dims.tp), [int(s) for s in total[1:]]

    def _schedule(self, batch: int, length: int, new_somewhere: bool) -> object:
        """The schedule of batches [batch, length] (padded), built at the first such batch:
        torch's stages keep the shapes of their first step, which they learn by running it an
        extra time, with its stage's collectives (expert exchanges, FSDP2 gathers over dp).
        The dp ranks of a step may hold other shapes (documents, ragged batches), so where one
        of them meets a new shape (``new_somewhere``, from `_agree_batch`'s all-gather) every
        one builds its own shape's schedule anew: their extra runs pair up."""
        shape = (batch, length)
        fresh = shape not in self.schedules
        if new_somewhere and not fresh:
            self._stepped.discard(shape)
            fresh = True
        if fresh:
            self.schedules[shape] = self._new_schedule()
        return self.schedules[shape]

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every gradient so that their global norm (over all ranks, each value counted
        once) is at most ``max_norm``; returns the norm before clipping. Collective."""
        params = [p for p in self.parameters() if p.grad is not None]
        by_replicas: dict[int, list[Tensor]] = {}
        for p in params:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            by_replicas.setdefault(self.data_parallel.replicas(p), []).append(grad)
        # torch's fused norm per group, in the gradients' dtype as torch's own clip computes it: a
        # float64 copy of every gradient cost 21 ms a step on 10.5M parameters (CPU), this 6 ms
        square = torch.zeros((), dtype=torch.float64, device=self.layout.device)
        for replicas, grads in by_replicas.items():
            square += get_total_norm(grads).double().square() / replicas
        total = self._sum_over_world(square.reshape(1))
        norm = math.sqrt(float(total))  # type: ignore[arg-type]
        if norm > max_norm:
            factor = max_norm / (norm + 1e-6)
            for p in params:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                grad.mul_(factor)
        return norm

    def _sum_over_world(self, x: Tensor) -> Tensor:
        return self.layout.world.comm.all_reduce(x, op="sum")  # type: ignore[return-value]

    def close(self) -> None:
        """Remove the data-parallel hooks."""
        self.data_parallel.close()
