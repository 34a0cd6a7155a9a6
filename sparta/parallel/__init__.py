"""sparta.parallel: the 3D trainer (data x tensor x pipeline, plus expert parallel).

    world = sparta.init()
    layout = build_layout(ParallelDims(pp=2, dp=2, tp=2, ep=2), world)
    torch.manual_seed(0); model = Decoder(DecoderConfig())          # same model on every rank
    pm = parallelize(model, layout, ParallelConfig(schedule="1F1B", microbatches=4, moe=MoESpec(8, 2)))
    opt = torch.optim.AdamW(pm.param_groups(), lr=3e-4, fused=True)
    loss = pm.step(ids, targets); pm.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

Pieces: dims.py (ParallelDims, Layout), decoder.py (the reference model), pipeline.py (stage
cuts, schedules and their action lists), data_parallel.py (one piece, four strategies; dp_rules.py:
its parameter kinds, FSDP2's units, its checks),
experts.py (MoESpec), parallel_config.py (ParallelConfig), vocab_stages.py (the head and
the token embedding as pipeline stages of vocabulary rows), parallelize.py (composes them),
model.py (ParallelModel: the step),
checkpoint.py (DCP, any layout to any other), hf.py (Hugging Face Llama and GPT-2 in the
Decoder's layout), config.py + config_file.py + train.py + train_report.py (`sparta train`).
"""

from sparta.parallel.checkpoint import Checkpointer, CheckpointError
from sparta.parallel.config import RunConfig
from sparta.parallel.config_file import load_config
from sparta.parallel.data_parallel import DataParallel
from sparta.parallel.decoder import Decoder, DecoderConfig
from sparta.parallel.dims import Layout, ParallelDims, build_layout
from sparta.parallel.dp_rules import STRATEGIES
from sparta.parallel.experts import MoESpec, moe_layers
from sparta.parallel.hf import HFGPT2, HFDecoder, HFLlama, from_hf
from sparta.parallel.model import ParallelModel
from sparta.parallel.parallel_config import ParallelConfig
from sparta.parallel.parallelize import ParallelPlan, parallelize
from sparta.parallel.pipeline import SCHEDULES, ZERO_BUBBLE, format_actions, schedule_actions
from sparta.parallel.train import train

__all__ = [
    "HFGPT2",
    "SCHEDULES",
    "STRATEGIES",
    "ZERO_BUBBLE",
    "CheckpointError",
    "Checkpointer",
    "DataParallel",
    "Decoder",
    "DecoderConfig",
    "HFDecoder",
    "HFLlama",
    "Layout",
    "MoESpec",
    "ParallelConfig",
    "ParallelDims",
    "ParallelModel",
    "ParallelPlan",
    "RunConfig",
    "build_layout",
    "format_actions",
    "from_hf",
    "load_config",
    "moe_layers",
    "parallelize",
    "schedule_actions",
    "train",
]
