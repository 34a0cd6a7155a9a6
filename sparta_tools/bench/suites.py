"""The suites folded in from the scripts under benchmarks/ (moe.py: moe-layer from
benchmarks/moe_layer.py, pipeline from benchmarks/moe_pipeline.py's plans on the launched ranks,
dispatch; embedding.py: embedding from benchmarks/embedding.py; trainer_suite.py: the 3D
trainer's step, whose full comparison across launches is benchmarks/trainer.py).
"""

from __future__ import annotations

from sparta_tools.bench.runner import Suite


def folded() -> list[Suite]:
    from sparta_tools.bench import embedding, moe, trainer_suite

    return [
        Suite("moe-layer", "one MoE layer forward+backward: Sparta, DeepSpeed-MoE, a naive loop, the dense floor",
              moe.add_layer_arguments, moe.MoELayerFlags, moe.run_layer, check=moe.check_dtype, engines=("torch",)),
        Suite("pipeline", "the co-scheduler's plans: pipeline degrees of the expert-parallel exchange, and auto",
              moe.add_pipeline_arguments, moe.PipelineFlags, moe.run_pipeline, check=moe.check_dtype,
              engines=("torch",)),
        Suite("dispatch", "route + dispatch + combine alone, by routing skew (Zipf bias on the router)",
              moe.add_dispatch_arguments, moe.DispatchFlags, moe.run_dispatch, check=moe.check_dispatch,
              engines=("torch",)),
        Suite("embedding", "a step of a large-table model: DDP, Horovod sparse/dense, Sparta row/column sharding",
              embedding.add_arguments, embedding.EmbeddingFlags, embedding.run, check=embedding.check,
              engines=("torch", "horovod")),
        Suite("trainer", "the 3D trainer's step: pipeline x data x tensor (+ expert) parallel",
              trainer_suite.add_arguments, trainer_suite.TrainerFlags, trainer_suite.run, engines=("torch",)),
    ]  # fmt: skip
