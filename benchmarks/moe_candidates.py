"""The candidates of benchmarks/moe_layer.py: they live in sparta_tools.bench.moe_candidates
(installed with Sparta, shared with `sparta bench moe-layer`); this name stays for the script."""

from sparta_tools.bench.moe_candidates import (  # noqa: F401
    AUX_LOSS_COEF,
    CANDIDATES,
    CONFIGS,
    DTYPES,
    EP_CANDIDATES,
    GPU_CONFIGS,
    TOLERANCE,
    UNCHECKED,
    BenchConfig,
    Place,
    Step,
    all_configs,
    build,
    busiest_rank_load,
    make_input,
    reference_output,
    wrong_values,
)
