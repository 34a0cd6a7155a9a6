"""Every collective over message sizes, for each engine, on 4 ranks: `sparta bench
collectives` (sparta_tools/bench/collectives.py) with this file's defaults.

    python benchmarks/collectives.py                     # torch, mpi, horovod; 4 KiB .. 64 MiB
    python benchmarks/collectives.py --ops all_to_all -e 1M --engines torch    # any of its flags

Each point is checked against a seeded oracle, then timed in three variants run alternately:
`raw` (the engine's own call), `sparta` (Communicator with check_inputs off) and
`sparta+check` (the default, with agreed input checks). What the checks cost on small
messages, where their round trip shows most (the figure in CommConfig's docstring):

    python benchmarks/collectives.py --engines torch --nprocs 2 --ops all_reduce,all_to_all \\
        -b 1K -e 1K -n 2000 --variants sparta,sparta+check
"""

from __future__ import annotations

import sys

from sparta.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "collectives", "--nprocs", "4", *sys.argv[1:]]))
