"""`sparta bench`'s pieces that need no launch: compare on hand-written run files, bad flags
refused before any rank starts, the sum oracle, traffic patterns, bandwidth definitions,
peers' outputs parsed, and ranks' times combined per call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparta.errors import ConfigError
from sparta_tools.bench import main, records, traffic
from sparta_tools.bench.oracle import Oracle
from sparta_tools.bench.peers import parse_nccl_tests, parse_osu


def _run_file(path: Path, times: dict[str, tuple[float, float, float]], ranks: int = 2) -> Path:
    head = {"type": "header", "suite": "collectives", "ranks": ranks, "nodes": 1, "ranks_per_node": [ranks],
            "device": "cpu", "options": {"dtype": "float32"}}  # fmt: skip
    lines = [head]
    for variant, (lo, med, hi) in times.items():
        lines.append({"type": "point", "suite": "collectives", "engine": "torch", "op": "all_reduce",
                      "variant": variant, "bytes": 4096, "dtype": "float32", "ranks": ranks, "median_us": med,
                      "min_us": lo, "max_us": hi, "p99_us": hi, "wrong": 0})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_compare_flags_ranges_apart_and_refuses_other_shapes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = _run_file(tmp_path / "a.jsonl", {"raw": (90, 100, 110), "sparta": (190, 200, 210)})
    same = _run_file(tmp_path / "b.jsonl", {"raw": (100, 105, 120), "sparta": (190, 200, 210)})
    worse = _run_file(tmp_path / "c.jsonl", {"raw": (130, 140, 150), "sparta": (100, 110, 120)})
    assert main(["compare", str(base), str(same)]) == 0
    assert "0 slower, 0 faster" in capsys.readouterr().out
    assert main(["compare", str(base), str(worse)]) == 1
    out = capsys.readouterr().out
    assert "torch all_reduce raw 4K" in out and "SLOWER" in out and "FASTER" in out, out
    other = _run_file(tmp_path / "d.jsonl", {"raw": (90, 100, 110)}, ranks=4)
    assert main(["compare", str(base), str(other)]) == 2
    err = capsys.readouterr().err
    assert "ranks: 2 vs 4" in err and "--force" in err and "only in the first" in err, err
    assert main(["compare", str(base), str(other), "--force"]) == 0  # no common point: nothing flagged
    assert "# differs: ranks: 2 vs 4" in capsys.readouterr().out


def test_compare_pairs_points_by_their_suites_identity(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Trainer points differ by model and layout, not op or bytes: each layout is its own
    point; two points of one identity are refused; a peer's point with no range over calls
    gets no verdict, however far its median moved."""
    head = {"type": "header", "suite": "trainer", "ranks": 4, "nodes": 1, "ranks_per_node": [4], "device": "cpu",
            "options": {"dtype": "float32"}}  # fmt: skip
    identity = ["suite", "engine", "model", "layout", "variant", "ranks"]

    def run(name: str, dp4: float, layouts: tuple[str, ...] = ("dp4", "fsdp4")) -> Path:
        lines = [head]
        for layout in layouts:
            med = dp4 if layout == "dp4" else 100.0
            lines.append({"type": "point", "suite": "trainer", "engine": "torch", "model": "moe", "layout": layout,
                          "variant": "sparta", "ranks": 4, "identity": identity, "median_us": med,
                          "min_us": med - 5, "max_us": med + 5})  # fmt: skip
        lines.append(
            {
                "type": "point",
                "suite": "trainer",
                "engine": "nccl-tests",
                "op": "all_reduce",
                "bytes": 1024,
                "ranks": 4,
                "median_us": dp4,
            }
        )  # a peer's line: a median, no range
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
        return path

    base, slow = run("a.jsonl", 100.0), run("b.jsonl", 500.0)
    assert main(["compare", str(base), str(slow)]) == 1
    out = capsys.readouterr().out
    assert "moe dp4 sparta" in out and "moe fsdp4 sparta" in out and "3 points compared: 1 slower" in out, out
    assert "no range" in out, out
    twice = run("c.jsonl", 100.0, layouts=("dp4", "dp4"))
    assert main(["compare", str(base), str(twice)]) == 2
    assert "two points of one identity: torch moe dp4 sparta" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["collectives", "-d", "float8"], "--datatype 'float8'"),
        (["collectives", "-b", "64M", "-e", "4K"], "need 1 <= minbytes <= maxbytes"),
        (["collectives", "-b", "4Q"], "size '4Q'"),
        (["collectives", "--ops", "all_reduce,allreduce"], "--ops 'all_reduce,allreduce'"),
        (["collectives", "-a", "mean"], "-a 'mean'"),
        (["collectives", "--engines", "nccl"], "--engines nccl: unknown"),
        (["alltoallv", "--patterns", "file"], "--patterns file needs --matrix"),
        (["collectives", "--bind", "socket"], "invalid choice: 'socket'"),
        (["alltoallv", "--matrix", "/nonexistent.json"], "--matrix /nonexistent.json: cannot read it"),
        (["alltoallv", "--patterns", "moe", "--moe-experts", "3"], "--moe-experts 3 cannot be spread over 2 ranks"),
        (["dispatch", "--d-model", "0"], "--d-model 0: give a row width >= 1"),
    ],
)
def test_bad_flags_exit_2_with_a_message(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_matrix_of_part_elements_exits_2_before_any_rank(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The matrix is read as the ranks read it, in the run's elements (float32: 4 bytes)."""
    matrix = tmp_path / "matrix.json"
    matrix.write_text(json.dumps([[2, 6], [0, 4]]))
    with pytest.raises(SystemExit) as exit_:
        main(["alltoallv", "--matrix", str(matrix), "-d", "float32"])
    assert exit_.value.code == 2
    assert "not whole 4-byte elements" in capsys.readouterr().err


def test_oracle_sums_exactly_in_every_dtype() -> None:
    import torch

    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8):
        for ranks in (2, 7, 64):
            oracle = Oracle(3, ranks, dtype, torch.device("cpu"))
            exact = sum(oracle.values(r, 0, 1000) for r in range(ranks))
            summed = sum(oracle.buffer(r, 1000).double() for r in range(ranks))  # what any order of adds gives
            assert torch.equal(oracle.summed(0, 1000).double(), exact.double()), (dtype, ranks)
            assert torch.equal(summed, exact.double()), (dtype, ranks)
            assert len(set(oracle.values(0, 0, 1000).tolist())) > 1, (dtype, ranks)  # not a constant
            assert not torch.equal(oracle.values(0, 0, 64), oracle.values(1, 0, 64)), (dtype, ranks)
    for seed in range(200):  # no seed gives neighbouring ranks one buffer (b a multiple of m did)
        oracle = Oracle(seed, 2, torch.float32, torch.device("cpu"))
        assert not torch.equal(oracle.values(0, 0, 8), oracle.values(1, 0, 8)), seed
    # past the dtype's exact integers a sum cannot be checked: refused by name, gathers still fine
    wide = Oracle(3, 512, torch.bfloat16, torch.device("cpu"))
    assert len(set(wide.values(0, 0, 100).tolist())) > 1
    with pytest.raises(ConfigError, match="-d bfloat16 on 512 ranks: a sum over them is not exact"):
        wide.summed(0, 10)


def test_a_nan_output_counts_as_wrong() -> None:
    import torch

    from sparta_tools.bench.moe_candidates import wrong_values

    want = torch.tensor([0.5, 1.0, 2.0])
    assert wrong_values(torch.tensor([float("nan"), 1.0, 2.0]), want, 1e-4, 1e-3) == 1
    assert wrong_values(torch.tensor([0.5, float("inf"), 2.0 + 1e-6]), want, 1e-4, 1e-3) == 1
    assert wrong_values(want.clone(), want, 0.0, 0.0) == 0


def test_traffic_patterns() -> None:
    assert traffic.uniform(4, 400) == [[100] * 4] * 4
    z = traffic.zipf(4, 1000, 1.1, seed=0)
    assert all(row == z[0] for row in z) and max(z[0]) > 2 * min(z[0]) and abs(sum(z[0]) - 1000) <= 4
    rows = traffic.moe_rows(4, 8, 2, 256, 32, seed=0)
    assert [sum(r) for r in rows] == [512] * 4  # every token's top-2 pairs, somewhere
    assert rows == traffic.moe_rows(4, 8, 2, 256, 32, seed=0) != traffic.moe_rows(4, 8, 2, 256, 32, seed=1)


def test_bandwidth_definitions() -> None:
    n, size = 4, 1 << 20
    node_of = [0, 0, 1, 1]
    ar = records.bandwidth("all_reduce", size, records.collective_matrix("all_reduce", size, n), node_of, 1e-3)
    assert ar["algbw_GBps"] == pytest.approx(size / 1e-3 / 1e9, rel=1e-5)  # 6 significant digits
    assert ar["busbw_GBps"] == pytest.approx(ar["algbw_GBps"] * 2 * 3 / 4, rel=1e-5)
    assert ar["busbw_noself_GBps"] == pytest.approx(ar["busbw_GBps"], rel=1e-5)
    assert ar["internode_busbw_GBps"] == pytest.approx(ar["busbw_GBps"] * 2 / 3, rel=1e-5)  # 2 of 3 peers off-node
    m = [[100, 0, 0, 0], [0, 100, 0, 0], [0, 0, 100, 0], [300, 0, 0, 100]]
    v = records.bandwidth("alltoallv", 250, m, node_of, 1.0)
    assert v["algbw_GBps"] == pytest.approx(400 / 1e9)  # rank 0 receives 400 (100 its own), rank 3 sends 400
    assert v["busbw_noself_GBps"] == pytest.approx(300 / 1e9)  # DeepEP: own traffic excluded
    assert v["internode_busbw_GBps"] == pytest.approx(300 / 1e9)
    assert v["imbalance"] == pytest.approx(400 / 250)


def test_peer_outputs_parse() -> None:
    nccl = """#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
        1024           256     float     sum      -1    12.34    0.08    0.15      0    12.01    0.09    0.16      0
     1048576        262144     float     sum      -1    45.60   23.00   43.12      0    44.90   23.35   43.78      0
"""  # noqa: E501
    rows = parse_nccl_tests(nccl, "all_reduce")
    assert [(r["bytes"], r["median_us"], r["busbw_GBps"], r["wrong"]) for r in rows] == [
        (1024, 12.34, 0.15, 0),
        (1048576, 45.6, 43.12, 0),
    ]
    osu = """# OSU MPI Allreduce Latency Test v7.3
# Size       Avg Latency(us)   Min Latency(us)   Max Latency(us)  Iterations  Validation
4                       1.52              1.40              1.63        1000        Pass
8                       1.55              1.41              1.70        1000        Fail
"""
    rows = parse_osu(osu, "all_reduce")
    got = [(r["bytes"], r["median_us"], r["min_us"], r["wrong"]) for r in rows]
    assert got == [(4, 1.52, 1.4, 0), (8, 1.55, 1.41, 1)]


def test_ranks_times_combine_per_call() -> None:
    per_rank = [[1.0, 5.0, 2.0], [3.0, 1.0, 2.0]]  # seconds, [rank][call]
    assert records.combine(per_rank, "max") == [3.0, 5.0, 2.0]
    assert records.combine(per_rank, "min") == [1.0, 1.0, 2.0]
    assert records.combine(per_rank, "avg") == [2.0, 3.0, 2.0]
    assert records.combine(per_rank, "rank0") == [1.0, 5.0, 2.0]
    stats = records.time_stats(per_rank, "max")
    assert (stats["median_us"], stats["min_us"], stats["max_us"], stats["p99_us"]) == (3e6, 2e6, 5e6, 5e6)
    assert stats["rank_spread_us"] == 0.0 and stats["slowest_rank"] == 0  # both ranks' medians are 2 s
