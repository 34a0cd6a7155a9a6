"""Run a command on an emulated cluster of N nodes x R ranks behind a shaped link (needs root).

    python benchmarks/cluster.py --nodes 2 --ranks-per-node 2 --rate 1gbit
        probes the links: prints one JSON line per (operation, group, size) with the time
    python benchmarks/cluster.py --nodes 2 --ranks-per-node 2 --rate 300mbit -- python my.py ...
        runs `python my.py ...` on every rank, inside its node's namespace, as torchrun would
        (the script should call sparta.init(backend="torch", ranks_per_node=2))

Namespaces, links and ranks are removed at exit, on Ctrl-C, on SIGTERM and on error.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sparta_tools.cluster import ClusterConfig, EmulatedCluster  # noqa: E402

PROBE_MIB = (1, 4, 16)


def probe(ranks_per_node: int, repeats: int) -> None:
    """On every rank: all-reduce and all-to-all inside a node, across nodes and over all."""
    import sparta

    torch.set_num_threads(1)
    world = sparta.init(backend="torch", ranks_per_node=ranks_per_node)
    intra, inter = world.node_comms()
    for mib in PROBE_MIB:
        x = torch.ones(mib * 2**18)  # float32: 2**18 per MiB
        for group, comm in (("intra", intra), ("inter", inter), ("world", world.comm)):
            for op in ("all_reduce", "all_to_all"):
                fn = getattr(comm, op)
                n = x.numel() - x.numel() % comm.size
                fn(x[:n])  # warm-up: connections, buffers
                world.comm.barrier()
                start = time.perf_counter()
                for _ in range(repeats):
                    fn(x[:n])
                dt = (time.perf_counter() - start) / repeats
                slowest = world.comm.all_reduce(torch.tensor([dt], dtype=torch.float64))
                if world.rank == 0:
                    mean = float(slowest.item()) / world.size  # type: ignore[union-attr]
                    print(json.dumps({"op": op, "group": group, "mib": mib, "ms": round(mean * 1e3, 2)}), flush=True)
    world.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--rate", default="1gbit", help="each node's link rate, as tc writes it (100mbit, 1gbit)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--probe-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="after --: what each rank runs")
    args = ap.parse_args()
    if args.probe_worker:
        probe(args.ranks_per_node, args.repeats)
        return 0
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        cmd = [sys.executable, __file__, "--probe-worker", f"--ranks-per-node={args.ranks_per_node}",
               f"--repeats={args.repeats}"]  # fmt: skip
    config = ClusterConfig(nodes=args.nodes, ranks_per_node=args.ranks_per_node, rate=args.rate)

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds through the `with`, which tears down

    signal.signal(signal.SIGTERM, on_term)
    with EmulatedCluster(config) as cluster:
        codes = cluster.run(cmd, timeout_s=args.timeout)
    bad = {r: c for r, c in enumerate(codes) if c != 0}
    if bad:
        print(f"ranks failed with exit codes {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
