"""torchtitan as a peer of Sparta's trainer on this CPU (torchtitan 0.3.0, torch 2.13):
the smallest patches that let it train here (`patch_torchtitan_for_cpu`, each one stated),
its training step as its Trainer runs it (`TorchtitanRun`), and its own Llama in the layout
Sparta's parallelize takes (`TorchtitanLlama`), for comparing the two trainers on one model.

Used by benchmarks/trainer.py in torchtitan's own launches only: the patches replace
torchtitan's modules and stand-ins for modules Sparta never imports, nothing else.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from sparta_tools.bench.trainer import LR, MAX_NORM, SEED, TORCHTITAN_INSTALL, ModelShape


def patch_torchtitan_for_cpu() -> None:
    """THE TORCHTITAN PATCHES (torchtitan 0.3.0, torch 2.13 CPU), applied in torchtitan's
    own benchmark processes only, before torchtitan is imported. Nothing else is changed."""
    import types

    class _Absent(types.ModuleType):
        """A module whose every attribute is an inert class: satisfies imports never used here."""

        def __getattr__(self, name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

    # 1. its MoE async-EP module imports triton unconditionally (GPU kernels; a dense Llama never calls them)
    # 2. its Trainer module imports tensorboard and HF datasets at import time (logging and data we do not use)
    for module in (
        "torchtitan.distributed.minimal_async_ep.kernels",
        "torch.utils.tensorboard",
        "datasets",
        "datasets.distributed",
    ):
        sys.modules.setdefault(module, _Absent(module))
    import torchtitan.distributed.fsdp as tt_fsdp
    import torchtitan.distributed.parallel_dims as tt_dims
    import torchtitan.models.llama3 as tt_llama3
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.models.common.attention import ScaledDotProductAttention

    # 3. its device falls back to "cuda" when none is available; the mesh must be on "cpu"
    tt_dims.device_type = "cpu"
    # 4. 0.3.0 refuses "sdpa" for LMs and FlexAttention has no CPU backward; with one full-length
    #    document per row (no masks) its causal SDPA module is the same attention
    tt_llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()  # type: ignore[attr-defined]

    # 5. FSDP's divide factor 1.0 becomes ReduceOp.PREMUL_SUM(1.0), which gloo lacks; a plain
    #    SUM (force_sum_reduction_for_comms) is the same reduction
    def sum_without_division(model: torch.nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = sum_without_division  # type: ignore[assignment]


def _torchtitan_model(spec: Any, config: Any, materialise: bool = True) -> torch.nn.Module:
    """torchtitan's model of ``spec`` under ``config``, seeded; left on the meta device with
    ``materialise=False`` (for torchtitan's parallelize to shard it first)."""
    model_config = spec.model
    model_config.update_from_config(config=config)
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = model_config.build()
    if materialise:
        _materialise(model)
    return model


def _materialise(model: torch.nn.Module) -> None:
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()


class TorchtitanLlama(torch.nn.Module):
    """torchtitan's own Llama (the same modules and weights torchtitan trains) in the layout
    Sparta's parallelize takes (tok_emb, layers, norm, output): Sparta's trainer on the very
    model torchtitan runs, for a comparison of the trainers alone. No tp_plan: TP and
    pipeline cuts are not offered (its fused QKV projection needs torchtitan's own TP plan)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.tok_emb, self.layers = model.tok_embeddings, model.layers
        self.norm, self.output = model.norm, model.lm_head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_emb(ids)
        for layer in self.layers.values():
            h = layer(h, None, None)  # no attention masks (full causal rows), default positions
        return self.output(self.norm(h))


class TorchtitanRun:
    """torchtitan's debug Llama under its own parallelize_llama (TP and FSDP2 by its
    ParallelDims), float32, its CrossEntropyLoss (sum over tokens / global token count),
    clip_grad_norm_ and AdamW: Trainer.train_step without data loading, logging, checkpoints
    and LR schedule. spmd_backend "partial_dtensor": the default "spmd_types" needs the
    Trainer's input annotations and refuses TP/FSDP here."""

    def __init__(self, shape: ModelShape, tp: int, fsdp: int) -> None:
        import torchtitan.distributed.utils as tt_utils
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.components.optimizer import default_adamw
        from torchtitan.config import ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.models.common.config_utils import decoder_vocab_size
        from torchtitan.models.llama3 import model_registry, parallelize_llama
        from torchtitan.trainer import Trainer

        spec = model_registry("debugmodel")
        config = Trainer.Config(
            model_spec=spec,
            loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
            optimizer=default_adamw(lr=LR),
            training=TrainingConfig(
                local_batch_size=shape.batch,
                seq_len=shape.seq_len,
                max_norm=MAX_NORM,
                mixed_precision_param="float32",
            ),
            parallelism=ParallelismConfig(
                tensor_parallel_degree=tp, data_parallel_shard_degree=fsdp, spmd_backend="partial_dtensor"
            ),
            activation_checkpoint=None,
        )
        self.dims = ParallelDims.from_config(config.parallelism, dist.get_world_size())
        self.dims.build_mesh()
        tt_utils.set_spmd_backend(config.parallelism.spmd_backend)
        self.spec, self.config = spec, config  # for the same model under Sparta's trainer
        model = _torchtitan_model(spec, config, materialise=False)
        model = parallelize_llama(
            model,
            parallel_dims=self.dims,
            training=config.training,
            parallelism=config.parallelism,
            compile_config=config.compile,
            ac_config=None,
            dump_folder=str(Path(os.environ.get("TMPDIR", "/tmp")) / "torchtitan-bench"),
        )
        _materialise(model)
        self.model, self.utils = model, tt_utils
        self.optimizers = config.optimizer.build(model_parts=[model])
        self.loss_fn = config.loss.build(compile_config=config.compile)
        self.params = sum(p.numel() for p in model.parameters())  # DTensors count their global size
        self.tp, self.fsdp = tp, fsdp
        self.dp_rank = self.dims.get_mesh("batch").get_local_rank() if self.dims.dp_enabled else 0

    def copy(self) -> TorchtitanLlama:
        """The same model with this one's weights (gathered: torchtitan initialises its
        shards, which draws other numbers than a whole model's init), unsharded, in Sparta's
        layout. Collective."""
        model = _torchtitan_model(self.spec, self.config)
        state = self.model.state_dict()
        model.load_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()})
        return TorchtitanLlama(model)

    def __call__(self, ids: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizers.zero_grad()
        tokens = torch.tensor(targets.numel(), dtype=torch.int64)
        if self.dims.dp_enabled:
            tokens = self.utils.dist_sum_tensor(tokens, self.dims.get_mesh("batch"))
        loss, _ = self.loss_fn(self.model(ids), targets, tokens)
        loss.backward()
        self.utils.clip_grad_norm_(
            list(self.model.parameters()), MAX_NORM, foreach=True, pp_mesh=None, ep_enabled=False
        )
        self.optimizers.step()
        # the global mean: this rank's share summed over the world, each dp share counted tp times
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        return float(total) / self.tp


def torchtitan_missing() -> str | None:
    """None if torchtitan 0.3.0 and what its import chain needs are installed, else why not."""
    import importlib.metadata
    import importlib.util

    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return f"torchtitan is not installed: {TORCHTITAN_INSTALL}"
    if version != "0.3.0":
        return f"torchtitan {version} is installed; the CPU patches here are for 0.3.0"
    absent = [m for m in ("spmd_types", "torchdata", "tyro", "docstring_parser") if importlib.util.find_spec(m) is None]
    if absent:
        return f"torchtitan 0.3.0 needs {', '.join(absent)}: {TORCHTITAN_INSTALL}"
    return None
