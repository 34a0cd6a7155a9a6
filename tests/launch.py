"""Launch a worker script on several real processes and collect what each rank reports.

Workers append JSON lines to one file per rank in a fresh directory (see dist/runner.py). A launch that outlives its
timeout is killed whole, and the failure shows the tail of its output, whose last lines
name the rank and the collective that hung.

Launchers: torchrun, mpirun, horovodrun, horovod-mpirun, and "env": the ranks started
directly with the torch.distributed variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) and no
agent watching them, as a job scheduler (srun) or the other hosts of a multi-node job see
them: there a rank's death reaches its peers only through the engine, where torchrun's
agent would stop every survivor at once. `python tests/launch.py NPROCS script args...`
is that spawner.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sparta_tools.processes import run_bounded

DIST = Path(__file__).parent / "dist"
LAUNCHERS = ("torchrun", "mpirun", "horovodrun", "horovod-mpirun", "env")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def have_horovod() -> bool:
    try:
        import horovod.torch  # noqa: F401
    except Exception:
        return False
    return True


def require_launcher(launcher: str) -> None:
    """Skip where the engine is truly absent, but never in CI, which must run everything."""
    missing = None
    if launcher in ("mpirun", "horovod-mpirun") and shutil.which("mpirun") is None:
        missing = "mpirun not on PATH (apt-get install openmpi-bin libopenmpi-dev)"
    elif launcher in ("horovodrun", "horovod-mpirun") and not have_horovod():
        missing = "horovod is not installed (bash scripts/install_horovod.sh)"
    elif launcher == "mpirun":
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            missing = "mpi4py is not installed"
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the {launcher} tests but {missing}")
        pytest.skip(missing)


def require_engine(engine: str) -> None:
    """`require_launcher` for an engine a test starts itself ("mpi", "horovod")."""
    from sparta_tools.bench.runner import engine_missing

    missing = engine_missing(engine)
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the {engine} tests but {missing}")
        pytest.skip(missing)


def command(
    launcher: str, nprocs: int, script: Path, args: list[str], launcher_args: list[str] | None = None
) -> list[str]:
    """The command line; `launcher_args` go to mpirun before the program (e.g. MCA settings)."""
    py = sys.executable
    bindir = Path(py).parent
    if launcher == "env":
        return [py, __file__, str(nprocs), str(script), *args]
    if launcher == "torchrun":
        return [
            py,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nprocs}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            str(script),
            *args,
        ]
    if launcher in ("mpirun", "horovod-mpirun"):
        extra = ["--backend", "horovod"] if launcher == "horovod-mpirun" else []
        return [
            "mpirun",
            "--oversubscribe",
            "--allow-run-as-root",
            "--bind-to",
            "none",
            "-np",
            str(nprocs),
            "-x",
            "OMP_NUM_THREADS=1",
            "-x",
            "PYTHONUNBUFFERED=1",
            "-x",
            "PATH",
            *(launcher_args or []),
            py,
            str(script),
            *args,
            *extra,
        ]
    if launcher == "horovodrun":
        return [
            str(bindir / "horovodrun"),
            "--gloo",
            "-np",
            str(nprocs),
            "-H",
            f"localhost:{nprocs}",
            py,
            str(script),
            *args,
        ]
    raise ValueError(f"unknown launcher {launcher!r}; known: {LAUNCHERS}")


def run_killing_on_timeout(cmd: list[str], env: dict[str, str], timeout: float, what: str) -> tuple[int, str]:
    """Run a launch in its own process group; (exit code, output). One that outlives
    `timeout` is killed whole and fails the test with the tail of its output."""
    code, out, timed_out = run_bounded(cmd, env, timeout)  # stopped with every rank it started
    if timed_out:
        pytest.fail(f"{what} hung for {timeout:g} s and was stopped; last output:\n{out[-4000:]}")
    return code, out


def launch_raw(
    launcher: str,
    script: str,
    nprocs: int,
    args: list[str] | None = None,
    timeout: float = 300,
    launcher_args: list[str] | None = None,
) -> tuple[int, str, dict[tuple[int, str], dict]]:
    """Run `dist/<script>` on `nprocs` ranks; (exit code, output, {(rank, check): result}),
    whatever the outcome (a launch that outlives `timeout` fails the test)."""
    require_launcher(launcher)
    results_dir = tempfile.mkdtemp(prefix="sparta-test-")
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MKL_NUM_THREADS="1", SPARTA_TEST_RESULTS=results_dir
    )
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = command(launcher, nprocs, DIST / script, list(args or []), launcher_args)
    returncode, out = run_killing_on_timeout(cmd, env, timeout, f"{launcher} {script}")
    results: dict[tuple[int, str], dict] = {}
    for path in sorted(Path(results_dir).glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            results[(rec["rank"], rec["check"])] = rec
    shutil.rmtree(results_dir, ignore_errors=True)
    return returncode, out, results


def launch(
    launcher: str,
    script: str,
    nprocs: int = 4,
    args: list[str] | None = None,
    timeout: float = 300,
    expect_ok: bool = True,
) -> dict[tuple[int, str], dict]:
    """Run `dist/<script>` on `nprocs` ranks; returns {(rank, check): result}."""
    returncode, out, results = launch_raw(launcher, script, nprocs, args, timeout)
    if expect_ok and returncode != 0:
        # the failed checks' own tracebacks first: the launcher's report fills the output's tail
        failed = [f"rank {r} {check}:\n{rec.get('error', '')}" for (r, check), rec in results.items() if not rec["ok"]]
        why = "\n".join(failed)[-6000:]
        pytest.fail(f"{launcher} {script} exited with {returncode}\n{why}\noutput tail:\n{out[-3000:]}")
    if not results:
        pytest.fail(f"{launcher} {script} reported nothing; output tail:\n{out[-4000:]}")
    return results


def assert_all_ok(results: dict[tuple[int, str], dict], nprocs: int, expected_checks: int) -> None:
    failed = [f"rank {r} {c}: {rec['error']}" for (r, c), rec in sorted(results.items()) if not rec["ok"]]
    assert not failed, "\n".join(failed)
    names = {c for _, c in results}
    assert len(names) >= expected_checks, f"only {len(names)} checks ran: {sorted(names)}"
    for name in names:
        ranks = {r for r, c in results if c == name}
        assert ranks == set(range(nprocs)), f"check {name} reported by ranks {sorted(ranks)} only"


def spawn(nprocs: int, argv: list[str]) -> int:
    """The "env" launcher: start `nprocs` ranks of `python argv...` with the torch.distributed
    variables, wait for every one, and exit 1 if any failed (each rank's code is printed)."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, *argv],
            env=dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE=str(nprocs),
                LOCAL_RANK=str(r),
                LOCAL_WORLD_SIZE=str(nprocs),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            ),
        )
        for r in range(nprocs)
    ]
    codes = [p.wait() for p in procs]
    print(f"spawn: exit codes by rank {codes}", flush=True)
    return int(any(codes))


if __name__ == "__main__":
    sys.exit(spawn(int(sys.argv[1]), sys.argv[2:]))
