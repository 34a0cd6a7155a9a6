"""sparta.planner: choose the 3D trainer's plan from measured costs (Galvatron, dPRO).

    costs = measure_costs(world.comm, model_cfg, moe_spec)          # every rank, once per hardware
    result = search(costs, Workload(model_cfg, moe_spec, global_batch), world=8, memory_bytes=2 * GIB,
                    base=ParallelConfig(moe=moe_spec))
    best = result.best                                              # Ranked(plan, prediction)
    simulate(costs, workload, best.plan, trace=True).spans          # the predicted timeline

Pieces: costs.py (what is measured, saved and checked against the model and hardware),
parts.py (the model's parts as they are timed: a block's halves, the MoE half, embedding and
head), measure.py (measuring it on the hardware at hand: parts, every group shape, the
optimizer),
zero_bubble.py (what torch's split of a backward into its I and W passes costs, timed
through torch's schedules),
hardware.py (costs of clusters we do not have, from published figures), stage_cost.py (what
one stage costs per micro-batch), simulate.py (a plan priced on the costs: step time, peak
memory, timeline), replay.py (its schedule's actions run on the stages' costs), search.py
(the plans the trainer can run, ranked under a memory budget; plan files), command.py
(`sparta plan`). Variable
lengths (DynaPipe) are sparta.scheduling.varlen's; `length_cost` gives them the measured cost.
It sits above sparta.parallel: it plans for the trainer and imports it, never the reverse.
"""

from sparta.planner.command import workload
from sparta.planner.costs import ModelCosts, PartCost, model_fingerprint
from sparta.planner.hardware import HARDWARE, Hardware, analytic_costs, model_flops_per_step
from sparta.planner.measure import measure_costs
from sparta.planner.plan_file import plan_overrides, write_plan
from sparta.planner.search import GIB, Ranked, SearchResult, Space, layouts, search
from sparta.planner.simulate import Plan, Prediction, Workload, length_cost, simulate, stage_layers

__all__ = [
    "GIB",
    "HARDWARE",
    "Hardware",
    "ModelCosts",
    "PartCost",
    "Plan",
    "Prediction",
    "Ranked",
    "SearchResult",
    "Space",
    "Workload",
    "analytic_costs",
    "layouts",
    "length_cost",
    "measure_costs",
    "model_flops_per_step",
    "model_fingerprint",
    "plan_overrides",
    "search",
    "simulate",
    "stage_layers",
    "workload",
    "write_plan",
]
