"""`sparta` command line: `sparta --help` lists the subcommands."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import shutil
import sys
from collections.abc import Sequence


def _info(_: argparse.Namespace) -> int:
    """Print versions and which engines this installation can start."""
    import torch

    import sparta

    engines = {
        "torch": {"available": True, "cpu": "gloo", "cuda": "nccl" if torch.cuda.is_available() else None},
        "horovod": {"available": importlib.util.find_spec("horovod") is not None},
        "mpi": {"available": importlib.util.find_spec("mpi4py") is not None, "mpirun": shutil.which("mpirun")},
    }
    print(
        json.dumps(
            {
                "sparta": sparta.__version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
                "cuda_devices": torch.cuda.device_count(),
                "engines": engines,
            },
            indent=2,
        )
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    import sparta

    parser = argparse.ArgumentParser(
        prog="sparta",
        description="Sparta: MoE and sparse-embedding training with scheduled sparse communication.",
    )
    parser.add_argument("--version", action="version", version=f"sparta {sparta.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="versions and the communication engines available here")
    info.set_defaults(run=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 0
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
