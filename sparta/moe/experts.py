"""GroupedExperts: the MLPs of the experts one rank holds, run over rows grouped by expert.

Every GEMM of all experts is one ``torch.nn.functional.grouped_mm`` call, on CPU and CUDA
alike: the rows ``[N, d]`` are cut into groups by cumulative ``counts`` kept on the device,
so running the experts needs no host synchronisation.

Expert tensor parallelism (Megatron-Core's): `GroupedExperts.split_ff` keeps one rank's
share of every expert's hidden width, so its forward gives a partial output; the MoE layer
sums the partials over the ranks that share its tokens (`MoELayer.split_experts`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from sparta.errors import ConfigError, InputError

# how each weight is cut when the hidden width is split: the dimension of d_ff in one
# expert's tensor (w1 [d_model, d_ff], w2 [d_ff, d_model], b1 [d_ff]); b2 stays whole
_FF_DIM = {"w1": 1, "w3": 1, "w2": 0, "b1": 0, "b3": 0}


def activate(activation: str, h1: Tensor, h3: Tensor | None = None) -> Tensor:
    """The expert MLP's nonlinearity: ``swiglu`` gates ``silu(h1)`` by ``h3``; ``gelu_tanh``
    is GELU's tanh approximation (GPT-2's ``gelu_new``)."""
    if activation == "swiglu":
        assert h3 is not None
        return nn.functional.silu(h1) * h3
    if activation == "gelu":
        return nn.functional.gelu(h1)
    if activation == "gelu_tanh":
        return nn.functional.gelu(h1, approximate="tanh")
    if activation == "silu":
        return nn.functional.silu(h1)
    return nn.functional.relu(h1)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's backward
    rejects the broadcast (stride 0) gradients that e.g. ``y.sum().backward()`` produces, and
    an empty one counts as contiguous whatever its strides, so it is made afresh."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous() if grad.numel() else grad.new_zeros(grad.shape)


class _ShareOfSum(torch.autograd.Function):
    """``x / n`` in forward, the gradient unscaled in backward: each of ``n`` ranks adds its
    share of a bias they all hold, so the sum of their outputs holds it once, while each
    rank's copy gets the whole gradient (as every other parameter replicated over them)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, n: int) -> Tensor:
        return x / n

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def check_ff_split(d_ff: int, size: int, element_size: int) -> None:
    """ConfigError unless ``size`` ranks can split ``d_ff`` hidden units (`GroupedExperts.split_ff`):
    ``size`` divides ``d_ff`` into slices whose rows grouped_mm takes (multiples of 16 bytes at
    ``element_size`` bytes a value). Pure: callers check it before any collective."""
    units = 0 if d_ff % size else d_ff // size
    row = units * element_size
    if d_ff % size or row % 16:
        cut = f" into {units} units, rows of {row} bytes (grouped_mm needs multiples of 16)" if units else ""
        raise ConfigError(
            f"expert tensor parallelism splits the experts' d_ff={d_ff} over tp={size}{cut}: pick a tp "
            "that divides it so, or replicate the experts over tp (MoESpec.expert_tp=False)"
        )


class GroupedExperts(nn.Module):
    """``num_experts`` independent MLPs ``act(x @ w1[e] + b1[e]) @ w2[e] + b2[e]`` (SwiGLU:
    ``(silu(x @ w1[e] + b1[e]) * (x @ w3[e] + b3[e])) @ w2[e] + b2[e]``); the biases only
    with ``bias=True``.

    Weights: ``w1``, ``w3`` ``[num_experts, d_model, d_ff]``, ``w2`` ``[num_experts, d_ff,
    d_model]``; biases ``b1``, ``b3`` ``[num_experts, d_ff]``, ``b2`` ``[num_experts,
    d_model]``. Local expert ``i`` is global expert ``first_expert + i``; its initial weights
    depend only on the global RNG state and its global id, so a model built with any
    expert-parallel size starts from the same experts. ``state_dict()`` holds one entry per
    expert under its global id (``w1.<id>`` ``[d_model, d_ff]``, ``w2.<id>`` ``[d_ff,
    d_model]``, ``b1.<id>`` ``[d_ff]``, ...), and ``load_state_dict`` takes this rank's
    experts from any checkpoint that contains them, whatever expert-parallel size wrote it.

    After ``split_ff(rank, size)`` this rank holds hidden units ``ff_range = [a, b)`` of every
    expert (``d_ff`` stays the full width): ``w1``, ``w3`` ``[num_experts, d_model, b - a]``,
    ``w2`` ``[num_experts, b - a, d_model]``, ``b1``, ``b3`` ``[num_experts, b - a]``; its
    ``state_dict`` entries are those slices (layout-dependent: ``sparta.moe.full_state_dict``
    and the trainer's checkpoints save whole experts), and ``load_state_dict`` takes whole
    experts (and cuts its slice) or slices of its own width.

    The GEMMs run through ``torch.nn.functional.grouped_mm``: float32, bfloat16 and float16
    on CPU; bfloat16 on CUDA (compute capability 8.0+). Rows must be 16-byte aligned
    (``d_model`` and ``d_ff`` times the element size multiples of 16).
    """

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        d_ff: int,
        activation: str = "gelu",
        first_expert: int = 0,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.d_model = d_model
        self.d_ff = d_ff
        self.activation = activation
        # A plain attribute, not a buffer: a checkpoint must not pin the expert-parallel layout.
        self.first_expert = first_expert
        self.ff_split: tuple[int, int] | None = None  # (rank, size) after split_ff
        self.ff_range = (0, d_ff)
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w3 = nn.Parameter(torch.empty(num_experts, d_model, d_ff)) if activation == "swiglu" else None
        self.w2 = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.b1 = nn.Parameter(torch.empty(num_experts, d_ff)) if bias else None
        self.b3 = nn.Parameter(torch.empty(num_experts, d_ff)) if bias and self.w3 is not None else None
        self.b2 = nn.Parameter(torch.empty(num_experts, d_model)) if bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise each expert's matrices and biases as ``nn.Linear`` initialises its
        weight and bias (uniform in ``+-1/sqrt(fan_in)``), from a generator seeded by one
        draw of the global RNG plus the global expert id; after ``split_ff``, each rank
        keeps its slice of those whole experts."""
        base_seed = int(torch.randint(0, 2**62, ()).item())
        names = (("w1", "b1"), ("w3", "b3"), ("w2", "b2"))
        for local in range(self.num_experts):
            generator = torch.Generator().manual_seed(base_seed + self.first_expert + local)
            for weight_name, bias_name in names:
                weight, bias = getattr(self, weight_name), getattr(self, bias_name)
                if weight is None:
                    continue
                fan_in, fan_out = (self.d_ff, self.d_model) if weight_name == "w2" else (self.d_model, self.d_ff)
                linear_weight = torch.empty(fan_out, fan_in)
                nn.init.kaiming_uniform_(linear_weight, a=math.sqrt(5), generator=generator)
                weight[local].copy_(self._own_slice(weight_name, linear_weight.t()))
                if bias is not None:
                    bound = 1 / math.sqrt(fan_in)
                    whole = torch.empty(fan_out).uniform_(-bound, bound, generator=generator)
                    bias[local].copy_(self._own_slice(bias_name, whole))

    def _own_slice(self, name: str, whole: Tensor) -> Tensor:
        """This rank's part of one whole expert's tensor ``name`` (all of it unless split)."""
        if self.ff_split is None or name not in _FF_DIM:
            return whole
        a, b = self.ff_range
        return whole.narrow(_FF_DIM[name], a, b - a)

    def named_weights(self) -> list[tuple[str, nn.Parameter]]:
        """(name, tensor) of each per-expert parameter: ``w1``, ``w3`` (SwiGLU only),
        ``w2``, then the biases ``b1``, ``b3``, ``b2`` where the experts have them."""
        named = (("w1", self.w1), ("w3", self.w3), ("w2", self.w2), ("b1", self.b1), ("b3", self.b3), ("b2", self.b2))
        return [(name, w) for name, w in named if w is not None]

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        # One entry per expert under its global id ("w1.5": [d_model, d_ff]), so that a
        # checkpoint does not depend on how the experts were split over ep ranks (after
        # split_ff, the entries are this rank's slices: full_state_dict gathers them whole).
        for name, weight in self.named_weights():
            tensor = weight if keep_vars else weight.detach()
            for local in range(self.num_experts):
                destination[f"{prefix}{name}.{self.first_expert + local}"] = tensor[local]

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Takes this rank's experts from a checkpoint holding any superset of the experts
        # (one rank's shard of the same split, or all of them): other experts' entries are
        # not "unexpected", they belong to other ranks.
        for name, weight in self.named_weights():
            for local in range(self.num_experts):
                key = f"{prefix}{name}.{self.first_expert + local}"
                if key not in state_dict:
                    missing_keys.append(key)
                    continue
                value = state_dict[key]
                whole = self.expert_slice(name)
                if whole is not None and tuple(value.shape) == whole[1]:
                    value = self._own_slice(name, value)
                if value.shape != weight.shape[1:]:
                    split = f" (its slice {self.ff_range} of d_ff={self.d_ff})" if whole is not None else ""
                    error_msgs.append(
                        f"size mismatch for {key}: the checkpoint has {tuple(value.shape)}, this expert "
                        f"{tuple(weight.shape[1:])}{split}: build the layer with the checkpoint's d_model and d_ff "
                        "(and load whole experts, e.g. sparta.moe.full_state_dict, into split ones)"
                    )
                    continue
                with torch.no_grad():
                    weight[local].copy_(value)
        if strict:
            ours = {name for name, _ in self.named_weights()}
            unexpected_keys.extend(
                key for key in state_dict if key.startswith(prefix) and key[len(prefix) :].split(".")[0] not in ours
            )

    def split_ff(self, rank: int, size: int) -> None:
        """Keep rank ``rank`` of ``size``'s share of every expert's hidden units: ``ff_range``
        = ``[rank * d_ff / size, (rank + 1) * d_ff / size)`` (the columns of ``w1``, ``w3``,
        ``b1``, ``b3``, the rows of ``w2``); ``b2`` stays whole, added as ``b2 / size`` so that
        the ranks' sum holds it once.

        From then on ``forward`` returns this rank's partial output: the sum of the tp ranks'
        outputs (``b2`` included once) is the whole experts' output on the same rows, and
        their input gradients sum to the whole experts'. The caller sums them
        (``MoELayer.split_experts`` does, around its exchanges). Call it before an optimizer
        or wrapper takes the parameters. Raises ConfigError where `check_ff_split` does
        or the experts are already split.
        """
        if self.ff_split is not None:
            raise ConfigError(f"the experts are already split over a tp group of {self.ff_split[1]}: split them once")
        self.check_ff_split(size)
        if not 0 <= rank < size:
            raise ConfigError(
                f"split_ff: rank={rank} is not one of size={size}'s ranks: pass 0 <= rank < size (tp.rank)"
            )
        width = self.d_ff // size
        start = rank * width
        for name, weight in self.named_weights():
            if name in _FF_DIM:
                part = weight.detach().narrow(_FF_DIM[name] + 1, start, width).clone()
                setattr(self, name, nn.Parameter(part, requires_grad=weight.requires_grad))
        self.ff_split, self.ff_range = (rank, size), (start, start + width)

    def check_ff_split(self, size: int) -> None:
        """ConfigError unless ``size`` ranks can split the hidden units (`split_ff`), as
        `check_ff_split` (the module's function) says for these experts. Pure: no collective."""
        check_ff_split(self.d_ff, size, self.w1.element_size())

    def split_weights(self) -> list[tuple[str, nn.Parameter]]:
        """(name, tensor) of the weights ``split_ff`` cut (none before it)."""
        return [(n, w) for n, w in self.named_weights() if n in _FF_DIM] if self.ff_split is not None else []

    def split_dim(self, name: str) -> int | None:
        """The dimension of one expert's tensor ``name`` that ``split_ff`` cuts (None for
        ``b2``, and for every weight before the split)."""
        return _FF_DIM.get(name) if self.ff_split is not None else None

    def expert_slice(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """Where weight ``name``'s per-expert tensor sits in the whole expert's: (offsets,
        the whole expert's shape); None when it is whole."""
        if self.ff_split is None or name not in _FF_DIM:
            return None
        whole = list(getattr(self, name).shape[1:])
        whole[_FF_DIM[name]] = self.d_ff
        offsets = [0] * len(whole)
        offsets[_FF_DIM[name]] = self.ff_range[0]
        return tuple(offsets), tuple(whole)

    def check_rows(self, rows: Tensor) -> None:
        """Raise InputError unless grouped_mm can take rows like ``rows`` with these weights."""
        if rows.dtype != self.w1.dtype or rows.device != self.w1.device:
            raise InputError(
                f"the experts hold {self.w1.dtype} weights on {self.w1.device} but got {rows.dtype} rows on "
                f"{rows.device}: move the layer to the input's device and dtype (layer.to(x.device, x.dtype))"
            )
        d_ff = self.ff_range[1] - self.ff_range[0]
        unaligned = [n for n in (self.d_model, d_ff) if n * rows.element_size() % 16]
        if unaligned:
            raise InputError(
                f"grouped_mm needs 16-byte aligned rows, but d_model={self.d_model}, d_ff={d_ff} (this rank's) in "
                f"{rows.dtype} gives rows of {[n * rows.element_size() for n in unaligned]} bytes: use widths "
                f"that are multiples of {16 // rows.element_size()}"
            )

    def forward(self, rows: Tensor, counts: Tensor) -> Tensor:
        """``rows`` ``[N, d_model]`` grouped by local expert, ``counts`` ``[num_experts]``
        int64 on the rows' device -> ``[N, d_model]``, same order."""
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)

        def linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
            y = nn.functional.grouped_mm(x, w, offs=offsets)
            # grouped_mm's own bias takes no gradient; output_size avoids a host sync.
            return y if b is None else y + b.repeat_interleave(counts, dim=0, output_size=x.shape[0])

        h1 = linear(rows, self.w1, self.b1)
        h3 = linear(rows, self.w3, self.b3) if self.w3 is not None else None
        b2 = self.b2
        if b2 is not None and self.ff_split is not None:  # the tp ranks' partial outputs sum to one b2
            b2 = _ShareOfSum.apply(b2, self.ff_split[1])
        return _ContiguousGrad.apply(linear(activate(self.activation, h1, h3), self.w2, b2))

    def forward_blocks(self, rows: Tensor, block_counts: Tensor) -> Tensor:
        """``rows`` ``[N, d_model]`` in blocks, each grouped by local expert (block ``b`` holds
        ``block_counts[b, j]`` rows of expert ``j``, ``block_counts`` ``[B, num_experts]``
        int64; what an expert-parallel all-to-all receives, one block per source rank) ->
        ``[N, d_model]``, same order: the rows go through ``forward`` in expert order and back."""
        if block_counts.shape[0] == 1:
            return self(rows, block_counts[0])
        expert_of_row = torch.arange(self.num_experts, device=rows.device).repeat(block_counts.shape[0])
        row_expert = torch.repeat_interleave(expert_of_row, block_counts.reshape(-1), output_size=rows.shape[0])
        by_expert = torch.sort(row_expert, stable=True).indices
        out = self(rows.index_select(0, by_expert), block_counts.sum(dim=0))
        return torch.empty_like(out).index_copy(0, by_expert, out)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, d_model={self.d_model}, d_ff={self.d_ff}, "
            f"activation={self.activation}, first_expert={self.first_expert}"
            + (f", ff_range={self.ff_range} of d_ff={self.d_ff}" if self.ff_split is not None else "")
        )
