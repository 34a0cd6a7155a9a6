"""`sparta profile` on 2 real ranks: the Chrome trace parses with the expected tracks, the PNG exists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sparta.errors import ConfigError
from sparta_tools.profile import ProfileRun, parse_degree


def test_run_config_validated() -> None:
    with pytest.raises(ConfigError, match="--experts 3 cannot be spread over --nprocs 2"):
        ProfileRun(out="x", experts=3)
    with pytest.raises(ConfigError, match="--pipeline-degree '0'"):
        parse_degree("0")
    assert parse_degree("2,4") == (2, 4) and parse_degree("auto") == "auto" and parse_degree("8,8,2") == (8, 8, 2)
    with pytest.raises(ConfigError, match="taper in \\[0, 3\\]"):
        parse_degree("8,8,4")
    # from the command line: exit 2 and the message, as argparse's own refusals
    cli = [sys.executable, "-m", "sparta.cli", "profile", "--experts", "3", "--nprocs", "2"]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--experts 3 cannot be spread over --nprocs 2" in done.stderr, done.stderr


@pytest.mark.parametrize("degree", ["3,2", "1", "auto"])
def test_profile_two_ranks_writes_trace_and_timeline(tmp_path: Path, degree: str) -> None:
    cmd = [sys.executable, "-m", "sparta.cli", "profile", "--out", str(tmp_path), "--nprocs", "2",
           "--ranks-per-node", "1", "--tokens", "128", "--d-model", "32", "--d-ff", "64", "--experts", "4",
           "--pipeline-degree", degree, "--steps", "1", "--timeout", "60"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    fits = {rec["fit"]: rec for rec in lines if "fit" in rec}
    assert {"all_to_all/world", "all_to_all/inter", "all_reduce/world", "expert_bwd/32x64"} <= set(fits)
    assert all(rec["alpha_s"] >= 0 and rec["beta_s_per_unit"] >= 0 for rec in fits.values())
    summary = next(rec for rec in lines if "layer_ran" in rec)
    ran = summary["layer_ran"]
    assert ran["planned_in_layer"] == (degree == "auto")
    if degree != "auto":  # auto: sparta.moe.tune_schedule's pick, whatever this machine's timings make it
        assert (ran["r_fwd"], ran["r_bwd"]) == ((3, 2) if degree == "3,2" else (1, 1))
    assert summary["model_plan"]["r_fwd"] >= 1 and summary["step_s"] > 0

    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = [(e["pid"], threads[e["pid"], e["tid"]], e["name"]) for e in events if e["ph"] == "X"]
    for rank in (0, 1):
        mine = {(track, name) for r, track, name in spans if r == rank}
        assert ("step", "backward") in mine
        if degree == "auto":
            continue
        if degree == "1":  # unpipelined: one all-to-all each way, no chunks
            assert any(name == "all_to_all" for _, name in mine), sorted(mine)
            assert not any(name.startswith(("fwd out", "bwd out")) for _, name in mine), sorted(mine)
            continue
        want_compute = {("compute", f"{p} compute {i}") for p, r in (("fwd", 3), ("bwd", 2)) for i in range(r)}
        assert want_compute <= mine, sorted(mine)
        assert {("inter-node comm", "fwd out 2"), ("inter-node comm", "bwd back 1")} <= mine
        assert ("intra-node comm", "fwd out 0") in mine
    png = tmp_path / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "profile.json").read_text()).keys() == fits.keys()
