"""Expert parallelism inside data parallelism: the groups, and the gradient convention.

With ``world`` ranks and experts split over ``ep_size`` of them, ranks form
``world / ep_size`` expert-parallel groups of consecutive ranks (``[0, ep_size)``,
``[ep_size, 2 * ep_size)``, ...); the ranks holding the same experts (equal rank within
their group) form the expert-data-parallel groups that average those experts' gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from sparta.errors import ConfigError
from sparta.moe.layer import MoELayer

if TYPE_CHECKING:
    from sparta.comm import Communicator


@dataclass
class ExpertGroups:
    """This rank's communicators: ``ep`` (the ranks its experts are split over, pass it to
    ``MoELayer(comm=...)``) and ``expert_dp`` (the replicas of its experts; None when the
    world is one expert-parallel group)."""

    ep: Communicator
    expert_dp: Communicator | None


def expert_parallel_groups(comm: Communicator, ep_size: int) -> ExpertGroups:
    """Split ``comm`` into expert-parallel and expert-data-parallel groups. Collective: every
    rank of ``comm`` calls it with the same ``ep_size``."""
    if not isinstance(ep_size, int) or ep_size < 1 or comm.size % ep_size:
        raise ConfigError(
            f"ep_size={ep_size!r} does not divide the {comm.size} ranks: use a divisor of {comm.size} "
            "(each expert-parallel group holds every expert once)"
        )
    replicas = comm.size // ep_size
    ep = comm.split_groups([list(range(g * ep_size, (g + 1) * ep_size)) for g in range(replicas)])
    dp = comm.split_groups([list(range(i, comm.size, ep_size)) for i in range(ep_size)]) if replicas > 1 else None
    assert ep is not None  # every rank is in one group
    return ExpertGroups(ep=ep, expert_dp=dp)


def sharded_expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert weights of the MoE layers whose experts are split over ranks (``ep_size > 1``);
    every other parameter of ``model`` is replicated on every rank."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer) and m.comm is not None]
    return [p for layer in layers for p in layer.experts.parameters()]


def sync_gradients(
    model: nn.Module, comm: Communicator, expert_dp: Communicator | None = None, loss: Tensor | None = None
) -> tuple[float | None, Tensor]:
    """Turn this rank's gradients into those of the mean loss over the global batch, in place.

    Each rank back-propagated the mean loss ``L_r`` of its own batch (equal sizes); the
    objective is ``L = mean_r L_r`` over the ``comm.size`` ranks. Replicated weights get
    ``mean_r dL_r/dw``. A sharded expert already received, through the all-to-all backward,
    ``sum dL_r/dw`` over the ranks of its expert-parallel group; summing that over its
    replicas (``expert_dp``) and dividing by ``comm.size`` gives ``dL/dw``.

    Returns ``(L, global gradient norm)``; ``L`` is None without ``loss`` (this rank's
    ``L_r``). Collective over ``comm`` (one all-reduce) and, when given, ``expert_dp``.
    """
    experts = [p for p in sharded_expert_parameters(model) if p.grad is not None]
    sharded = {id(p) for p in sharded_expert_parameters(model)}
    dense = [p for p in model.parameters() if id(p) not in sharded and p.grad is not None]
    replicas = expert_dp.size if expert_dp is not None else 1
    if expert_dp is not None and experts:
        flat = expert_dp.all_reduce(torch.cat([p.grad.reshape(-1) for p in experts]), op="sum")
        _scatter(flat, experts)
    for p in experts:
        p.grad.div_(comm.size)
    device = next(model.parameters()).device
    expert_sq = sum((p.grad.float().square().sum() for p in experts), torch.zeros((), device=device))
    # One all-reduce over the world carries the dense gradients, the loss and the experts'
    # squared norm; replicas hold equal expert gradients, so "avg" of sq * size / replicas
    # is the sum over one expert-parallel group: every expert once.
    local_loss = torch.zeros((), device=device) if loss is None else loss.detach().float()
    extras = [local_loss.reshape(1), (expert_sq * comm.size / replicas).reshape(1)]
    parts = [p.grad.reshape(-1).float() for p in dense] + extras
    flat = comm.all_reduce(torch.cat(parts), op="avg")
    _scatter(flat, dense)
    dense_sq = flat[:-2].square().sum()
    return (float(flat[-2]) if loss is not None else None), (dense_sq + flat[-1]).sqrt()


def _scatter(flat: Tensor, params: list[nn.Parameter]) -> None:
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
        offset += p.numel()
