"""`sparta bench`: every suite end to end on 2 real ranks at tiny sizes (records well formed,
results equal to the oracle), a planted wrong value failing the run, the launch's world
check, and plot on a run's file (the pieces that need no launch: `test_bench_offline.py`).
No timing is asserted: speed is the benchmark's to report, not a test's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from launch import free_port, require_engine, run_killing_on_timeout

from sparta_tools.bench import main, records
from sparta_tools.bench.runner import engine_missing

HEADER_FIELDS = ("sparta", "git", "torch", "nccl", "mpi_library", "horovod", "hosts", "ranks_per_node", "cpu_model",
                 "binding", "env", "command", "options", "bandwidth", "timing", "launches", "engines")  # fmt: skip
POINT_FIELDS = ("median_us", "min_us", "max_us", "p99_us", "rank_spread_us", "algbw_GBps", "busbw_GBps",
                "busbw_noself_GBps", "internode_busbw_GBps", "imbalance", "wrong", "variant", "bytes")  # fmt: skip
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
TINY = ["-n", "2", "-w", "1", "--nprocs", "2", "--timeout", "240"]


def bench(args: list[str], timeout: float = 400) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return run_killing_on_timeout([sys.executable, "-m", "sparta.cli", "bench", *args], env, timeout, "sparta bench")


def points(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r["type"] == "point" and r["engine"] not in ("nccl-tests", "osu")]


@pytest.fixture(scope="module")
def collectives_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """One run of every op on every engine (one launch each), 1 KiB and 4 KiB."""
    path = tmp_path_factory.mktemp("bench") / "collectives.jsonl"
    code, out = bench(["collectives", "-b", "1K", "-e", "4K", "-f", "4", *TINY, "-J", str(path)], timeout=600)
    return path, code, out


def test_collectives_every_op_every_engine(collectives_run: tuple[Path, int, str]) -> None:
    path, code, out = collectives_run
    assert code == 0, out[-4000:]
    recs = records.read_records(path)
    head = recs[0]
    assert all(k in head for k in HEADER_FIELDS), sorted(set(HEADER_FIELDS) - set(head))
    assert head["ranks"] == 2 and head["nodes"] == 1 and head["ranks_per_node"] == [2], head
    assert head["git"]["commit"] and head["command"][:3] == ["sparta", "bench", "collectives"], head
    assert "2(n-1)/n" in head["bandwidth"]["busbw"] and head["options"]["iters"] == 2
    ran = {engine: engine_missing(engine) is None for engine in ("torch", "mpi", "horovod")}
    if os.environ.get("CI"):  # CI runs every engine: a skipped record there is a failure
        assert all(ran.values()), ran
    assert sorted(head["engines"]) == sorted(e for e, ok in ran.items() if ok), head["engines"]
    got = points(recs)
    for engine, ok in ran.items():
        mine = [p for p in got if p["engine"] == engine]
        if not ok:  # not installed here: a skipped record says why, never silence
            assert any(r["type"] == "skipped" and r.get("engine") == engine for r in recs), engine
            continue
        keys = {(p["op"], p["variant"], p["bytes"]) for p in mine}
        assert keys == {(op, v, b) for op in OPS for v in ("raw", "sparta", "sparta+check") for b in (1024, 4096)}
    for p in got:
        assert all(k in p for k in POINT_FIELDS), (p, set(POINT_FIELDS) - set(p))
        assert p["wrong"] == 0 and p["ranks"] == 2, p
        assert 0 < p["min_us"] <= p["median_us"] <= p["max_us"] and p["p99_us"] <= p["max_us"], p
        factor = 2 * (2 - 1) / 2 if p["op"] == "all_reduce" else 1.0 if p["op"] == "broadcast" else 0.5
        assert p["busbw_GBps"] == pytest.approx(p["algbw_GBps"] * factor, rel=1e-3), p
        assert p["busbw_noself_GBps"] == pytest.approx(p["busbw_GBps"], rel=1e-3), p  # uniform: no self-traffic
        assert p["internode_busbw_GBps"] is None and p["imbalance"] == 1.0, p
    peers = [r for r in recs if r.get("peer")]
    assert {r["peer"].split()[0] for r in peers} == {"nccl-tests", "OSU"}, peers  # skipped or run, never missing
    assert "#wrong" in out and f"# {len(got)} points, 0 wrong" in out, out[-3000:]


def test_plot_writes_a_png(collectives_run: tuple[Path, int, str], tmp_path: Path) -> None:
    path, code, _ = collectives_run
    assert code == 0
    png = tmp_path / "run.png"
    assert main(["plot", str(path), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_alltoallv_patterns_against_the_oracle(tmp_path: Path) -> None:
    matrix = tmp_path / "matrix.json"
    matrix.write_text(json.dumps([[400, 1200], [0, 2000]]))  # bytes: rank 1 sends itself everything
    path = tmp_path / "v.jsonl"
    args = ["alltoallv", "-b", "2K", "-e", "8K", "-f", "4", *TINY, "--engines", "torch", "-J", str(path)]
    args += ["--bind", "core", "--ranks-per-node", "1"]  # two posed nodes: inter-node figures
    code, out = bench([*args, "--patterns", "uniform,zipf,moe,file", "--matrix", str(matrix)])
    assert code == 0, out[-4000:]
    recs = records.read_records(path)
    pinned = recs[0]["binding"]["affinity_per_rank"]
    cores = sorted(os.sched_getaffinity(0))
    assert recs[0]["binding"]["mode"] == "core" and pinned == [[cores[0]], [cores[1 % len(cores)]]], recs[0]["binding"]
    got = points(recs)
    by = {(p["pattern"], p["variant"], p["bytes"]) for p in got}
    assert {pattern for pattern, _, _ in by} == {"uniform", "zipf", "moe", "file"}, by
    assert all(p["wrong"] == 0 and p["op"] == "alltoallv" for p in got), got
    file_point = next(p for p in got if p["pattern"] == "file")
    assert file_point["matrix_bytes"] == [[400, 1200], [0, 2000]] and file_point["bytes"] == 1800
    # algbw: the busiest rank's max(sent, received) = rank 1 receives 3200 bytes; self-traffic
    # excluded: rank 0 sends 1200 to rank 1 and receives 0 from it
    t = file_point["median_us"] / 1e6
    assert file_point["algbw_GBps"] == pytest.approx(3200 / t / 1e9, rel=1e-3)
    assert file_point["busbw_noself_GBps"] == pytest.approx(1200 / t / 1e9, rel=1e-3)
    assert file_point["imbalance"] == pytest.approx(3200 / ((1600 + 3200) / 2), rel=1e-3)
    assert recs[0]["nodes"] == 2 and file_point["nodes"] == 2, recs[0]["ranks_per_node"]
    assert file_point["internode_busbw_GBps"] == pytest.approx(1200 / t / 1e9, rel=1e-3)  # the other rank is off-node
    zipf = next(p for p in got if p["pattern"] == "zipf")
    assert zipf["imbalance"] > 1.0, zipf


def test_a_wrong_value_fails_the_run(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    args = ["collectives", "-b", "1K", "-e", "1K", *TINY, "--engines", "torch", "--ops", "broadcast", "-J", str(path)]
    code, out = bench([*args, "--_plant-wrong"])
    assert code == 1, out[-3000:]
    got = points(records.read_records(path))
    assert [p["wrong"] for p in got] == [1, 0, 0], got  # the first variant's first check, rank 0's first element
    assert "1 wrong values" in out


def test_under_the_users_torchrun_the_header_has_its_command(tmp_path: Path) -> None:
    out_file = tmp_path / "run.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "sparta.cli", "bench", "collectives", "-b", "1K", "-e", "1K",
           "--ops", "all_reduce", "-n", "2", "-w", "1", "-J", str(out_file)]  # fmt: skip
    code, out = run_killing_on_timeout(cmd, env, 240, "torchrun sparta bench")
    assert code == 0, out[-3000:]
    head = records.read_records(out_file)[0]
    # the rank's own argv, and how to rerun the whole job: the torchrun line as typed
    assert head["command"][:3] == ["sparta", "bench", "collectives"] and head["launcher"] == "torchrun", head
    assert head["launch_command"][1:] == cmd[1:], head["launch_command"]
    assert sum(p["wrong"] for p in points(records.read_records(out_file))) == 0


def test_a_launch_that_did_not_join_every_node_is_refused() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "sparta.cli", "bench", "collectives", "-b", "1K", "-e", "1K",
           "--expect-nodes", "2"]  # fmt: skip
    code, out = run_killing_on_timeout(cmd, env, 240, "torchrun sparta bench")
    assert code != 0 and "span 1 host(s) but 2 were expected (--expect-nodes)" in out, out[-3000:]


def test_moe_layer_checks_every_dropless_candidate(tmp_path: Path) -> None:
    """Planted: rank 0's reference is off by one element at the first check, so exactly one
    point is wrong and the run exits 1; every other checked candidate equals the reference."""
    path = tmp_path / "m.jsonl"
    candidates = "dense,naive,sparta_dropless,sparta_cap1.25,sparta_pipelined"
    args = ["moe-layer", "--config", "tiny", *TINY, "--candidates", candidates, "-J", str(path), "--_plant-wrong"]
    code, out = bench(args)
    assert code == 1, out[-3000:]
    recs = records.read_records(path)
    got = {p["variant"]: p for p in points(recs)}
    assert sorted(got) == ["dense", "sparta_cap1.25", "sparta_dropless", "sparta_pipelined"], sorted(got)
    assert got["sparta_dropless"]["wrong"] == 1 and got["sparta_pipelined"]["wrong"] == 0, got
    assert got["dense"]["wrong"] is None and "floor" in got["dense"]["unchecked"], got["dense"]
    assert got["sparta_cap1.25"]["wrong"] is None and "capacity" in got["sparta_cap1.25"]["unchecked"]
    assert got["dense"]["ratio_to_dense"] == 1.0 and all(p["imbalance"] >= 1.0 for p in got.values()), got
    assert all(p["tokens_per_rank"] == 128 and p["ranks"] == 2 for p in got.values()), got
    skipped = {r.get("candidate"): r["reason"] for r in recs if r["type"] == "skipped"}
    assert "one process only" in skipped["naive"] and "PyPI" in skipped["tutel"], skipped


def test_pipeline_plans_and_dispatch_skews(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    code, out = bench(["pipeline", "--config", "tiny", *TINY, "--degrees", "1;2,4;auto", "-J", str(path)])
    assert code == 0, out[-3000:]
    got = points(records.read_records(path))
    names = [p["variant"] for p in got]
    assert names[:3] == ["dense", "r=1", "r=(2, 4)"] and names[3].startswith("auto ("), names
    assert [p["wrong"] for p in got] == [None, 0, 0, 0], got
    path = tmp_path / "d.jsonl"
    args = ["dispatch", "-b", "16K", "-e", "16K", *TINY, "--skews", "0,2", "--d-model", "64", "--experts", "8"]
    code, out = bench([*args, "-J", str(path)])
    assert code == 0, out[-3000:]
    got = points(records.read_records(path))
    assert {(p["pattern"], p["variant"]) for p in got} == {
        (f"zipf-s{s}", v) for s in ("0", "2") for v in ("sparta", "naive")
    }
    assert all(p["wrong"] == 0 and p["tokens"] == 64 for p in got), got
    skew = {p["pattern"]: p["imbalance"] for p in got}
    assert skew["zipf-s2"] > skew["zipf-s0"] >= 1.0, skew  # the bias makes hot experts hotter


def test_embedding_variants_equal_a_replayed_model(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    args = ["embedding", "--vocabs", "500", "--dim", "16", "--batch", "2", "--seq", "8", *TINY, "--engines", "torch"]
    code, out = bench([*args, "-J", str(path)])
    assert code == 0, out[-3000:]
    got = {p["variant"]: p for p in points(records.read_records(path))}
    assert set(got) == {"ddp", "sparta_row", "sparta_column", "sparta_row_sparse", "sparta_column_sparse",
                        "sparta_row_queue", "sparta_row_noqueue", "dense_block_alone"}, sorted(got)  # fmt: skip
    for name, p in got.items():
        assert p["wrong"] == (None if name == "dense_block_alone" else 0), p
        assert p["vocab"] == 500 and p["ids_per_rank"] == 16, p
    assert got["ddp"]["bytes_sent_per_step"] > got["sparta_row"]["bytes_sent_per_step"] > 0, got
    assert got["ddp"]["table_bytes_per_rank"] == 2 * 500 * 16 * 4 == 2 * got["sparta_row"]["table_bytes_per_rank"]


def test_embedding_horovod_variants_equal_a_replayed_model(tmp_path: Path) -> None:
    """Enough repeated ids (2 x 2048 Zipf ids over 100 rows) that an SGD step on Horovod's
    gathered, uncoalesced sparse gradient (each copy of a row added to the weight alone)
    lands off the replayed model: hvd_sparse reported 964 wrong values here before the
    variant coalesced the gradient."""
    require_engine("horovod")
    path = tmp_path / "eh.jsonl"
    args = ["embedding", "--vocabs", "100", "--dim", "8", "--batch", "2", "--seq", "1024", *TINY]
    code, out = bench([*args, "--engines", "horovod", "--variants", "hvd_sparse,hvd_dense", "-J", str(path)])
    assert code == 0, out[-3000:]
    got = {p["variant"]: p for p in points(records.read_records(path))}
    assert set(got) == {"hvd_sparse", "hvd_dense"} and all(p["wrong"] == 0 for p in got.values()), got
    # allgather: the other rank's 2048 (id, row) pairs; sparse_as_dense: the 100 x 8 table all-reduced
    assert got["hvd_sparse"]["bytes_sent_per_step"] > got["hvd_dense"]["bytes_sent_per_step"] > 100 * 8 * 4, got


def test_embedding_with_a_transformer_block_on_an_emulated_cluster(tmp_path: Path) -> None:
    """--rate: two emulated nodes behind 1 Gbit/s links (root only, as tests/scheduling/test_cluster.py)."""
    from sparta_tools.cluster import can_emulate

    why = can_emulate()
    if why:
        pytest.skip(why)
    path = tmp_path / "er.jsonl"
    args = ["embedding", "--rate", "1gbit", "--vocabs", "500", "--dim", "16", "--batch", "2", "--seq", "8", *TINY]
    args += ["--block", "transformer", "--variants", "ddp,sparta_row,sparta_row_queue,hvd_sparse,hvd_dense"]
    args += ["--engines", "torch,horovod,mpi"]
    code, out = bench([*args, "-J", str(path)])
    assert code == 0, out[-3000:]
    recs = records.read_records(path)
    assert recs[0]["nodes"] == 2 and recs[0]["options"]["rate"] == "1gbit", recs[0]
    got = [(p["engine"], p["variant"], p["wrong"], p["block"]) for p in points(recs)]
    want = [("torch", "ddp", 0, "transformer"), ("torch", "sparta_row", 0, "transformer"),
            ("torch", "sparta_row_queue", 0, "transformer")]  # fmt: skip
    if engine_missing("horovod") is None:  # Horovod's ranks start as horovodrun --gloo starts them
        want += [("horovod", "sparta_row", 0, "transformer"), ("horovod", "hvd_sparse", 0, "transformer"),
                 ("horovod", "hvd_dense", 0, "transformer")]  # fmt: skip
        launches = {h["engine"]: h["launcher"] for h in recs[0]["launches"]}
        assert launches == {"torch": "torchrun", "horovod": "horovodrun"}, recs[0]["launches"]
    assert sorted(got) == sorted(want), got
    assert any(r["type"] == "skipped" and "not as mpirun" in r["reason"] for r in recs), recs
