"""The sizes, tolerance and router cases every expert-parallel check builds its layers from
(`moe_checks.py`, `moe_block_checks.py`)."""

from __future__ import annotations

EXPERTS, D_MODEL, D_FF, SEQ = 8, 8, 16, 9
TOL = {"atol": 1e-5, "rtol": 1e-5}
CASES = [
    {"router": "topk", "capacity_factor": None, "activation": "gelu"},
    {"router": "topk", "capacity_factor": 1.25, "activation": "swiglu", "expert_bias": True},
    {"router": "switch", "top_k": 1, "capacity_factor": None, "activation": "relu"},
    {"router": "switch", "top_k": 1, "capacity_factor": 1.25, "activation": "gelu"},
    {"router": "sigmoid", "capacity_factor": None, "activation": "relu"},
    {"router": "sigmoid", "capacity_factor": 1.25, "activation": "swiglu"},
    {"router": "xmoe", "capacity_factor": None, "activation": "gelu", "expert_bias": True},
    {"router": "xmoe", "capacity_factor": 1.25, "activation": "gelu"},
    {"router": "expert_choice", "capacity_factor": None, "activation": "gelu"},
    {"router": "soft", "capacity_factor": None, "activation": "gelu"},
]
