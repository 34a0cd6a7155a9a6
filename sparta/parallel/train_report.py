"""What a training run reports as it goes (train.py's loop calls these): rank 0's metrics file
(one JSON record a step), the torch.profiler trace of chosen steps, the progress bar and its
line (loss, tokens/s, MFU, peak memory, expert load), and the figures they show.
"""

from __future__ import annotations

import json
import resource
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from sparta.moe import MoELayer

from .config import RunConfig

SPARK = "▁▂▃▄▅▆▇█"


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory in MiB: the CUDA caching allocator's peak on CUDA, the
    resident-set high-water mark on CPU (ru_maxrss is KiB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def expert_load(layers: list[MoELayer]) -> tuple[float | None, str]:
    """Max/mean tokens per expert of the most unbalanced layer, and its counts as a sparkline."""
    counts = [s.tokens_per_expert for s in (layer.last_stats for layer in layers) if s is not None]
    if not counts:
        return None, ""
    worst = max(counts, key=lambda c: max(c) / max(1, sum(c)))
    peak, mean = max(worst), sum(worst) / len(worst)
    spark = "".join(SPARK[min(len(SPARK) - 1, int(c / max(1, peak) * len(SPARK)))] for c in worst)
    return peak / max(mean, 1e-9), spark


def _trace_path(path: str, rank: int) -> Path:
    p = Path(path)
    return p if rank == 0 else p.with_name(f"{p.stem}.rank{rank}{p.suffix}")


class StepTracer:
    """torch.profiler over steps [start, start + steps); writes the Chrome trace when done."""

    def __init__(self, config: RunConfig, rank: int, device: torch.device) -> None:
        out = config.output
        self.path = _trace_path(out.trace, rank) if out.trace else None
        # 0-based steps [start, stop): trace_start counts from 1, as the metrics do
        self.start, self.stop = out.trace_start - 1, out.trace_start - 1 + out.trace_steps
        self.device = device
        self.profiler: torch.profiler.profile | None = None

    def before(self, step: int) -> None:
        """Start the profiler at the first traced step."""
        if self.path is not None and step == self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=False)
            self.profiler.start()

    def region(self, step: int) -> Any:
        """The profiler's labelled region around step ``step`` (nothing when not tracing)."""
        return torch.profiler.record_function(f"step {step + 1}") if self.profiler is not None else nullcontext()

    def close(self) -> None:
        """Stop a profiler still running (a run that failed inside the traced steps), unexported."""
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None

    def after(self, step: int, last: bool) -> None:
        """Stop and write the trace after the last traced step (or the run's last)."""
        if self.profiler is not None and (step + 1 == self.stop or last):
            self.profiler.stop()
            assert self.path is not None
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(self.path))
            self.profiler = None


class MetricsFile:
    """Rank 0's JSONL file: one record per step, flushed as written (a killed run keeps its lines)."""

    def __init__(self, path: str | None, rank: int, resume_step: int) -> None:
        self.file = None
        if path is not None and rank == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a" if resume_step else "w")  # noqa: SIM115 - closed by close()

    def write(self, record: dict[str, Any]) -> None:
        """Append one step's record as a JSON line (rank 0), flushed."""
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        """Close the file (rank 0)."""
        if self.file is not None:
            self.file.close()


def say_above_bar(message: str) -> None:
    """Print ``message`` above rank 0's progress bar."""
    from tqdm import tqdm

    tqdm.write(message)  # above the bar, not through it


def progress_bar(show: bool, total: int, initial: int) -> Any:
    """The tqdm bar over the run's steps (disabled where ``show`` is False)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not show, unit="step", mininterval=0.5, dynamic_ncols=True)


def postfix(record: dict[str, Any], spark: str) -> str:
    """The bar's text for one step's record: loss, tokens/s, MFU, peak memory, expert load."""
    parts = [f"loss {record['loss']:.3f}", f"{record['tokens_per_s']:,.0f} tok/s"]
    if record["mfu"] is not None:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    parts.append(f"peak {record['peak_mem_mb']:,.0f} MiB")
    if record["expert_load"] is not None:
        parts.append(f"load max/mean {record['expert_load']:.2f} {spark}")
    return " | ".join(parts)
