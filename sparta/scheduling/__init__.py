"""sparta.scheduling: measure, model and schedule communication against computation.

    profiler.py   Profiler, ProfileConfig, Profile, LinearFit: time collectives, expert
                  GEMMs and routers at several sizes, fit t = alpha + beta * n, save/load JSON
    cost_model.py CostModel, LayerShape, SchedulePlan, Calibration: predict an expert-parallel
                  exchange's forward/backward time for degree r, flat or hierarchical, corrected
                  by timed steps; choose r_fwd, r_bwd and the chunks' taper
    timeline.py   timeline, Timeline: the replay behind it (network FIFO and compute thread)
    pipeline.py   pipelined_exchange: chunk i+1 travels while chunk i computes
    chunks.py     PipelineDegrees(r_fwd, r_bwd, taper): end chunks 2**-taper of the middle ones;
                  Chunks: the rows of each chunk
    microbatch.py overlapped_block, Routed: a block (dense layers, exchange, experts) cut into
                  micro-batches so that one's dense layers compute while another's rows travel
    partition.py  partition_gradients: dense all-reduce pieces sized to the backward's network gaps
    tuner.py      OnlineTuner, Choice: try the model's best plans and r=1 on real steps, keep the
                  fastest (r=1 unless clearly beaten)
    grad_sync.py  GapRelease: when each of those pieces may leave in backward (no hooks of its own:
                  sparta.parallel.DataParallel(partition=...) owns them and sends the pieces)
    varlen.py     LengthCost, MicroBatch, pad_batches, pack_batches, dynamic_batches,
                  bucketed_steps, collate: variable-length samples into micro-batches and
                  pipeline steps (DynaPipe's dynamic programme) against padding and packing
    trace.py      Tracer, TracedExchange, gather, write_chrome_trace, draw_timeline: per-rank
                  timelines for Perfetto and as a PNG; ObservedExchange, what the pipeline
                  tells of its transfers (tracing, the gradient partitioner)

Imports point down only: this package uses sparta.comm and never sparta.moe. The tools that
drive it from outside (`sparta profile`'s launcher, the emulated cluster of network
namespaces) live beside the package, in `sparta_tools`.
"""

from sparta.scheduling.chunks import PipelineDegrees
from sparta.scheduling.cost_model import Calibration, CostModel, LayerShape, Prediction, SchedulePlan
from sparta.scheduling.grad_sync import GapRelease
from sparta.scheduling.microbatch import Routed, overlapped_block
from sparta.scheduling.partition import GradientPartition, partition_gradients
from sparta.scheduling.pipeline import pipelined_exchange
from sparta.scheduling.profiler import LinearFit, Profile, ProfileConfig, Profiler
from sparta.scheduling.timeline import Timeline
from sparta.scheduling.trace import ObservedExchange, TracedExchange, Tracer, draw_timeline, write_chrome_trace
from sparta.scheduling.tuner import UNPIPELINED, Choice, OnlineTuner
from sparta.scheduling.varlen import (
    IGNORE_INDEX,
    LengthCost,
    MicroBatch,
    bucketed_steps,
    collate,
    dynamic_batches,
    pack_batches,
    pad_batches,
    pipeline_seconds,
    summed_loss,
)

__all__ = [
    "IGNORE_INDEX",
    "UNPIPELINED",
    "Calibration",
    "Choice",
    "CostModel",
    "GapRelease",
    "GradientPartition",
    "LayerShape",
    "LengthCost",
    "LinearFit",
    "MicroBatch",
    "ObservedExchange",
    "OnlineTuner",
    "PipelineDegrees",
    "Prediction",
    "Profile",
    "ProfileConfig",
    "Profiler",
    "Routed",
    "SchedulePlan",
    "Timeline",
    "TracedExchange",
    "Tracer",
    "bucketed_steps",
    "collate",
    "draw_timeline",
    "dynamic_batches",
    "overlapped_block",
    "pack_batches",
    "pad_batches",
    "partition_gradients",
    "pipeline_seconds",
    "pipelined_exchange",
    "summed_loss",
    "write_chrome_trace",
]
