"""moeify: swap the MLP blocks of an existing model for MoE layers, optionally upcycled.

An MLP is recognised by its weights, whatever its class is called:

- gated (Llama, Mistral, Qwen): ``gate_proj``, ``up_proj``, ``down_proj`` -> SwiGLU experts;
- GPT-2: ``c_fc``, ``c_proj`` (``Conv1D``, weights stored ``[in, out]``);
- two linears: ``fc1``/``fc2``, ``linear1``/``linear2``, ``w1``/``w2``, ``dense_h_to_4h``/
  ``dense_4h_to_h``, or an ``nn.Sequential`` of two ``nn.Linear`` around an activation.

Upcycling copies the dense weights, and biases, into every expert (an MLP with biases gets
experts with biases, ``expert_bias=True``). The top-k router's weights sum to 1 per token, so
an MLP upcycled under ``router="topk"`` (dropless) computes exactly what it did.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from sparta.errors import ConfigError
from sparta.moe.layer import MoELayer

if TYPE_CHECKING:
    from sparta.comm import Communicator

log = logging.getLogger("sparta.moe")

_TWO_LINEAR_NAMES = (("fc1", "fc2"), ("linear1", "linear2"), ("w1", "w2"), ("dense_h_to_4h", "dense_4h_to_h"))
# Activation modules and Hugging Face ``hidden_act`` names, as MoE activations.
_ACTIVATIONS = {
    "GELU": "gelu",
    "GELUActivation": "gelu",
    "NewGELUActivation": "gelu",
    "GELUTanh": "gelu",
    "PytorchGELUTanh": "gelu",
    "ReLU": "relu",
    "SiLU": "swiglu",
    "SiLUActivation": "swiglu",
    "gelu": "gelu",
    "gelu_new": "gelu",
    "gelu_pytorch_tanh": "gelu",
    "relu": "relu",
    "silu": "swiglu",
    "swish": "swiglu",
}


@dataclass
class DenseMLP:
    """The weights of one dense MLP, laid out as an expert's: ``w1``/``w3`` ``[d_model,
    d_ff]``, ``w2`` ``[d_ff, d_model]``, biases ``b1``/``b3`` ``[d_ff]``, ``b2``
    ``[d_model]``; ``w3``/``b3`` only for a gated MLP, a bias only where the MLP has it."""

    activation: str
    w1: Tensor
    w2: Tensor
    w3: Tensor | None = None
    b1: Tensor | None = None
    b2: Tensor | None = None
    b3: Tensor | None = None

    @property
    def has_bias(self) -> bool:
        return any(b is not None for b in (self.b1, self.b2, self.b3))

    @property
    def d_model(self) -> int:
        return self.w1.shape[0]

    @property
    def d_ff(self) -> int:
        return self.w1.shape[1]


def _linear_in_out(module: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """A linear map's weight as ``[in, out]``, and its bias (None if it has none)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        return None
    bias = getattr(module, "bias", None)
    bias = bias if isinstance(bias, Tensor) else None
    if isinstance(module, nn.Linear):
        return weight.t(), bias
    if type(module).__name__ == "Conv1D":  # Hugging Face GPT-2 stores x @ W, W [in, out]
        return weight, bias
    return None


def _activation_of(module: nn.Module, default: str) -> str:
    for child in module.modules():
        name = _ACTIVATIONS.get(type(child).__name__)
        if name is not None:
            return name
    config = getattr(module, "config", None)
    hidden_act = getattr(config, "hidden_act", None) or getattr(config, "activation_function", None)
    if isinstance(hidden_act, str) and hidden_act in _ACTIVATIONS:
        return _ACTIVATIONS[hidden_act]
    return default


def read_dense_mlp(module: nn.Module) -> DenseMLP | None:
    """The MLP weights of ``module``, or None if it is not an MLP this module recognises."""
    names = dict(module.named_children())
    if all(n in names for n in ("gate_proj", "up_proj", "down_proj")):
        parts = [_linear_in_out(names[n]) for n in ("gate_proj", "up_proj", "down_proj")]
        if all(parts):
            (w1, b1), (w3, b3), (w2, b2) = parts  # type: ignore[misc]
            return DenseMLP("swiglu", w1, w2, w3, b1, b2, b3)
    pairs = [(names[a], names[b]) for a, b in _TWO_LINEAR_NAMES if a in names and b in names]
    if "c_fc" in names and "c_proj" in names:
        pairs.append((names["c_fc"], names["c_proj"]))
    if isinstance(module, nn.Sequential):
        linears = [m for m in module if isinstance(m, nn.Linear)]
        if len(linears) == 2:
            pairs.append((linears[0], linears[1]))
    for up, down in pairs:
        first, second = _linear_in_out(up), _linear_in_out(down)
        if first and second and first[0].shape[1] == second[0].shape[0]:
            activation = _activation_of(module, default="gelu")
            if activation == "swiglu":  # an ungated SiLU MLP has no exact expert form
                activation = "gelu"
            return DenseMLP(activation, first[0], second[0], None, first[1], second[1])
    return None


def _matches(path: str, module: nn.Module, match: type | tuple[type, ...] | str | None) -> bool:
    if match is None:
        return type(module).__name__.lower().endswith(("mlp", "feedforward"))
    if isinstance(match, str):
        return re.fullmatch(match, path) is not None
    return isinstance(module, match)


def moeify(
    model: nn.Module,
    num_experts: int,
    top_k: int = 2,
    *,
    match: type | tuple[type, ...] | str | None = None,
    upcycle: bool = True,
    comm: Communicator | None = None,
    **moe_options: Any,
) -> list[str]:
    """Replace each MLP of ``model`` chosen by ``match`` with an ``MoELayer``, in place.

    ``match``: an MLP class (or tuple of classes), a regular expression over module paths
    (e.g. ``r"h\\.\\d+\\.mlp"``), or None for every module whose class name ends in ``MLP`` or
    ``FeedForward``. Each chosen module must be an MLP ``read_dense_mlp`` recognises; its
    input and output are ``[..., d_model]``, as the MoE layer's. ``upcycle`` copies its
    weights into every expert; otherwise the experts keep their fresh initialisation.
    ``comm`` and ``moe_options`` (``router``, ``capacity_factor``, ``ep_size``, ...) go to
    every ``MoELayer``. The activation is taken from the MLP unless ``activation`` is given.

    Returns the paths of the replaced modules. Raises ``ConfigError`` if nothing matched or
    a matched module is not a recognisable MLP. The new layers are on the device and dtype
    of the weights they replace.
    """
    chosen = [(path, m) for path, m in model.named_modules() if path and _matches(path, m, match)]
    # An MLP nested in a chosen MLP goes with its parent.
    chosen = [(p, m) for p, m in chosen if not any(p.startswith(q + ".") for q, _ in chosen)]
    if not chosen:
        raise ConfigError(
            f"moeify found no module matching {match!r} in {type(model).__name__}: pass match= the MLP "
            "class or a regular expression over the paths printed by model.named_modules()"
        )
    replaced = []
    for path, module in chosen:
        dense = read_dense_mlp(module)
        if dense is None:
            raise ConfigError(
                f"moeify: {path} ({type(module).__name__}) is not an MLP it can read: it needs "
                "gate_proj/up_proj/down_proj, c_fc/c_proj, fc1/fc2, linear1/linear2 or w1/w2 linears"
            )
        options = {"activation": dense.activation, "expert_bias": upcycle and dense.has_bias, **moe_options}
        if upcycle and options["activation"] != dense.activation:
            raise ConfigError(
                f"moeify: cannot upcycle {path}, a {dense.activation} MLP, into {options['activation']} "
                "experts: drop activation= or pass upcycle=False"
            )
        moe = MoELayer(dense.d_model, dense.d_ff, num_experts, top_k, comm=comm, name=path, **options)
        moe.to(device=dense.w1.device, dtype=dense.w1.dtype)
        if upcycle:
            if dense.has_bias and not options["expert_bias"]:
                log.warning("moeify: %s has biases but expert_bias=False, so they are not upcycled", path)
            with torch.no_grad():
                for name, weight in moe.experts.named_weights():
                    source = getattr(dense, name)
                    if source is None:  # e.g. a bias the experts have and this linear map lacks
                        weight.zero_()
                    else:
                        weight.copy_(source.unsqueeze(0).expand_as(weight))
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, moe)
        replaced.append(path)
    return replaced
