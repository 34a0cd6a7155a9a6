"""The README's first snippet and examples/all_to_all.py run as written: in one process and on
4 ranks under torchrun (the example checks its own gradients)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from launch import command, run_killing_on_timeout

ROOT = Path(__file__).resolve().parent.parent


def _snippet() -> str:
    """The README's "Communication in five lines" code block."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"## Communication in five lines\n\n```python\n(.*?)```", text, re.S)
    assert found, "README.md lost its 'Communication in five lines' block"
    return found.group(1)


@pytest.mark.parametrize("nprocs", [1, 4])
def test_the_readme_snippet_and_the_all_to_all_example_run(tmp_path: Path, nprocs: int) -> None:
    snippet = tmp_path / "snippet.py"
    # One os.write per rank: print's separate writes interleave across ranks on the shared pipe.
    mark = "import os; os.write(1, f'SNIPPET {world.rank} {tuple(y.shape)}\\n'.encode())\n"
    snippet.write_text(_snippet() + mark)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "OMPI_COMM_WORLD_SIZE", "HOROVOD_RANK"):
        env.pop(var, None)
    for script, want in ((snippet, "SNIPPET 0"), (ROOT / "examples" / "all_to_all.py", "gradients checked")):
        cmd = [sys.executable, str(script)] if nprocs == 1 else command("torchrun", nprocs, script, [])
        code, out = run_killing_on_timeout(cmd, env, 120, script.name)
        assert code == 0 and want in out, out[-3000:]
        if script == snippet:
            ranks = {int(r) for r in re.findall(r"SNIPPET (\d+) \(\d+, 512\)", out)}
            assert ranks == set(range(nprocs)), out[-3000:]
    assert f"{nprocs} ranks on torch" in out, out[-2000:]
