"""The layout of a 3D-parallel run: degrees, the DeviceMesh, and each dimension's Communicator.

Ranks are laid out as torchtitan does, tensor parallel innermost (its all-reduces are the
most frequent, so its ranks are neighbours: one node), then data parallel, then pipeline:

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

Expert parallelism lives inside data parallelism: the ``dp`` ranks of one (pp, tp)
coordinate split into ``dp / ep`` groups of ``ep`` consecutive ones, each holding every
expert once; ranks at the same position of those groups are one expert's replicas. So every
expert-parallel group (and every SparseEmbedding group, which is the dp group) lies inside
one pipeline stage and one tensor-parallel slice: its ranks run the same pipeline actions
in the same order, so their all-to-alls line up (a group spanning stages would deadlock).
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from sparta.comm import Communicator, World, process_group_backend
from sparta.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism; their product ``pp * dp * tp`` is the world size.

    pp: pipeline stages' ranks; dp: data-parallel replicas; tp: tensor-parallel ranks;
    ep: ranks each MoE layer's experts are split over, a divisor of dp (experts shard
    inside the data-parallel group, whose ranks see different tokens).
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ParallelDims.{name}={value!r} must be a positive integer")
        if self.dp % self.ep:
            raise ConfigError(
                f"ParallelDims: ep={self.ep} must divide dp={self.dp}: experts are split over ranks of one "
                f"data-parallel group; pick ep among {[d for d in range(1, self.dp + 1) if self.dp % d == 0]}"
            )

    @property
    def world_size(self) -> int:
        """The ranks the degrees need: pp x dp x tp."""
        return self.pp * self.dp * self.tp

    def check(self, world_size: int) -> None:
        """ConfigError unless the degrees multiply to ``world_size`` (the ranks launched)."""
        if self.world_size != world_size:
            raise ConfigError(
                f"ParallelDims(pp={self.pp}, dp={self.dp}, tp={self.tp}) multiply to {self.world_size} ranks but "
                f"{world_size} were launched: launch {self.world_size} ranks or change the degrees"
            )

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        """World rank at mesh coordinate (pp, dp, tp)."""
        return (pp * self.dp + dp) * self.tp + tp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of world rank ``rank``."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def pp_groups(self) -> list[list[int]]:
        """World ranks of every pipeline (one per (dp, tp) coordinate)."""
        return [[self.rank_of(p, d, t) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def dp_groups(self) -> list[list[int]]:
        """World ranks of every data-parallel group (one per (pp, tp) coordinate)."""
        return [[self.rank_of(p, d, t) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def tp_groups(self) -> list[list[int]]:
        """World ranks of every tensor-parallel group (one per (pp, dp) coordinate)."""
        return [[self.rank_of(p, d, t) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def ep_groups(self) -> list[list[int]]:
        """World ranks of every expert-parallel group: ``ep`` consecutive ranks of a dp group."""
        return [g[i : i + self.ep] for g in self.dp_groups() for i in range(0, self.dp, self.ep)]

    def expert_replica_groups(self) -> list[list[int]]:
        """World ranks holding the same experts: one per position in an expert-parallel group."""
        return [g[i :: self.ep] for g in self.dp_groups() for i in range(self.ep)]


@dataclass
class Layout:
    """This rank's place in the mesh and the groups its layers use (built by `build_layout`).

    dp: the Communicator of this rank's data-parallel group (on the world's engine), which
        sparse embeddings shard over; ep: the experts' group (None when ep == 1);
        expert_dp: the replicas of this rank's experts (None when ep == dp); tp: the
        Communicator of this rank's tensor-parallel group (None when tp == 1), over which
        the experts' hidden units are split (MoESpec.expert_tp).
    mesh: DeviceMesh with dims ("pp", "dp", "tp") over torch.distributed (pipelining, DTensor
        and FSDP2 run on it whatever the engine).
    """

    dims: ParallelDims
    world: World
    mesh: DeviceMesh
    device: torch.device
    dp: Communicator
    ep: Communicator | None
    expert_dp: Communicator | None
    tp: Communicator | None = None
    pp_rank: int = field(init=False)
    dp_rank: int = field(init=False)
    tp_rank: int = field(init=False)

    def __post_init__(self) -> None:
        self.pp_rank, self.dp_rank, self.tp_rank = self.dims.coordinates(self.world.rank)

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The process group of this rank's pipeline (its stages' ranks)."""
        return self.mesh.get_group("pp")

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The data-parallel sub-mesh, for FSDP2 and DDP."""
        return self.mesh["dp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The tensor-parallel sub-mesh, for `parallelize_module`."""
        return self.mesh["tp"]


def build_layout(dims: ParallelDims, world: World, device: str | torch.device = "cpu") -> Layout:
    """Build the mesh and the groups of ``dims`` over ``world``. Collective: every rank calls it.

    device: "cpu" (gloo) or "cuda" (nccl; this rank takes ``cuda:<local rank>``).
    Under mpirun or horovodrun, torch.distributed is started beside the engine (gloo or nccl,
    rendezvous address sent over the engine), since DeviceMesh and torch's pipelining need it.
    """
    dims.check(world.size)  # same answer on every rank: nobody has issued a collective yet
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    _start_torch_distributed(world, device)
    mesh = _mesh(dims, device, world.comm.config.timeout_s)
    if world.backend == "torch":  # the mesh's own groups: no second one over the same ranks
        dp: Communicator | None = Communicator.from_process_group(mesh.get_group("dp"), world.comm.config)
        tp = Communicator.from_process_group(mesh.get_group("tp"), world.comm.config) if dims.tp > 1 else None
    else:
        dp = world.comm.split_groups(dims.dp_groups())
        tp = world.comm.split_groups(dims.tp_groups()) if dims.tp > 1 else None
    ep = world.comm.split_groups(dims.ep_groups()) if dims.ep > 1 else None
    replicas = world.comm.split_groups(dims.expert_replica_groups()) if dims.ep > 1 and dims.ep < dims.dp else None
    assert dp is not None  # every rank is in one group of each
    return Layout(dims=dims, world=world, mesh=mesh, device=device, dp=dp, ep=ep, expert_dp=replicas, tp=tp)


def _mesh(dims: ParallelDims, device: torch.device, timeout_s: float) -> DeviceMesh:
    """The ("pp", "dp", "tp") mesh over groups whose timeout is the world's `timeout_s`.
    `init_device_mesh` gives its groups torch's default instead (30 minutes on gloo), so a
    pipeline peer of a stage that failed inside torch's schedule waited that long in its
    receive; every group is made by every rank, in the same order."""
    timeout = datetime.timedelta(seconds=timeout_s)
    # a dimension over the whole world gets a group of its own too, not the default group:
    # one more gloo mesh (or NCCL communicator), made once, for one rule for every dimension
    every = {"pp": dims.pp_groups(), "dp": dims.dp_groups(), "tp": dims.tp_groups()}
    groups = [
        dist.new_subgroups_by_enumeration(g, timeout=timeout, group_desc=f"mesh_{name}")[0] for name, g in every.items()
    ]
    ranks = torch.arange(dims.world_size).reshape(dims.pp, dims.dp, dims.tp)
    return DeviceMesh.from_group(groups, device.type, mesh=ranks, mesh_dim_names=("pp", "dp", "tp"))


def _start_torch_distributed(world: World, device: torch.device) -> None:
    """torch.distributed's default group over the world, if the engine did not start it."""
    if dist.is_initialized():
        if dist.get_world_size() != world.size or dist.get_rank() != world.rank:
            raise ConfigError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"but the Sparta world is rank {world.rank} of {world.size}: start it once, through sparta.init()"
            )
        return
    address = torch.zeros(2, dtype=torch.int64)
    if world.rank == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        host = socket.gethostbyname(socket.gethostname()) if world.num_nodes > 1 else "127.0.0.1"
        address = torch.tensor([int.from_bytes(socket.inet_aton(host), "big"), port])
    address = world.comm.broadcast(address, src=0)
    assert isinstance(address, torch.Tensor)
    host = socket.inet_ntoa(int(address[0]).to_bytes(4, "big"))
    dist.init_process_group(
        process_group_backend(device),
        init_method=f"tcp://{host}:{int(address[1])}",
        rank=world.rank,
        world_size=world.size,
        timeout=datetime.timedelta(seconds=world.comm.config.timeout_s),
    )
