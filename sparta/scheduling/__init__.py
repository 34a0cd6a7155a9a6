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

__all__ = [
    "UNPIPELINED",
    "Calibration",
    "Choice",
    "CostModel",
    "GapRelease",
    "GradientPartition",
    "LayerShape",
    "LinearFit",
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
    "draw_timeline",
    "overlapped_block",
    "partition_gradients",
    "pipelined_exchange",
    "write_chrome_trace",
]
