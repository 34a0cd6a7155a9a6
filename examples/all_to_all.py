"""Uneven, differentiable all-to-all on any engine: the exchange at the heart of MoE dispatch.

    torchrun --nproc-per-node 4 examples/all_to_all.py
    mpirun --oversubscribe -np 4 python examples/all_to_all.py    (as root: --allow-run-as-root)
    horovodrun -np 4 -H localhost:4 python examples/all_to_all.py
    python examples/all_to_all.py                                 (a world of one)

(`python` being the one Sparta is installed in: .venv/bin/python after `make setup`.)
"""

import torch

import sparta

world = sparta.init()
torch.manual_seed(world.rank)
# Each rank sends a random number of rows (maybe none, never none in all) to every rank, like
# tokens to experts.
send = torch.randint(0, 4, (world.size,)).tolist()
send[world.rank] += 1
x = torch.randn(sum(send), 8, requires_grad=True)
y = sparta.comm.all_to_all(x, send, None, world.comm)  # receive splits are exchanged for us
y.square().sum().backward()  # the gradient travels back by the reverse all-to-all
assert torch.allclose(x.grad, 2 * x.detach())
total = world.comm.all_reduce(torch.tensor([y.shape[0]]))
if world.rank == 0:
    print(f"{world.size} ranks on {world.backend}: {int(total)} rows exchanged, gradients checked")
