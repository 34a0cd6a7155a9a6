"""DeepSpeed-MoE as a baseline: it lives in sparta_tools.bench.deepspeed_peer (installed with
Sparta, shared with `sparta bench moe-layer`); this name stays for the scripts."""

from sparta_tools.bench.deepspeed_peer import deepspeed_ready, deepspeed_step  # noqa: F401
