"""Costs of clusters we do not have, from published figures: a `Hardware` spec turns into the
same `ModelCosts` a measurement gives, so the simulator and the search predict them alike.

Compute: a part's floating-point operations per token (the usual transformer counts, as in
Megatron-LM's 24 h^2 + 4 s h per layer: attention projections 8 d^2, scores 4 s d, dense MLP
4 d d_ff, an MoE layer top_k MLPs plus its router 2 d E, the head 2 d V) over the device's
dense peak times ``gemm_efficiency`` (the share of peak large GEMMs reach: an assumption
of the spec, stated in it, not a fitted value); backward twice the forward, its input half
one forward. Activation memory per token after Korthikanti et al. (sequence-parallel off,
no recomputation): attention 13 d + 5 a s bytes at 2-byte elements, MLP 21 d, an MoE layer
top_k x 19 d + 2 d, the head its logits in float32. AdamW: 16 bytes of traffic per parameter
over the memory bandwidth.

Networks: ring collectives, alpha + (bus factor) x bytes / bandwidth, the bandwidth of
NVLink when a group lies inside one node (size x stride <= devices per node) and of the
node's InfiniBand share per device otherwise; point-to-point alike by its stride.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparta.errors import ConfigError
from sparta.parallel.decoder import DecoderConfig
from sparta.parallel.experts import MoESpec
from sparta.scheduling.profiler import LinearFit

from .costs import ModelCosts, PartCost, model_fingerprint


@dataclass(frozen=True)
class Hardware:
    """One device type and its links, from datasheets. Units: FLOP/s, bytes/s, bytes, seconds.

    peak_flops: dense peak in the training dtype; gemm_efficiency: share of it large GEMMs
    reach (assumed); memory_bw: HBM bandwidth; intra_bw: one device's NVLink bandwidth, one
    direction; inter_bw: one device's share of the node's network, one direction; latency_s:
    a collective's fixed cost; element_bytes: 2 for bfloat16.
    """

    name: str
    peak_flops: float
    gemm_efficiency: float
    memory_bytes: float
    memory_bw: float
    intra_bw: float
    inter_bw: float
    devices_per_node: int
    latency_s: float = 10e-6
    element_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bytes", "memory_bw", "intra_bw", "inter_bw", "latency_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"Hardware.{name}={getattr(self, name)!r} must be > 0")
        if not 0 < self.gemm_efficiency <= 1:
            raise ConfigError(f"Hardware.gemm_efficiency={self.gemm_efficiency!r} must be in (0, 1]")
        if self.devices_per_node < 1:
            raise ConfigError(f"Hardware.devices_per_node={self.devices_per_node!r} must be >= 1")


GB = 1e9
# Datasheet figures; gemm_efficiency 0.75 is an assumption (large bf16 GEMMs under cuBLAS).
HARDWARE = {
    "H100": Hardware(
        "H100 SXM, NVLink 4, 400 Gbit/s InfiniBand per GPU", 989e12, 0.75, 80 * 2**30, 3.35e12, 450 * GB, 50 * GB, 8
    ),
    "A100": Hardware(
        "A100 SXM 80 GB, NVLink 3, 200 Gbit/s InfiniBand per GPU", 312e12, 0.75, 80 * 2**30, 2.0e12, 300 * GB,
        25 * GB, 8,
    ),
}  # fmt: skip


def _fit(seconds_per_unit: float, alpha: float = 0.0) -> LinearFit:
    return LinearFit(alpha, seconds_per_unit, 0.0, ())


def analytic_costs(hw: Hardware, model: DecoderConfig, moe: MoESpec | None, world: int) -> ModelCosts:
    """`ModelCosts` for ``model`` on ``world`` devices of ``hw`` (see the module doc)."""
    d, f, s, v, a = model.d_model, model.d_ff, model.seq_len, model.vocab_size, model.n_heads
    flop_s = hw.peak_flops * hw.gemm_efficiency
    e = hw.element_bytes

    def part(flops_per_token: float, saved_per_token: float, params: int) -> PartCost:
        fwd = flops_per_token / flop_s
        return PartCost(_fit(fwd), _fit(2 * fwd), _fit(fwd), saved_per_token, params)

    mlp_params = 2 * d * f + f + d
    # saved per token, in elements, after Korthikanti et al. (2022) without dropout: the
    # trainer's attention is torch's scaled_dot_product_attention (flash / memory-efficient on
    # CUDA), which keeps q, k, v, its output and a statistic per head and row, not their s x s
    # scores (the 5as term); the norm's input and the projections' inputs make up 6.5d with
    # them. An MLP keeps its norm's and its own input and its hidden layer before and after the
    # activation: 2d + 2f (their 10.5d at f = 4d)
    attention_saved = 13 * d / 2 + a
    mlp_saved = 2 * d + 2 * f
    parts = {
        "embed": part(0.0, 0.0, v * d + s * d),
        "attention": part(8 * d * d + 4 * s * d, attention_saved * e, 4 * d * d + 6 * d),
        "mlp": part(4 * d * f, mlp_saved * e, mlp_params + 2 * d),
        "head": part(2 * d * v, 4 * v + d * e, v * d + 2 * d),
    }
    if moe is not None:
        parts["moe"] = part(
            moe.top_k * 4 * d * f + 2 * d * moe.num_experts,
            (moe.top_k * mlp_saved + 2 * d + moe.num_experts) * e,  # and the router's input and logits
            moe.num_experts * mlp_params + d * moe.num_experts + 2 * d,
        )
    comm: dict[str, LinearFit] = {}
    for g in range(2, world + 1):
        if world % g:
            continue
        for stride in (k for k in range(1, world // g + 1) if (world // g) % k == 0):
            bw = hw.intra_bw if g * stride <= hw.devices_per_node else hw.inter_bw
            comm[f"all_reduce/g{g}s{stride}"] = _fit(2 * (g - 1) / g / bw, hw.latency_s)
            comm[f"all_gather/g{g}s{stride}"] = _fit((g - 1) / bw, hw.latency_s)
            comm[f"all_to_all/g{g}s{stride}"] = _fit((g - 1) / g / bw, hw.latency_s)
    for stride in (k for k in range(1, world + 1) if world % k == 0):
        comm[f"p2p/s{stride}"] = _fit(1 / (hw.intra_bw if 2 * stride <= hw.devices_per_node else hw.inter_bw))
    return ModelCosts(
        parts=parts,
        comm=comm,
        # fused AdamW in float32 reads the parameter, its gradient and two moments and writes
        # three back (28 bytes), and the clip reads the gradient once more
        optimizer=_fit(32 / hw.memory_bw),
        model=model_fingerprint(model, moe),
        hardware={"device": hw.name, "device_type": "cuda", "torch": "analytic (published figures)"},
        world=world,
        element_bytes=e,
        slots=hw.devices_per_node,
        ranks_per_host=hw.devices_per_node,
        ranks_per_node=hw.devices_per_node,
        link_per_rank=True,
    )


def model_flops_per_step(model: DecoderConfig, moe: MoESpec | None, global_batch: int) -> float:
    """Forward + backward FLOPs of one step (3 x forward), without recomputation: what
    model FLOP/s utilisation divides by."""
    d, f, s, v = model.d_model, model.d_ff, model.seq_len, model.vocab_size
    per_token = 0.0
    for layer in range(model.n_layers):
        per_token += 8 * d * d + 4 * s * d
        is_moe = moe is not None and moe.is_moe(layer)
        per_token += (moe.top_k * 4 * d * f + 2 * d * moe.num_experts) if is_moe and moe else 4 * d * f
    per_token += 2 * d * v
    return 3 * per_token * global_batch * s
