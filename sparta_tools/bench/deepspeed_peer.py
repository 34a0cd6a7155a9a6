"""DeepSpeed-MoE as a peer of `sparta bench moe-layer` (and benchmarks/moe_layer.py), on CPU over gloo.

DeepSpeed is not a Sparta dependency (CI does not install it): every entry point returns
why it cannot run instead of raising when it is missing or fails to start.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from sparta.moe import MoELayer


def deepspeed_ready() -> str | None:
    """Initialise deepspeed.comm on this process's torch.distributed world (starting a world
    of one over gloo if there is none); returns why DeepSpeed cannot run, or None."""
    try:
        # DeepSpeed prints build and group messages on stdout, which carries our JSON lines.
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed
    except Exception as err:  # not installed, or installed against another torch
        return f"import deepspeed failed: {type(err).__name__}: {err}"
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    if not dist.is_initialized():
        # One process: an in-process store, so no port to pick and nothing to rendezvous with.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    except Exception as err:
        return f"deepspeed.init_distributed over gloo failed: {type(err).__name__}: {err}"
    return None


def deepspeed_step(
    reference: MoELayer, x: Tensor, ranks: int, drop_tokens: bool, aux_loss_coef: float
) -> tuple[Callable[[], None], list[nn.Parameter]] | str:
    """A forward+backward step of ``deepspeed.moe.layer.MoE`` holding ``reference``'s gate and
    experts (GELU MLPs without biases, capacity factor 1.25) and the layer's parameters, or
    why it cannot run."""
    if x.device.type != "cpu":
        return f"the DeepSpeed baseline runs on CPU over gloo only, not on {x.device.type}"
    why = deepspeed_ready()
    if why is not None:
        return why
    from deepspeed.moe.layer import MoE

    cfg = reference.config
    expert = nn.Sequential(
        nn.Linear(cfg.d_model, cfg.d_ff, bias=False), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
    )
    with contextlib.redirect_stdout(sys.stderr):
        layer = MoE(
            cfg.d_model,
            expert,
            num_experts=cfg.num_experts,
            ep_size=ranks,
            k=cfg.top_k,
            capacity_factor=1.25,
            eval_capacity_factor=1.25,
            drop_tokens=drop_tokens,
            top2_2nd_expert_sampling=False,
        )
        layer.set_deepspeed_parallelism()
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(reference.router.gate.weight)
        for local, mlp in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            mlp[0].weight.copy_(reference.experts.w1[local].t())
            mlp[2].weight.copy_(reference.experts.w2[local].t())
    # Experts in the input's dtype; DeepSpeed's gate casts itself back to float32, as Sparta routes.
    layer.to(dtype=x.dtype)
    grad = torch.randn_like(x)
    aux_grad = torch.tensor(aux_loss_coef)

    def step() -> None:
        y, l_aux, _ = layer(x)
        # Its aux loss is returned for the user to add to the loss; Sparta adds its own in backward.
        torch.autograd.backward([y, l_aux], [grad, aux_grad])

    step.forward = lambda: layer(x)[0]  # type: ignore[attr-defined]  # the output alone, for the oracle
    return step, list(layer.parameters())
