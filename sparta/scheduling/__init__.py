"""sparta.scheduling: measure, model and schedule communication against computation.

    profiler.py   Profiler, ProfileConfig, Profile, LinearFit: time collectives and expert
                  GEMMs at several sizes, fit t = alpha + beta * n, save/load JSON
    cost_model.py CostModel, LayerShape, SchedulePlan: predict an expert-parallel exchange's
                  forward/backward time for degree r, flat or hierarchical; choose r_fwd, r_bwd
    pipeline.py   pipelined_exchange, PipelineDegrees: chunk i+1 travels while chunk i computes
    partition.py  partition_gradients: dense all-reduce pieces sized to the backward's network gaps
    tuner.py      OnlineTuner, Choice: try the model's best plans and r=1 on real steps, keep the fastest
    trace.py      Tracer, gather, write_chrome_trace: per-rank timelines for Perfetto
    cluster.py    EmulatedCluster, ClusterConfig: nodes as network namespaces behind tbf links

Imports point down only: this package uses sparta.comm and never sparta.moe.
"""

from sparta.scheduling.cost_model import CostModel, LayerShape, Prediction, SchedulePlan, Timeline
from sparta.scheduling.partition import GradientPartition, partition_gradients
from sparta.scheduling.pipeline import PipelineDegrees, pipelined_exchange
from sparta.scheduling.profiler import LinearFit, Profile, ProfileConfig, Profiler
from sparta.scheduling.trace import Tracer, write_chrome_trace
from sparta.scheduling.tuner import UNPIPELINED, Choice, OnlineTuner

__all__ = [
    "UNPIPELINED",
    "Choice",
    "CostModel",
    "GradientPartition",
    "LayerShape",
    "LinearFit",
    "OnlineTuner",
    "PipelineDegrees",
    "Prediction",
    "Profile",
    "ProfileConfig",
    "Profiler",
    "SchedulePlan",
    "Timeline",
    "Tracer",
    "partition_gradients",
    "pipelined_exchange",
    "write_chrome_trace",
]
