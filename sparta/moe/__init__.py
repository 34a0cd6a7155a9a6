"""Mixture-of-Experts layers.

``MoELayer(d_model, d_ff, num_experts, ...)`` maps ``[..., d_model]`` activations to the same
shape. Inside, for ``T`` tokens, ``E`` experts and ``k`` experts per token:

- a router (``TopKRouter``, ``SwitchRouter``, ``SigmoidRouter``, ``XMoERouter``,
  ``ExpertChoiceRouter``, ``SoftRouter``) turns ``[T, d_model]`` into a ``RouterOutput``:
  flat (token, expert, weight) pairs ``[P]`` (``P = T * k`` for token choice) plus float32
  logits ``[T, E]`` and unscaled scalar aux / z losses;
- ``plan_dispatch`` sorts the pairs by expert and applies the capacity, giving counts ``[E]``
  and the grouped order (``N = P`` pairs dropless, fewer with a capacity); ``dispatch``
  also gathers the rows ``[N, d_model]`` (``gather_rows``: dropless token choice is a
  permutation, gathered both ways, forward and backward, with no atomic index-add);
- ``GroupedExperts`` runs every expert's MLP (with biases if ``expert_bias=True``) on its
  rows, each GEMM of all experts one ``torch.nn.functional.grouped_mm``;
- ``combine`` adds the weighted outputs back into token order ``[T, d_model]``.

With ``ep_size > 1`` the rows travel to the rank holding their expert and back by
all-to-all between dispatch and combine (``sparta.moe.parallel``), optionally cut into
chunks that overlap the experts' compute; ``tune_schedule`` picks the chunking from a
profile, as an explicit step before training. ``overlapped_moe_block`` runs a whole block
(its dense layers, then the layer) over micro-batches, so that one micro-batch's dense
layers compute while another's rows travel (overlap.py).

Around the layer: ``moeify(model, ...)`` swaps an existing model's MLPs for MoE layers
(upcycling their weights and biases); ``sparta.parallel.build_layout`` gives the expert-parallel
groups (``layout.ep``, ``layout.expert_dp``) and ``sparta.parallel.DataParallel`` reduces the
gradients (each expert's over its replicas only), inside the 3D trainer or a plain loop;
``state_dict()`` saves experts under their global ids and
``full_state_dict`` gathers them (whole, when their hidden units are split over tp), so a
checkpoint reloads under any ``ep_size`` and any split.

Soft MoE mixes tokens into ``E * slots_per_expert`` slots per sequence instead
(``soft_dispatch`` / ``soft_combine``).
"""

from __future__ import annotations

from sparta.moe.checkpoint import full_state_dict
from sparta.moe.config import ACTIVATIONS, ROUTERS, MoEConfig
from sparta.moe.dispatch import (
    Dispatched,
    DispatchPlan,
    combine,
    dispatch,
    expert_capacity,
    gather_rows,
    plan_dispatch,
)
from sparta.moe.experts import GroupedExperts
from sparta.moe.layer import MoELayer, MoEStats
from sparta.moe.moeify import DenseMLP, moeify, read_dense_mlp
from sparta.moe.overlap import overlap_problem, overlapped_moe_block
from sparta.moe.routers import (
    ExpertChoiceRouter,
    Router,
    RouterOutput,
    SigmoidRouter,
    SoftRouter,
    SwitchRouter,
    TopKRouter,
    XMoERouter,
    build_router,
)
from sparta.moe.tuning import tune_schedule

__all__ = [
    "ACTIVATIONS",
    "ROUTERS",
    "DenseMLP",
    "DispatchPlan",
    "Dispatched",
    "ExpertChoiceRouter",
    "GroupedExperts",
    "MoEConfig",
    "MoELayer",
    "MoEStats",
    "Router",
    "RouterOutput",
    "SigmoidRouter",
    "SoftRouter",
    "SwitchRouter",
    "TopKRouter",
    "XMoERouter",
    "build_router",
    "combine",
    "dispatch",
    "expert_capacity",
    "full_state_dict",
    "gather_rows",
    "moeify",
    "overlap_problem",
    "overlapped_moe_block",
    "plan_dispatch",
    "read_dense_mlp",
    "tune_schedule",
]
