"""Sparta: train Mixture-of-Experts and embedding-heavy models with sparse communication.

    import sparta
    world = sparta.init()          # torchrun, mpirun or horovodrun; a world of one without
    world.comm.all_to_all(x, send_splits)

Subpackages: comm (engines and collectives), scheduling, moe, embedding, parallel (the 3D
trainer), planner (plans and the step simulator).
"""

from sparta.comm import CommConfig, World, init
from sparta.errors import SpartaError

__version__ = "0.1.0"
__all__ = ["CommConfig", "SpartaError", "World", "__version__", "init"]
