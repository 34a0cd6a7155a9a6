"""The header record of `sparta bench`: what tells two runs apart or reruns one.

Versions (Sparta and its git commit, torch, NCCL, MPI, Horovod), hosts and ranks per node,
CPU and GPU models, each rank's CPU affinity, the environment variables that change how the
engines behave, and the command: the launcher's line where a launcher started the ranks.
`records.BANDWIDTH` and `records.TIMING` say what the point records' figures mean.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from sparta_tools.bench.records import BANDWIDTH, SCHEMA, TIMING

ENV_PREFIXES = ("OMP_", "MKL_", "NCCL_", "GLOO_", "OMPI_MCA_", "UCX_", "HOROVOD_", "CUDA_VISIBLE", "MASTER_", "TORCH_")
ENV_SKIP = ("HOROVOD_RANK", "HOROVOD_LOCAL_RANK", "HOROVOD_CROSS_RANK", "HOROVOD_HOSTNAME")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> dict[str, Any]:
    """The commit of the Sparta checkout in use, and whether tracked files differ from it
    (None where Sparta was installed from a wheel, not run from a checkout)."""
    import sparta

    root = Path(sparta.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's processor where that is absent."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mpi_library(engine: str) -> str | None:
    """The MPI library's own version line: from the running library on the mpi engine
    (importing mpi4py elsewhere would start MPI inside a torchrun rank), else `mpirun --version`."""
    if engine == "mpi":
        from mpi4py import MPI

        return MPI.Get_library_version().strip().splitlines()[0]
    try:
        out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def nccl_version() -> str | None:
    """NCCL's version as torch reports it, or None without CUDA or NCCL."""
    if not torch.cuda.is_available():
        return None
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # a torch built without NCCL
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def relevant_env() -> dict[str, str]:
    """The environment variables that change a run's figures (threads, NCCL, MPI, Horovod, ...), for the header."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) and k not in ENV_SKIP}


def local_facts(device: str) -> dict[str, Any]:
    """This rank's host, CPU affinity and GPU (gathered from every rank into the header)."""
    gpu = None
    if device == "cuda":
        gpu = torch.cuda.get_device_name(torch.cuda.current_device())
    return {"host": socket.gethostname(), "affinity": sorted(os.sched_getaffinity(0)), "gpu": gpu}


LAUNCHERS = ("torchrun", "torch.distributed.run", "mpirun", "mpiexec", "orterun", "prterun", "horovodrun")


def user_launch_command(max_depth: int = 8) -> list[str] | None:
    """The command line of the launcher that started this process (a rank under the user's
    own torchrun, mpirun or horovodrun): the nearest ancestor whose first words name one,
    read from /proc. None where there is none or no /proc (then the header's ``command``,
    this rank's own argv, is all there is)."""
    pid = os.getppid()
    for _ in range(max_depth):
        if pid <= 1:
            return None
        try:
            argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
            # the parent pid is the 2nd field after the parenthesised name, which may hold spaces
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        if any(word in LAUNCHERS or Path(word).name in LAUNCHERS for word in argv[:4]):
            return argv
    return None


def record(
    suite: str,
    engine: str,
    launcher: str,
    node_ranks: Sequence[Sequence[int]],
    facts: Sequence[dict[str, Any]],
    options: dict[str, Any],
    command: Sequence[str],
    launch_command: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The first record: everything needed to tell two runs apart or to rerun one."""
    import sparta

    hosts = [facts[ranks[0]]["host"] for ranks in node_ranks]
    gpus = [f["gpu"] for f in facts if f["gpu"]]
    return {
        "type": "header",
        "schema": SCHEMA,
        "suite": suite,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "sparta": sparta.__version__,
        "git": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl_version(),
        "mpi4py": _version("mpi4py"),
        "mpi_library": mpi_library(engine),
        "horovod": _version("horovod"),
        "engine": engine,
        "launcher": launcher,
        "ranks": sum(len(r) for r in node_ranks),
        "nodes": len(node_ranks),
        "ranks_per_node": [len(r) for r in node_ranks],
        "hosts": hosts,
        "cpu_model": cpu_model(),
        "cpus_per_host": os.cpu_count(),
        "gpu_model": sorted(set(gpus)) if gpus else None,
        "device": options.get("device", "cpu"),
        "binding": {"mode": options.get("bind", "none"), "affinity_per_rank": [f["affinity"] for f in facts]},
        "env": relevant_env(),
        "command": list(command),
        "launch_command": list(launch_command) if launch_command else None,
        "options": options,
        "bandwidth": BANDWIDTH,
        "timing": TIMING,
    }
