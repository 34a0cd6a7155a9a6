"""sparta.comm: the only part of Sparta that talks to the network.

One `Communicator` interface over three engines (torch.distributed, Horovod, MPI), with
uneven all-to-all, all-reduce, all-gather, reduce-scatter, broadcast and barrier, async
forms, sub-communicators, input checks that raise on every rank, and timeouts. Row
exchanges go through the `Exchange` interface, which a Communicator, a two-level
`HierarchicalAllToAll` and a traced exchange all implement.

    world = sparta.init()                 # reads torchrun / mpirun / horovodrun
    y = world.comm.all_to_all(x, send_splits=[...])     # x: [n, *rest], split on dim 0
    y = sparta.comm.all_to_all(x, send, recv, world.comm)  # differentiable
    hier = sparta.comm.HierarchicalAllToAll.from_world(world)  # intra-node, then inter-node
    y = hier.all_to_all(x, send_splits)   # same result; sparta.comm.all_to_all(..., hier) too
    world.comm.agree(error_or_none, "my op")  # every rank raises if any rank has an error
"""

from sparta.comm.autograd import all_reduce_backward, all_reduce_forward, all_to_all
from sparta.comm.communicator import Communicator
from sparta.comm.config import CommConfig
from sparta.comm.engines.torch_dist import process_group_backend
from sparta.comm.exchange import Exchange, PendingAllToAll
from sparta.comm.handle import Handle
from sparta.comm.hierarchical import HierarchicalAllToAll
from sparta.comm.launch import LaunchInfo, detect
from sparta.comm.priority import PriorityQueue, QueueConfig, TaskKey
from sparta.comm.world import BACKENDS, World, init

__all__ = [
    "BACKENDS",
    "CommConfig",
    "Communicator",
    "Exchange",
    "Handle",
    "HierarchicalAllToAll",
    "LaunchInfo",
    "PendingAllToAll",
    "PriorityQueue",
    "QueueConfig",
    "TaskKey",
    "World",
    "all_reduce_backward",
    "all_reduce_forward",
    "all_to_all",
    "detect",
    "init",
    "process_group_backend",
]
