"""moeify: swap the MLP blocks of an existing model for MoE layers, optionally upcycled.

An MLP is recognised by its weights, whatever its class is called:

- gated (Llama, Mistral, Qwen): ``gate_proj``, ``up_proj``, ``down_proj`` -> SwiGLU experts;
- GPT-2: ``c_fc``, ``c_proj`` (``Conv1D``, weights stored ``[in, out]``);
- two linears: ``fc1``/``fc2``, ``linear1``/``linear2``, ``w1``/``w2``, ``dense_h_to_4h``/
  ``dense_4h_to_h``, or an ``nn.Sequential`` of two ``nn.Linear`` around an activation.

Its activation is read from its one activation module (or, without one, from its
``config.hidden_act``) and mapped to the expert activation that computes the same function:
exact GELU to ``gelu``; every tanh approximation of GELU (GPT-2's ``gelu_new``,
``gelu_pytorch_tanh``, ``gelu_fast``, ...) to ``gelu_tanh``; ReLU to ``relu``; SiLU to
``silu``, or to ``swiglu`` as a gated MLP's gate. Anything else (QuickGELU, a GELU-gated
MLP, a norm inside the MLP, ...) has no exact expert form, and upcycling it raises.

Upcycling copies the dense weights, and biases, into every expert (an MLP with biases gets
experts with biases, ``expert_bias=True``). The top-k router's weights sum to 1 per token at
top_k >= 2, so an MLP upcycled under ``router="topk"`` (dropless) computes exactly what it
did (dropout inside the MLP is not carried over: equal in eval mode). At top_k = 1 (and
under ``switch``) a token's one weight is its expert's probability, so the upcycled layer
starts out scaling the MLP's output by it; moeify warns.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from sparta.errors import ConfigError
from sparta.moe.config import ACTIVATIONS
from sparta.moe.layer import MoELayer

if TYPE_CHECKING:
    from sparta.comm import Communicator

log = logging.getLogger("sparta.moe")

_TWO_LINEAR_NAMES = (("fc1", "fc2"), ("linear1", "linear2"), ("w1", "w2"), ("dense_h_to_4h", "dense_4h_to_h"))
# Activation module classes (torch's and Hugging Face's), as the expert activation computing
# the same function up to rounding; nn.GELU goes by its `approximate`.
_CLASSES = {
    "GELUActivation": "gelu",
    "NewGELUActivation": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
    "AccurateGELUActivation": "gelu_tanh",
    "ReLU": "relu",
    "SiLU": "silu",
    "SiLUActivation": "silu",
}
# Hugging Face `hidden_act` / `activation_function` names (transformers.activations.ACT2CLS).
_NAMES = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_accurate": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
_PASSIVE = (nn.Dropout, nn.Identity)  # no effect on what an MLP computes in eval mode


@dataclass
class DenseMLP:
    """The weights of one dense MLP, laid out as an expert's: ``w1``/``w3`` ``[d_model,
    d_ff]``, ``w2`` ``[d_ff, d_model]``, biases ``b1``/``b3`` ``[d_ff]``, ``b2``
    ``[d_model]``; ``w3``/``b3`` only for a gated MLP, a bias only where the MLP has it.

    ``activation``: the expert activation computing what the MLP computes, or None when it
    has none (``unsupported`` says what it has instead) or none could be found (no
    activation module, no ``config.hidden_act``: its forward may call one directly).
    """

    activation: str | None
    w1: Tensor
    w2: Tensor
    w3: Tensor | None = None
    b1: Tensor | None = None
    b2: Tensor | None = None
    b3: Tensor | None = None
    unsupported: str | None = None

    @property
    def has_bias(self) -> bool:
        """Whether any of the MLP's projections has a bias."""
        return any(b is not None for b in (self.b1, self.b2, self.b3))

    @property
    def d_model(self) -> int:
        """The MLP's input and output width."""
        return self.w1.shape[0]

    @property
    def d_ff(self) -> int:
        """The MLP's hidden width."""
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


def _activation_of(module: nn.Module, linears: tuple[nn.Module, ...], gated: bool) -> tuple[str | None, str | None]:
    """(expert activation, None), or (None, what the MLP has that no expert computes), or
    (None, None) when nothing tells its activation."""
    extra = [
        (name, m)
        for name, m in module.named_modules()
        if m is not module and m not in linears and not list(m.children()) and not isinstance(m, _PASSIVE)
    ]
    if len(extra) > 1:
        listed = ", ".join(f"{name} ({type(m).__name__})" for name, m in extra)
        return None, f"the modules {listed} besides its linear maps, where experts apply one activation"
    if extra:
        name, act = extra[0]
        kind = type(act).__name__
        found = _CLASSES.get(kind)
        if isinstance(act, nn.GELU):
            found = "gelu_tanh" if act.approximate == "tanh" else "gelu"
        if found is None:
            return None, f"the activation {name} ({kind})"
        if isinstance(module, nn.Sequential):
            order = list(module)
            if act not in order or not order.index(linears[0]) < order.index(act) < order.index(linears[1]):
                return None, "its layers in another order than linear, activation, linear"
    else:
        config = getattr(module, "config", None)
        hidden_act = getattr(config, "hidden_act", None) or getattr(config, "activation_function", None)
        if not isinstance(hidden_act, str):
            return None, None
        kind = f"config.hidden_act={hidden_act!r}"
        found = _NAMES.get(hidden_act)
        if found is None:
            return None, f"the activation {kind}"
    if gated:
        if found != "silu":
            return None, f"a {found} gate (gate_proj), where gated experts gate with SiLU (swiglu)"
        return "swiglu", None
    return found, None


def read_dense_mlp(module: nn.Module) -> DenseMLP | None:
    """The MLP weights of ``module``, or None if it is not an MLP this module recognises."""
    names = dict(module.named_children())
    if all(n in names for n in ("gate_proj", "up_proj", "down_proj")):
        linears = tuple(names[n] for n in ("gate_proj", "up_proj", "down_proj"))
        parts = [_linear_in_out(m) for m in linears]
        if all(parts):
            (w1, b1), (w3, b3), (w2, b2) = parts  # type: ignore[misc]
            activation, unsupported = _activation_of(module, linears, gated=True)
            return DenseMLP(activation, w1, w2, w3, b1, b2, b3, unsupported)
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
            activation, unsupported = _activation_of(module, (up, down), gated=False)
            return DenseMLP(activation, first[0], second[0], None, first[1], second[1], unsupported=unsupported)
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
    every ``MoELayer``. The activation is the MLP's (see the module docstring); ``activation``
    names it where nothing in the module does (a forward calling ``F.gelu`` itself), or, with
    ``upcycle=False``, picks the new experts'.

    Returns the paths of the replaced modules. Raises ``ConfigError`` if nothing matched, a
    matched module is not a recognisable MLP, or upcycling would not compute what the MLP
    did (an activation no expert computes exactly, or ``activation`` naming another). The
    new layers are on the device and dtype of the weights they replace.
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
        requested = moe_options.get("activation")
        if dense.unsupported is not None and (upcycle or requested is None):
            raise ConfigError(
                f"moeify: {path} has {dense.unsupported}, which no expert computes exactly (experts: "
                f"{', '.join(ACTIVATIONS)}), so upcycling would change what it computes; to train new "
                "experts instead, pass upcycle=False and activation="
            )
        if dense.activation is None and requested is None:
            raise ConfigError(
                f"moeify: cannot tell which activation {path} ({type(module).__name__}) applies (no activation "
                f"module, no config.hidden_act); pass activation= the one its forward computes: "
                f"{', '.join(ACTIVATIONS)}"
            )
        if upcycle and None not in (requested, dense.activation) and requested != dense.activation:
            raise ConfigError(
                f"moeify: cannot upcycle {path}, a {dense.activation} MLP, into {requested} "
                "experts: drop activation= or pass upcycle=False"
            )
        options = {
            "expert_bias": upcycle and dense.has_bias,
            **moe_options,
            "activation": requested or dense.activation,
        }
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
    router = moe.config.router
    if upcycle and top_k == 1 and router in ("topk", "switch"):  # once for all the layers
        fix = "top_k >= 2" if router == "topk" else "router='topk' with top_k >= 2 (switch routes to one expert)"
        log.warning(
            "moeify: %s upcycled at top_k=1: each token's weight is its expert's probability (about 1 / %d at "
            "first), not 1, so the layers no longer compute what the MLPs did; use %s for an exact start",
            ", ".join(replaced),
            num_experts,
            fix,
        )
    return replaced
