"""Checkpoints of expert-parallel models that load under any expert-parallel size.

Every ``GroupedExperts`` saves one entry per expert under its global id, so the ordinary
``model.state_dict()`` of a rank holds that rank's experts and ``model.load_state_dict(sd)``
takes the experts it needs from any dict that contains them. ``full_state_dict`` gathers
the experts of every rank into one dict, the form to save from one rank and reload on any
number of ranks.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sparta.moe.layer import MoELayer


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with the experts of every expert-parallel rank added, each
    whole (experts split over tp, `MoELayer.split_experts`, are gathered from their slices).

    Collective: every rank of every MoE layer's communicators must call it (each layer issues
    one all-gather per expert weight over tp, then one over ep, in module order). Returns the
    same dict on every rank; it holds all experts, so save it from one rank only (e.g. ``if
    rank == 0``).
    """
    state = model.state_dict()
    for path, module in model.named_modules():
        if not isinstance(module, MoELayer) or (module.comm is None and module.tp is None):
            continue
        experts = module.experts
        prefix = f"{path}.experts." if path else "experts."
        for name, weight in experts.named_weights():
            local = weight.detach()
            dim = experts.split_dim(name)
            if module.tp is not None and dim is not None:
                local = torch.cat(module.tp.all_gather(local), dim=dim + 1)  # type: ignore[arg-type]
            shards = module.comm.all_gather(local) if module.comm is not None else [local]
            for expert, tensor in enumerate(t for shard in shards for t in shard):
                state[f"{prefix}{name}.{expert}"] = tensor
    return state
