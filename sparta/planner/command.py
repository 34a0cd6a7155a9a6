"""`sparta plan`: measure a model's costs on this hardware, then search its plans.

    torchrun --nproc-per-node 8 -m sparta.cli plan --config run.toml --measure costs.json
    sparta plan --config run.toml --costs costs.json --world 8 --memory 2 --out plan.toml
    sparta plan --config big.toml --hardware H100 --world 1024 --memory 80 --schedules 1F1B
    torchrun --nproc-per-node 8 -m sparta.cli train --config run.toml --plan plan.toml

The first runs on as many ranks as the plans will (so collectives of every group size and
the ranks' competition for shared cores are measured); the second is one process, pure
arithmetic on the saved costs, or (``--hardware``) on costs from published figures for a
cluster we do not have (hardware.py).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from sparta.errors import ConfigError
from sparta.parallel.config import RunConfig
from sparta.parallel.config_file import load_config
from sparta.parallel.parallel_config import EMBEDDINGS
from sparta.scheduling.trace import write_chrome_trace

from .costs import ModelCosts, hardware_fingerprint
from .hardware import HARDWARE, analytic_costs
from .measure import measure_costs
from .plan_file import write_plan
from .search import GIB, SearchResult, Space, search
from .simulate import Workload, simulate


def workload(config: RunConfig) -> Workload:
    """What `config` trains, as the planner prices it: its model, MoE spec and global batch."""
    return Workload(config.model, config.parallel.moe, config.train.global_batch)


def main(args: argparse.Namespace) -> int:
    """`sparta plan`: measure costs (--measure), or search plans and print and write the best; the exit code."""
    try:
        config = load_config(args.config)
        if args.measure:
            return _measure(config, args.measure)
        if bool(args.costs) == bool(args.hardware) or args.world < 1 or args.memory <= 0:
            raise ConfigError(
                "give --costs FILE (from --measure) or --hardware NAME (published figures: "
                f"{', '.join(HARDWARE)}), --world N >= 1 and --memory GiB > 0"
            )
        work = workload(config)
        max_tp = None
        if args.hardware:
            if args.hardware not in HARDWARE:
                raise ConfigError(f"--hardware {args.hardware!r} is unknown; choose one of {', '.join(HARDWARE)}")
            hw = HARDWARE[args.hardware]
            costs = analytic_costs(hw, work.model, work.moe, args.world)
            max_tp = hw.devices_per_node
        else:
            costs = ModelCosts.load(args.costs)
            costs.check(work.model, work.moe, None if args.any_hardware else _here(config, args.world))
        embeddings = tuple(args.embeddings.split(",")) if args.embeddings else EMBEDDINGS
        if any(e not in EMBEDDINGS for e in embeddings):
            raise ConfigError(f"--embeddings {args.embeddings}: choose from {', '.join(EMBEDDINGS)}")
        space = Space(
            schedules=tuple(args.schedules.split(",")) if args.schedules else None,
            max_microbatches=args.max_microbatches or None,
            max_tp=max_tp,
            embeddings=embeddings,
        )
        result = search(costs, work, args.world, args.memory * GIB, config.parallel, space)
        _report(result, args.top)
        best = result.best
    except ConfigError as e:
        print(f"sparta plan: {e}", file=sys.stderr, flush=True)
        return 2
    if args.out:
        write_plan(args.out, best, work, args.world, costs)
        print(f"wrote {args.out}: sparta train --config {args.config} --plan {args.out}")
    if args.trace:
        spans = simulate(costs, work, best.plan, trace=True).spans
        write_chrome_trace(args.trace, spans)
    return 0


def _device(config: RunConfig) -> torch.device:
    return torch.device(config.train.device)


def _here(config: RunConfig, world: int) -> dict[str, object]:
    """This machine's fingerprint, to compare with the costs' (`ModelCosts.check`)."""
    device = _device(config)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "train.device is 'cuda' but this machine has no GPU to compare with the costs' hardware: "
            "plan on the GPU machine, or pass --any-hardware to take the costs as they are"
        )
    return hardware_fingerprint(device, world)


def _measure(config: RunConfig, path: str) -> int:
    import sparta
    from sparta.comm import detect
    from sparta.parallel.train import cpu_threads

    if config.train.device == "cpu":  # as `sparta train` will run: the costs are its parts' times
        torch.set_num_threads(cpu_threads(detect().local_size))
    world = sparta.init()
    try:
        costs = measure_costs(
            world.comm,
            config.model,
            config.parallel.moe,
            _device(config),
            max_sequences=config.train.global_batch,
            ranks_per_node=detect().local_size,  # the launcher's node, behind one link
        )
        if world.rank == 0:
            costs.save(path)
            print(f"wrote {path}: {len(costs.parts)} parts, {len(costs.comm)} collective fits, {world.size} ranks")
    finally:
        world.shutdown()
    return 0


def _report(result: SearchResult, top: int) -> None:
    """The best plans, one JSON record each, then why the others were left out."""
    for rank, r in enumerate(result.fits[:top]):
        p = r.prediction
        record = {
            "rank": rank + 1,
            "plan": r.plan.describe(),
            "step_s": round(p.step_s, 6),
            "pipeline_s": round(p.pipeline_s, 6),
            "sync_s": round(p.sync_s, 6),
            "optimizer_s": round(p.optimizer_s, 6),
            "peak_gib": round(p.max_peak_bytes / GIB, 4),
        }
        print(json.dumps(record))
    print(
        json.dumps(
            {
                "fit": len(result.fits),
                "over_budget": len(result.over_budget),
                "smallest_over_budget_gib": round(result.over_budget[0].prediction.max_peak_bytes / GIB, 4)
                if result.over_budget
                else None,
                "rejected": result.rejected,
            }
        )
    )
