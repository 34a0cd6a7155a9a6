"""Recognise the launcher that started this process: torchrun, mpirun or horovodrun."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from sparta.errors import ConfigError

LAUNCHERS = ("torchrun", "horovodrun", "mpirun", "none")


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process through its environment.

    local_rank / local_size are the launcher's view and serve only to pick a GPU before the
    engine starts; the World recomputes the node layout from host names once it can talk.
    """

    launcher: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    master_addr: str | None = None
    master_port: int | None = None

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"unknown launcher {self.launcher!r}; known: {LAUNCHERS}")
        if not 0 <= self.rank < self.size:
            raise ConfigError(
                f"the {self.launcher} environment gives rank {self.rank} in a world of {self.size}; "
                "the launcher's variables are inconsistent (was the environment copied between jobs?)"
            )


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int:
    for name in names:
        if name in env:
            try:
                return int(env[name])
            except ValueError:
                raise ConfigError(f"environment variable {name}={env[name]!r} is not an integer") from None
    if default is None:
        raise ConfigError(f"none of the launcher variables {names} is set")
    return default


def detect(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """The launch environment, checked in this order: horovodrun, torchrun, mpirun, none."""
    env = os.environ if env is None else env
    master_addr = env.get("MASTER_ADDR")
    master_port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
    if "HOROVOD_RANK" in env:
        return LaunchInfo(
            "horovodrun",
            _int(env, "HOROVOD_RANK"),
            _int(env, "HOROVOD_SIZE"),
            _int(env, "HOROVOD_LOCAL_RANK", default=0),
            _int(env, "HOROVOD_LOCAL_SIZE", default=1),
            master_addr,
            master_port,
        )
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env):
        return LaunchInfo(
            "torchrun",
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            _int(env, "LOCAL_RANK", default=0),
            _int(env, "LOCAL_WORLD_SIZE", default=1),
            master_addr,
            master_port or 29500,
        )
    # Open MPI, then MPICH / Intel MPI (Hydra's PMI variables).
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        size = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", default=size)
        # A job on one node needs no rendezvous address for the torch engine.
        addr = master_addr or ("127.0.0.1" if local_size == size else None)
        return LaunchInfo(
            "mpirun",
            _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK"),
            size,
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", default=0),
            local_size,
            addr,
            master_port or 29500,
        )
    return LaunchInfo("none", 0, 1, 0, 1, master_addr, master_port)
