"""A launch past its timeout is stopped whole: torchrun starts each rank in a session of its
own, which killing the launcher's process group alone left running (sparta_tools.processes)."""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

from launch import free_port

from sparta_tools.processes import run_bounded


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited; its parent has not reaped it yet


def test_a_launch_past_its_timeout_is_stopped_with_its_ranks(tmp_path: Path) -> None:
    script = tmp_path / "stuck.py"
    # one os.write per rank, so the two ranks' lines cannot interleave on the shared pipe
    script.write_text("import os, time\nos.write(1, f\"RANK {os.environ['RANK']} {os.getpid()}\\n\".encode())\n"
                      "time.sleep(600)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(script)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    code, out, timed_out = run_bounded(cmd, env, 20)
    assert timed_out and code == 124, out[-2000:]
    ranks = [int(line.split()[2]) for line in out.splitlines() if line.startswith("RANK")]
    assert len(ranks) == 2, out[-2000:]
    time.sleep(0.5)
    assert not [pid for pid in ranks if _running(pid)], ranks
    # and a launch that ends in time gives its status and output
    code, out, timed_out = run_bounded([sys.executable, "-c", "print('done'); raise SystemExit(3)"], env, 60)
    assert (code, out.strip(), timed_out) == (3, "done", False)
    # echoed line by line as the launch writes them, not at its end
    class Stamped(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []

        def write(self, text: str) -> int:
            self.times.append(time.monotonic())
            return super().write(text)

    echo = Stamped()
    ticks = "import time\nfor i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(1)\n"
    code, out, timed_out = run_bounded([sys.executable, "-c", ticks], env, 60, echo=echo)  # type: ignore[arg-type]
    done = time.monotonic()
    assert code == 0 and not timed_out and echo.getvalue() == out and out.count("tick") == 3, out
    assert done - echo.times[0] > 1.5, (done, echo.times)  # the first line came about 3 s before the end
    # stray bytes and an echo that fails (a closed pipe) stop neither the reading nor the launch
    class Closed(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    stray = "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe odd\\n')\nprint('after', flush=True)\n"
    code, out, timed_out = run_bounded([sys.executable, "-c", stray], env, 60, echo=Closed())  # type: ignore[arg-type]
    assert code == 0 and not timed_out and "odd" in out and out.endswith("after\n"), out
