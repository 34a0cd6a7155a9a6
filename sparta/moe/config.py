"""MoEConfig: every hyper-parameter of one MoE layer, validated before any tensor exists."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparta.errors import ConfigError
from sparta.scheduling.chunks import DEGREES_HELP, PipelineDegrees

ROUTERS = ("topk", "switch", "sigmoid", "xmoe", "expert_choice", "soft")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "swiglu")


def _check_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True as a size is always a mistake in a config file.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}={value!r} is invalid: it must be an integer >= {minimum}")


def _check_float(name: str, value: object, low: float, high: float = math.inf) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value < high:
        bound = f"in [{low}, {high})" if high != math.inf else f">= {low}"
        raise ConfigError(f"{name}={value!r} is invalid: it must be a number {bound}")


@dataclass
class MoEConfig:
    """Configuration of one MoE layer (loadable from YAML: every field is a plain value).

    Sizes are counts of features or experts; ``capacity_factor`` multiplies the fair share
    ``tokens * top_k / num_experts`` of (token, expert) pairs per expert.

    Router-specific fields only matter for their router: ``jitter_eps`` (topk, switch:
    multiplicative input noise in training), ``bias_update_rate`` (sigmoid: step of the
    aux-loss-free balancing bias), ``xmoe_dim`` (xmoe: dimension of the routing space),
    ``slots_per_expert`` (soft). ``activation``: ``gelu``, ``gelu_tanh`` (GELU's tanh
    approximation), ``relu``, ``silu`` (ungated), ``swiglu`` (gated, a third matrix ``w3``).
    ``expert_bias`` gives every expert's linear maps biases, as a dense MLP with biases has
    (GPT-2's), so such an MLP upcycles exactly.
    ``pipeline_degree`` (expert parallel only): chunks the row exchanges are cut into so that
    communication overlaps expert compute, one int for both passes, ``(forward, backward)``,
    ``(forward, backward, taper)`` (``sparta.scheduling.PipelineDegrees``: end chunks
    ``2**-taper`` of the middle size). ``sparta.moe.tune_schedule`` chooses them from a
    profile, as an explicit step before training.
    """

    d_model: int
    d_ff: int
    num_experts: int
    top_k: int = 2
    router: str = "topk"
    capacity_factor: float | None = None
    activation: str = "gelu"
    ep_size: int = 1
    aux_loss_coef: float = 1e-2
    z_loss_coef: float = 1e-3
    jitter_eps: float = 0.0
    bias_update_rate: float = 1e-3
    xmoe_dim: int = 16
    slots_per_expert: int = 1
    expert_bias: bool = False
    pipeline_degree: int | tuple[int, int] | tuple[int, int, int] = 1

    def __post_init__(self) -> None:
        _check_int("d_model", self.d_model, 1)
        _check_int("d_ff", self.d_ff, 1)
        _check_int("num_experts", self.num_experts, 1)
        _check_int("ep_size", self.ep_size, 1)
        _check_int("xmoe_dim", self.xmoe_dim, 1)
        _check_int("slots_per_expert", self.slots_per_expert, 1)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1:
            raise ConfigError(f"top_k={self.top_k!r} is invalid: route each token to at least 1 expert")
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"top_k={self.top_k} exceeds num_experts={self.num_experts}: "
                f"use top_k <= {self.num_experts} or add experts"
            )
        if self.num_experts % self.ep_size != 0:
            raise ConfigError(
                f"num_experts={self.num_experts} is not divisible by ep_size={self.ep_size}: "
                "every expert-parallel rank must hold the same number of experts"
            )
        if self.router not in ROUTERS:
            raise ConfigError(f"router={self.router!r} is unknown: choose one of {', '.join(ROUTERS)}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation={self.activation!r} is unknown: choose one of {', '.join(ACTIVATIONS)}")
        if self.capacity_factor is not None:
            cf = self.capacity_factor
            if not isinstance(cf, (int, float)) or isinstance(cf, bool) or not 0 < cf < math.inf:
                raise ConfigError(
                    f"capacity_factor={cf!r} is invalid: use a finite number > 0 (e.g. 1.25), "
                    "or None for dropless routing"
                )
        if self.router == "switch" and self.top_k != 1:
            raise ConfigError(
                f"router='switch' routes each token to exactly one expert but top_k={self.top_k}: "
                "set top_k=1, or use router='topk' for top-k routing"
            )
        if self.router == "soft" and self.capacity_factor is not None:
            raise ConfigError(
                f"router='soft' never drops tokens, so capacity_factor={self.capacity_factor} "
                "has no meaning: set capacity_factor=None (size the experts' work with "
                "slots_per_expert instead)"
            )
        try:
            PipelineDegrees.of(self.pipeline_degree)
        except ConfigError:
            raise ConfigError(
                f"pipeline_degree={self.pipeline_degree!r} is invalid: use {DEGREES_HELP} "
                "(sparta.moe.tune_schedule chooses them from a profile)"
            ) from None
        _check_float("aux_loss_coef", self.aux_loss_coef, 0.0)
        _check_float("z_loss_coef", self.z_loss_coef, 0.0)
        _check_float("jitter_eps", self.jitter_eps, 0.0, 1.0)
        _check_float("bias_update_rate", self.bias_update_rate, 0.0)
        if not isinstance(self.expert_bias, bool):
            raise ConfigError(f"expert_bias={self.expert_bias!r} is invalid: pass True or False")

    @property
    def degrees(self) -> PipelineDegrees:
        """The pipeline's degrees and taper."""
        return PipelineDegrees.of(self.pipeline_degree)

    @property
    def num_local_experts(self) -> int:
        """Experts held by one expert-parallel rank."""
        return self.num_experts // self.ep_size
