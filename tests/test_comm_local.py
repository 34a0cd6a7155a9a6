"""sparta.comm in one process: launcher detection, configuration, errors, a world of one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import require_engine

import sparta
from sparta.comm import CommConfig, detect
from sparta.comm.checks import raise_if_inconsistent
from sparta.errors import BackendUnavailableError, ConfigError, InputError, SpartaError


def run_py(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "HOROVOD_"))}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


class TestDetect:
    def test_no_launcher_is_a_world_of_one(self) -> None:
        info = detect({})
        assert (info.launcher, info.rank, info.size, info.local_rank, info.local_size) == ("none", 0, 1, 0, 1)

    def test_torchrun(self) -> None:
        env = {
            "TORCHELASTIC_RUN_ID": "x",
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "node0",
            "MASTER_PORT": "1234",
        }
        info = detect(env)
        assert (info.launcher, info.rank, info.size, info.local_rank, info.local_size) == ("torchrun", 5, 8, 1, 4)
        assert (info.master_addr, info.master_port) == ("node0", 1234)

    def test_open_mpi_single_node_defaults_rendezvous_to_loopback(self) -> None:
        env = {
            "OMPI_COMM_WORLD_RANK": "2",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        }
        info = detect(env)
        assert (info.launcher, info.rank, info.size, info.local_rank) == ("mpirun", 2, 4, 2)
        assert info.master_addr == "127.0.0.1"

    def test_open_mpi_multi_node_has_no_guessed_address(self) -> None:
        env = {
            "OMPI_COMM_WORLD_RANK": "2",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        }
        assert detect(env).master_addr is None

    def test_mpich_hydra(self) -> None:
        env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
        info = detect(env)
        assert (info.launcher, info.rank, info.size, info.local_rank, info.local_size) == ("mpirun", 3, 4, 1, 2)

    def test_horovodrun_wins_over_mpi_variables(self) -> None:
        env = {
            "HOROVOD_RANK": "1",
            "HOROVOD_SIZE": "2",
            "HOROVOD_LOCAL_RANK": "1",
            "HOROVOD_LOCAL_SIZE": "2",
            "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_SIZE": "2",
        }
        assert detect(env).launcher == "horovodrun"

    def test_inconsistent_environment_is_named(self) -> None:
        with pytest.raises(ConfigError, match="rank 4 in a world of 4"):
            detect({"TORCHELASTIC_RUN_ID": "x", "RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "a"})
        with pytest.raises(ConfigError, match="RANK='two' is not an integer"):
            detect({"TORCHELASTIC_RUN_ID": "x", "RANK": "two", "WORLD_SIZE": "4", "MASTER_ADDR": "a"})


def test_comm_config_validates() -> None:
    with pytest.raises(ConfigError, match="timeout_s = 0 must be > 0"):
        CommConfig(timeout_s=0)


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_world_of_one_runs_every_op(device: str) -> None:
    """One body for both devices: on CUDA the rows go through nccl, the checks through gloo."""
    world = sparta.init(backend="torch")
    c = world.comm
    assert (world.rank, world.size, world.num_nodes, world.local_size) == (0, 1, 1, 1)
    x = torch.arange(6.0, device=device).view(3, 2)
    for y in (c.all_to_all(x, [3]), c.all_reduce(x, op="avg"), c.all_gather(x)[0], c.reduce_scatter(x), c.broadcast(x)):
        assert y.device == x.device and torch.equal(y, x)
    assert torch.equal(c.all_reduce(x.to(torch.bfloat16), async_op=True).wait(), x.to(torch.bfloat16))
    # a group of one reduces without the engine, still into a new tensor of x's dtype
    assert c.all_reduce(x).data_ptr() != x.data_ptr()
    flags = torch.tensor([True, False], device=device)
    assert torch.equal(c.all_reduce(flags), flags)
    assert c.split([0]) is not None
    with pytest.raises(InputError, match="send_splits sum to 2 but the tensor has 3 rows"):
        c.all_to_all(x, [2])
    with pytest.raises(InputError, match="takes a torch.Tensor, got list"):
        c.all_reduce([1.0])  # type: ignore[arg-type]
    padded = sparta.comm.all_reduce_forward(x, c, length=5)  # sent as 5 rows, 3 back
    assert torch.equal(padded, x)
    with pytest.raises(InputError, match="3 rows exceed length=2; pass a length no smaller"):
        sparta.comm.all_reduce_forward(x, c, length=2)
    with pytest.raises(ConfigError, match="unknown backend 'nccl'"):
        sparta.init(backend="nccl")
    with pytest.raises(ConfigError, match="ranks_per_node=3 must be >= 1 and divide the world size 1"):
        sparta.init(backend="torch", ranks_per_node=3)


def test_agree_raises_the_ranks_error_with_its_kind() -> None:
    c = sparta.init(backend="torch").comm
    c.agree(None, "my op")
    with pytest.raises(ConfigError, match=r"^my op: rank 0: experts=3 does not divide 4\. Every rank") as info:
        c.agree(ConfigError("experts=3 does not divide 4"), "my op")
    assert isinstance(info.value.__cause__, ConfigError)
    with pytest.raises(InputError, match="my op: rank 0: bad ids"):
        c.agree(InputError("bad ids"), "my op", failed=[0])
    with pytest.raises(SpartaError, match="my op: rank 0: failed without giving a reason"):
        c.agree(None, "my op", failed=[0])  # a flag carried by the caller, no reason given
    with pytest.raises(InputError, match="all_reduce.*rank 0: takes a torch.Tensor, got list"):
        c.all_reduce([1.0])  # type: ignore[arg-type]
    with pytest.raises(InputError, match="rank 0 passed float32 but rank 1 passed int64"):
        raise_if_inconsistent([[0, 1, 1, 2, 1], [0, 5, 1, 2, 1]], "op", same_dim0=True)  # two ranks' rows
    assert c.broken is None


def test_exchanges_implement_the_public_interface() -> None:
    """Communicator, HierarchicalAllToAll and TracedExchange are Exchanges, and the traced
    one is nothing more: what is not an exchange's is not passed through."""
    from sparta.comm import Exchange, HierarchicalAllToAll, PendingAllToAll
    from sparta.scheduling import TracedExchange, Tracer

    c = sparta.init(backend="torch").comm
    tracer = Tracer()
    traced = TracedExchange(c, tracer, "comm")
    for ex in (c, traced):
        assert Exchange in type(ex).__mro__ and (ex.size, ex.rank, ex.ranks) == (1, 0, (0,)) and "rank 0" in ex.where
    assert Exchange in HierarchicalAllToAll.__mro__  # subclassed explicitly, not only shaped alike
    assert not hasattr(traced, "all_reduce") and not hasattr(traced, "split")
    x = torch.arange(6.0).view(3, 2).requires_grad_()
    started = traced.start_all_to_all(x.detach(), [3])
    assert isinstance(started, PendingAllToAll) and (started.send_splits, started.recv_splits) == ([3], [3])
    assert torch.equal(started.handle.wait(), x.detach())
    y = sparta.comm.all_to_all(x, [3], None, traced)
    y.mul(torch.arange(6.0).view(3, 2)).sum().backward()
    assert torch.equal(x.grad, torch.arange(6.0).view(3, 2))  # the reverse exchange of the gradient
    assert [s.track for s in tracer.spans] == ["comm"] * 3 and [s.args["rows"] for s in tracer.spans] == [3] * 3


def test_timeline_draws_without_switching_the_pyplot_backend(tmp_path: Path) -> None:
    png = tmp_path / "timeline.png"
    code = (
        "import matplotlib; matplotlib.use('svg')\n"
        "from sparta.scheduling.trace import Span, draw_timeline\n"
        "spans = {0: [Span('fwd compute 1', 'compute', 0.0, 0.01)], 1: [Span('x 1', 'comm', 0.002, 0.02)]}\n"
        f"draw_timeline({str(png)!r}, spans, 'two ranks')\n"
        "print('BACKEND', matplotlib.get_backend())\n"
    )
    out = run_py(code)
    assert "BACKEND svg" in out.stdout, out.stdout + out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_world_shutdown_releases_every_group_and_they_refuse_after() -> None:
    """Shutting the world down ends gloo's worker threads of the world and of its splits
    (one left running into the interpreter's finalization can abort the process), and every
    communicator of that world then refuses, saying so."""
    code = (
        "import os, torch, sparta\n"
        "TASKS = '/proc/self/task'\n"
        "w = sparta.init(backend='torch')\n"
        "part = w.comm.split([0])\n"
        "w.comm.all_reduce(torch.ones(2)); part.all_to_all(torch.ones(1))\n"
        "def gloo(): return sum('gloo' in open(f'/proc/self/task/{t}/comm').read() for t in os.listdir(TASKS))\n"
        "before = gloo()\n"
        "w.shutdown()\n"
        "print('GLOO THREADS', before > 0, gloo())\n"
        "try:\n    part.all_reduce(torch.ones(1))\n"
        "except sparta.errors.CollectiveError as e:\n    print('REFUSED', e)\n"
    )
    out = run_py(code)
    assert "GLOO THREADS True 0" in out.stdout, out.stdout + out.stderr
    assert "REFUSED all_reduce(sum) on rank 0 of group 'world[0]'" in out.stdout, out.stdout
    assert "broken and refuses every collective: its world was shut down" in out.stdout, out.stdout


def test_a_process_group_without_a_cpu_backend_is_refused() -> None:
    """A communicator moves small CPU tensors (splits, input checks) whatever the data's
    device: over a group with no CPU backend (an nccl-only one on GPUs; here one that maps
    only cuda) it refuses at construction, naming the backend to use, which is the one
    `sparta.init` and `build_layout` start on CUDA."""
    code = (
        "import torch, torch.distributed as dist, sparta\n"
        "from sparta.comm import Communicator, CommConfig, process_group_backend\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "print('BACKENDS', process_group_backend('cpu'), process_group_backend('cuda'))\n"
        "try:\n    Communicator.from_process_group(dist.new_group([0], backend='cuda:gloo'), CommConfig())\n"
        "except sparta.errors.ConfigError as e:\n    print('REFUSED', e)\n"
        "world = Communicator.from_process_group(dist.group.WORLD, CommConfig())\n"
        "print('WORLD', world.all_reduce(torch.ones(2)))\n"
    )
    printed = run_py(code).stdout
    for line in (
        "BACKENDS gloo cpu:gloo,cuda:nccl",
        "REFUSED the process group over ranks [0] runs 'cuda:gloo' alone",
        "create it with backend 'cpu:gloo,cuda:nccl'",
        "WORLD tensor([1., 1.])",
    ):
        assert line in printed, printed


def test_missing_engine_names_the_install_command() -> None:
    for backend, module, hint in [
        ("mpi", "mpi4py", "pip install 'sparta\\[mpi\\]'"),
        ("horovod", "horovod", "scripts/install_horovod.sh"),
    ]:
        code = (
            f"import sys; sys.modules[{module!r}] = None\n"
            f"import sparta\n"
            f"try:\n    sparta.init(backend={backend!r})\n"
            f"except sparta.errors.BackendUnavailableError as e:\n    print('RAISED', e)\n"
        )
        out = run_py(code)
        assert "RAISED" in out.stdout, out.stderr
        assert hint.replace("\\", "") in out.stdout
    assert issubclass(BackendUnavailableError, sparta.SpartaError)


def test_world_size_mismatch_is_reported() -> None:
    """mpi4py sees a world of one while the (MPICH-style) launcher claims four ranks."""
    require_engine("mpi")
    code = (
        "import sparta\n"
        "try:\n    sparta.init(backend='mpi')\n"
        "except sparta.errors.ConfigError as e:\n    print('RAISED', e)\n"
    )
    out = run_py(code, {"PMI_RANK": "0", "PMI_SIZE": "4"})
    assert "RAISED mpirun launched 4 ranks but the mpi engine sees a world of 1" in out.stdout, out.stdout + out.stderr


def test_cli_help_lists_subcommands() -> None:
    out = subprocess.run([sys.executable, "-m", "sparta.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "info" in out.stdout
    info = subprocess.run([sys.executable, "-m", "sparta.cli", "info"], capture_output=True, text=True, timeout=60)
    engines = json.loads(info.stdout)["engines"]
    assert engines["torch"] == {"available": True, "cpu": "gloo", "cuda": "nccl" if torch.cuda.is_available() else None}


def test_world_exit_ends_the_process_with_its_code_after_flushing() -> None:
    script = "import sparta; w = sparta.init(); print('done', flush=False); w.exit(3)"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and proc.stdout == "done\n", (proc.returncode, proc.stdout, proc.stderr)
