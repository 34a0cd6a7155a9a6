"""The expert loop: every local expert's MLP over runs of rows, forward and backward by hand.

A run (``Segment``) is ``(local expert, first row, end row)``; an expert may own several.
Two forms. Rows form (``token_idx`` None): the segments cover rows of ``x`` ``[N, d]`` and
each row's output goes to the same row of ``out``; rows that arrive in several blocks each
grouped by expert (an all-to-all's output: by source rank, then by expert) run where they
lie, with no gather or scatter. Token form (``token_idx`` / ``weight`` ``[N]``, a dispatch
plan, consecutive segments): ``x`` is the ``[T, d]`` tokens and ``out[token_idx[i]] +=
weight[i] * expert(x[token_idx[i]])``: gather, experts and combine fused, so no ``[N, d]``
row tensor is ever built.

Why by hand: each run's rows, hidden activations and gradients are produced and consumed
while still cache-resident, outputs go straight into preallocated buffers (no cat / split /
stack copies), each run's temporaries reuse the previous run's buffers (warm, and no fresh
pages to fault in), only the pre-activations are saved (the activation output is recomputed
in backward), and backward frees them block by block while the weight gradients fill up. In
benchmarks/moe_layer.py on one CPU thread this is faster than autograd over per-expert
``torch.mm`` and than ``torch._grouped_mm`` (which streams the whole ``[N, d_ff]`` hidden
tensor through memory between GEMMs), and on par with one dense GEMM over all rows. Runs
are not cut further into L2-sized tiles: smaller GEMMs, and weight gradients added into
once per tile, cost more than the warmer elementwise work saves (256-row tiles: 8% slower
per step in the small config, 512-row tiles 4% in the large one).

``loop_forward`` / ``loop_backward`` are the pieces; ``ExpertLoop`` is the autograd Function
over one run of the loop, and ``sparta.moe.parallel`` composes two runs around an all-to-all.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from sparta.moe.dispatch import rowwise_dot

Segment = tuple[int, int, int]
"""``(local expert, first row, end row)``: a run of rows one expert processes."""

# glibc serves allocations of at least this size (its largest dynamic mmap threshold) by
# mmap and gives them back to the OS on free; smaller ones come from the heap, whose freed
# pages stay resident. Pre-activations are stored in blocks of this size so that backward
# returns each block's memory as soon as it is done with it.
_RELEASABLE_BYTES = 32 << 20


def consecutive_segments(counts_list: list[int], offset: int = 0) -> list[Segment]:
    """Segments of rows grouped by expert, from row ``offset`` on: expert ``e`` has the
    ``counts_list[e]`` rows after those of experts ``0 .. e - 1``."""
    ends = [offset + end for end in itertools.accumulate(counts_list)]
    return [(e, end - count, end) for e, (count, end) in enumerate(zip(counts_list, ends, strict=True))]


def block_segments(blocks: list[list[int]]) -> list[Segment]:
    """Segments of rows in consecutive blocks, each grouped by expert: block ``b`` holds
    ``blocks[b][e]`` rows of expert ``e``, after every earlier block's rows."""
    segments: list[Segment] = []
    offset = 0
    for counts in blocks:
        segments += consecutive_segments(counts, offset)
        offset += sum(counts)
    return segments


def activate(activation: str, h1: Tensor, h3: Tensor | None) -> Tensor:
    if activation == "swiglu":
        return nn.functional.silu(h1) * h3
    if activation == "gelu":
        return nn.functional.gelu(h1)
    return nn.functional.relu(h1)


@dataclass(frozen=True)
class LoopWeights:
    """The experts' weights: ``w1`` (and ``w3`` for SwiGLU) ``[E, d_model, d_ff]``, ``w2``
    ``[E, d_ff, d_model]``; optional biases ``b1`` (``b3``) ``[E, d_ff]``, ``b2`` ``[E,
    d_model]``."""

    activation: str
    w1: Tensor
    w3: Tensor | None
    w2: Tensor
    b1: Tensor | None = None
    b3: Tensor | None = None
    b2: Tensor | None = None

    def tensors(self) -> tuple[Tensor | None, ...]:
        """``(w1, w3, w2, b1, b3, b2)``, the order ``ExpertLoop.apply`` takes them in."""
        return self.w1, self.w3, self.w2, self.b1, self.b3, self.b2


def _linear(x: Tensor, w: Tensor, b: Tensor | None, out: Tensor | None = None) -> Tensor:
    if b is None:
        return torch.mm(x, w, out=out)
    return torch.addmm(b, x, w, out=out)


class PreActivations:
    """The ``[rows, d_ff]`` pre-activations of a run's segments, stored in blocks of
    consecutive segments, each of at least ``_RELEASABLE_BYTES``; ``take(i)`` hands out
    segment ``i``'s rows and frees a block once its last segment has been taken (segments
    are taken in order)."""

    def __init__(self, segments: list[Segment], width: int, like: Tensor) -> None:
        row_bytes = width * like.element_size()
        self._where: list[tuple[int, int, int]] = []  # per segment: block, first row, end row
        self._last: list[int] = []  # per block: its last segment
        sizes: list[int] = []
        for i, (_, start, end) in enumerate(segments):
            if not sizes or sizes[-1] * row_bytes >= _RELEASABLE_BYTES:
                sizes.append(0)
                self._last.append(i)
            self._where.append((len(sizes) - 1, sizes[-1], sizes[-1] + end - start))
            sizes[-1] += end - start
            self._last[-1] = i
        self._blocks: list[Tensor | None] = [like.new_empty(n, width) for n in sizes]

    def segment(self, i: int) -> Tensor:
        block, start, end = self._where[i]
        stored = self._blocks[block]
        assert stored is not None
        return stored[start:end]

    def take(self, i: int) -> Tensor:
        rows = self.segment(i)
        block = self._where[i][0]
        if self._last[block] == i:
            self._blocks[block] = None
        return rows


def accumulation_targets(params: Sequence[Tensor | None], needed: Sequence[bool]) -> tuple[Tensor | None, ...]:
    """Per parameter, its ``.grad`` when backward may add the gradient straight into it
    (else None): a leaf whose ``.grad`` already holds a plain dense tensor of its own
    shape, dtype and device, no other parameter's, with no tensor hooks, whose gradient this
    backward accumulates (not ``torch.autograd.grad`` or ``backward(inputs=...)`` leaving it
    out, not ``create_graph``: call it before ``once_differentiable`` turns grad mode off).
    That skips a gradient-sized allocation and AccumulateGrad's add, which for E experts'
    weights is E times a dense MLP's: gradient accumulation over micro-batches, or
    ``zero_grad(set_to_none=False)``. AccumulateGrad itself adds in place in exactly these
    cases, so ``.grad`` keeps its identity; it then receives None, and its post-accumulate
    hooks (DDP's, ``register_post_accumulate_grad_hook``) see the summed ``.grad`` as usual."""
    if torch.is_grad_enabled():
        return (None,) * len(params)
    targets = [_target(p) if p is not None and need else None for p, need in zip(params, needed, strict=True)]
    shared = {id(t) for i, t in enumerate(targets) if t is not None and any(t is u for u in targets[:i])}
    return tuple(None if id(t) in shared else t for t in targets)


def _target(param: Tensor) -> Tensor | None:
    grad = param.grad
    if (
        grad is None
        or type(grad) is not Tensor
        or not param.is_leaf
        or param._backward_hooks
        or grad.layout != torch.strided
        or grad.requires_grad
        or grad.shape != param.shape
        or grad.dtype != param.dtype
        or grad.device != param.device
        or not grad.is_contiguous()
    ):
        return None
    try:
        runs = torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(param).node)
    except RuntimeError:  # not under the eager engine (compiled autograd): the plain path
        return None
    return grad if runs else None


class LoopGrads:
    """The weight (and bias) gradients of one backward, summed over every run that
    reaches them: into fresh tensors, or added straight into the ``.grad`` that
    ``accumulation_targets`` found for a weight (``into``, in ``LoopWeights.tensors()``
    order)."""

    def __init__(self, weights: LoopWeights, into: Sequence[Tensor | None] | None = None) -> None:
        into = into or (None,) * 6
        self._into = {id(t) for t in into if t is not None}

        def grad(w: Tensor | None, target: Tensor | None) -> Tensor | None:
            if w is None:
                return None
            return target if target is not None else torch.empty_like(w)

        self.w1, self.w3, self.w2, self.b1, self.b3, self.b2 = (
            grad(w, t) for w, t in zip(weights.tensors(), into, strict=True)
        )
        self._written: set[tuple[int, int]] = set()

    def _first(self, into: Tensor, e: int) -> bool:
        if id(into) in self._into:
            return False
        key = (id(into), e)
        first = key not in self._written
        self._written.add(key)
        return first

    def add(self, into: Tensor, a: Tensor, b: Tensor, e: int) -> None:
        """``into[e] += a @ b``; an expert's first contribution to a fresh tensor writes
        instead of adding."""
        if self._first(into, e):
            torch.mm(a, b, out=into[e])
        else:
            into[e].addmm_(a, b)

    def add_bias(self, into: Tensor | None, rows: Tensor, e: int) -> None:
        """``into[e] += rows.sum(0)`` (a bias's gradient), if there is a bias."""
        if into is None:
            return
        if self._first(into, e):
            torch.sum(rows, 0, out=into[e])
        else:
            into[e] += rows.sum(0)

    def finish(self) -> tuple[Tensor | None, ...]:
        """``(grad_w1, grad_w3, grad_w2, grad_b1, grad_b3, grad_b2)`` for autograd: None
        where there is no such weight or its gradient went into its ``.grad``; in a fresh
        tensor, experts no row reached get zeros."""
        grads = (self.w1, self.w3, self.w2, self.b1, self.b3, self.b2)
        for grad in grads:
            if grad is None or id(grad) in self._into:
                continue
            for e in range(grad.shape[0]):
                if (id(grad), e) not in self._written:
                    grad[e].zero_()
        return tuple(None if g is None or id(g) in self._into else g for g in grads)


class _Scratch:
    """Buffers one loop call reuses from segment to segment, each sized for the largest
    segment: a segment's temporaries are written into the ones its predecessor used, which
    are warm in cache and resident, instead of into fresh allocations whose pages the OS
    must first hand over (a fault per 4 KiB page, each about a microsecond on a virtual
    machine). ``rows(name, n, width)`` is an ``[n, width]`` view of buffer ``name``."""

    def __init__(self, segments: list[Segment], like: Tensor) -> None:
        self._most = max((end - start for _, start, end in segments), default=0)
        self._like = like
        self._buffers: dict[str, Tensor] = {}

    def rows(self, name: str, n: int, width: int) -> Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n * width:
            buf = self._buffers[name] = self._like.new_empty(max(n, self._most) * width)
        return buf[: n * width].view(n, width)


def _activate_into(activation: str, h1: Tensor, h3: Tensor | None, out: Tensor) -> Tensor:
    """``activate(activation, h1, h3)`` written into ``out``."""
    if activation == "swiglu":
        assert h3 is not None
        return torch.ops.aten.silu.out(h1, out=out).mul_(h3)
    if activation == "gelu":
        return torch.ops.aten.gelu.out(h1, out=out)
    return torch.ops.aten.relu.out(h1, out=out)


def loop_forward(
    x: Tensor,
    segments: list[Segment],
    weights: LoopWeights,
    out: Tensor,
    token_idx: Tensor | None = None,
    weight: Tensor | None = None,
) -> tuple[PreActivations, PreActivations | None]:
    """Run the segments' rows through their experts into ``out`` (rows form: the segments'
    rows of ``out``; token form: added into ``out`` ``[T, d]``, which must start at zero).
    Returns the pre-activations ``loop_backward`` needs."""
    w1, w3, w2, b1, b3, b2 = weights.tensors()
    d_ff, d_out = w1.shape[2], w2.shape[2]
    pre1 = PreActivations(segments, d_ff, x)
    pre3 = PreActivations(segments, d_ff, x) if w3 is not None else None
    scratch = _Scratch(segments, x)
    for i, (e, start, end) in enumerate(segments):
        n = end - start
        if token_idx is None:
            xe = x[start:end]
        else:
            xe = torch.index_select(x, 0, token_idx[start:end], out=scratch.rows("x", n, x.shape[1]))
        h1 = _linear(xe, w1[e], b1[e] if b1 is not None else None, out=pre1.segment(i))
        h3 = None
        if pre3 is not None:
            assert w3 is not None
            h3 = _linear(xe, w3[e], b3[e] if b3 is not None else None, out=pre3.segment(i))
        act = _activate_into(weights.activation, h1, h3, scratch.rows("act", n, d_ff))
        bias2 = b2[e] if b2 is not None else None
        if token_idx is None:
            _linear(act, w2[e], bias2, out=out[start:end])
        else:
            assert weight is not None
            ye = _linear(act, w2[e], bias2, out=scratch.rows("y", n, d_out)).mul_(weight[start:end, None])
            out.index_add_(0, token_idx[start:end], ye)
    return pre1, pre3


def loop_backward(
    x: Tensor,
    segments: list[Segment],
    weights: LoopWeights,
    pre: tuple[PreActivations, PreActivations | None],
    grad_out: Tensor,
    grads: LoopGrads,
    grad_x: Tensor | None,
    token_idx: Tensor | None = None,
    weight: Tensor | None = None,
    grad_weight: Tensor | None = None,
) -> None:
    """Backward of ``loop_forward``: weight gradients into ``grads``; the rows' gradients
    into ``grad_x`` (rows form: written into the segments' rows; token form: added, so it
    must start at zero) unless it is None; the routing weights' gradients into
    ``grad_weight`` unless it is None."""
    w1, w3, w2, b2 = weights.w1, weights.w3, weights.w2, weights.b2
    d_ff, d_in, d_out = w1.shape[2], w1.shape[1], w2.shape[2]
    pre1, pre3 = pre
    swiglu = weights.activation == "swiglu"
    scratch = _Scratch(segments, x)
    for i, (e, start, end) in enumerate(segments):
        n = end - start
        h1 = pre1.take(i)
        h3 = pre3.take(i) if pre3 is not None else None
        # "act" holds the activation until the w2 gradient, then the h1 gradient.
        act = _activate_into(weights.activation, h1, h3, scratch.rows("act", n, d_ff))
        grad_act = scratch.rows("grad_act", n, d_ff)
        if token_idx is None:
            xe, grad = x[start:end], grad_out[start:end]
            torch.mm(grad, w2[e].t(), out=grad_act)
        else:
            assert weight is not None
            idx, w = token_idx[start:end], weight[start:end, None]
            xe = torch.index_select(x, 0, idx, out=scratch.rows("x", n, d_in))
            # "grad" holds the output gradient until the w2 gradient, then the input's.
            grad = torch.index_select(grad_out, 0, idx, out=scratch.rows("grad", n, d_out))
            torch.mm(grad, w2[e].t(), out=grad_act)
            if grad_weight is not None:
                # d/dw <grad, w * (act @ w2 + b2)> = <grad @ w2.T, act> + <grad, b2>: no
                # [N, d] output is kept.
                rowwise_dot(grad_act, act, grad_weight[start:end])
                if b2 is not None:
                    grad_weight[start:end].addmv_(grad, b2[e])
            grad.mul_(w)
            grad_act.mul_(w)
        grads.add(grads.w2, act.t(), grad, e)
        grads.add_bias(grads.b2, grad, e)
        grad_h1 = act
        grad_h3 = None
        if swiglu:
            assert w3 is not None and h3 is not None and grads.w3 is not None
            grad_h3 = torch.ops.aten.silu.out(h1, out=scratch.rows("grad_h3", n, d_ff)).mul_(grad_act)
            torch.ops.aten.silu_backward.grad_input(grad_act.mul_(h3), h1, grad_input=grad_h1)
            grads.add(grads.w3, xe.t(), grad_h3, e)
            grads.add_bias(grads.b3, grad_h3, e)
        elif weights.activation == "gelu":
            torch.ops.aten.gelu_backward.grad_input(grad_act, h1, grad_input=grad_h1)
        else:
            torch.ops.aten.threshold_backward.grad_input(grad_act, h1, 0, grad_input=grad_h1)
        grads.add(grads.w1, xe.t(), grad_h1, e)
        grads.add_bias(grads.b1, grad_h1, e)
        if grad_x is not None:
            into = grad_x[start:end] if token_idx is None else scratch.rows("grad", n, d_in)
            grad_xe = torch.mm(grad_h1, w1[e].t(), out=into)
            if grad_h3 is not None:
                assert w3 is not None
                grad_xe.addmm_(grad_h3, w3[e].t())
            if token_idx is not None:
                grad_x.index_add_(0, token_idx[start:end], grad_xe)


class ExpertLoop(torch.autograd.Function):
    """One run of the loop as an autograd Function: ``apply(x, token_idx, weight, segments,
    activation, w1, w3, w2, b1, b3, b2)`` -> rows form ``[N, d]``, token form ``[T, d]``."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        token_idx: Tensor | None,
        weight: Tensor | None,
        segments: list[Segment],
        activation: str,
        w1: Tensor,
        w3: Tensor | None,
        w2: Tensor,
        b1: Tensor | None,
        b3: Tensor | None,
        b2: Tensor | None,
    ) -> Tensor:
        weights = LoopWeights(activation, w1, w3, w2, b1, b3, b2)
        out = x.new_empty(x.shape[0], w2.shape[2]) if token_idx is None else x.new_zeros(x.shape[0], w2.shape[2])
        # Intermediates, not inputs or outputs: kept on ctx so that backward can drop them.
        ctx.pre = loop_forward(x, segments, weights, out, token_idx, weight)
        ctx.segments, ctx.activation = segments, activation
        ctx.save_for_backward(x, token_idx, weight, w1, w3, w2, b1, b3, b2)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        ctx.into = accumulation_targets(ctx.saved_tensors[3:], ctx.needs_input_grad[5:])
        return ExpertLoop._backward(ctx, grad_out)

    @staticmethod
    @once_differentiable
    def _backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, token_idx, weight, *params = ctx.saved_tensors
        weights = LoopWeights(ctx.activation, *params)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.empty_like(x) if token_idx is None else torch.zeros_like(x)
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[2] else None
        into, ctx.into = ctx.into, None  # no .grad kept alive by a retained graph
        grads = LoopGrads(weights, into)
        pre, ctx.pre = ctx.pre, None
        loop_backward(x, ctx.segments, weights, pre, grad_out, grads, grad_x, token_idx, weight, grad_weight)
        return grad_x, None, grad_weight, None, None, *grads.finish()
