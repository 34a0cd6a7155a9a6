"""Faults on real processes (tests/test_faults.py launches it; --case picks one).

lifecycle: the node communicators are made once; handles dropped without wait() never
    pair messages wrongly, and one whose collective fails breaks its communicator with a
    clear error; Ctrl-C during a wait ends it at once and breaks the group; a split that a
    rank joins late times out naming the groups (late-split:
    that check alone, for Horovod, where it breaks the whole world); after
    `world.shutdown()` no sparta or gloo thread is left; `world.exit()` runs `finally:` and
    atexit.
kill: expert-parallel MoE training; rank --victim SIGKILLs itself in the middle of a
    step's backward; every survivor must raise a SpartaError (reported with its message
    and how long it took), and the communicator must refuse what comes after. Every rank
    first reports the /dev/shm files it maps or holds open, for the test to check that
    none is left behind.
exit-dropped: rank 0 drops seven handles, lets go of their groups and shuts down: the
    collective its peers join late completes for them, the six they never join (on six
    groups) make shutdown raise naming them (Horovod: the first, whose timeout breaks
    every group), about one timeout after they were issued, not one timeout per group;
    rank 1's shutdown inside an `except:` block logs such a collective instead.
stage-fails: pp 2 dp 2; stage 0's forward raises in the second step, and its rank catches the
    error and stays alive; stage 1, waiting in torch's receive, must raise within about the
    world's timeout (the mesh's groups kept torch's 30 minutes before).
after: a new job after the killed one: an all-reduce, checked.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from runner import RESULTS_DIR, raises, report, run_checks, start

import sparta
from sparta.comm import CommConfig, Communicator
from sparta.errors import CollectiveError, CollectiveTimeoutError, SpartaError
from sparta.moe import MoELayer
from sparta.parallel import Decoder, DecoderConfig, ParallelConfig, ParallelDims, build_layout, parallelize

SHORT_S = 3.0  # the timeout of the groups whose collectives are meant to fail
INTERRUPT_AFTER_S = 1.0  # when rank 1 "presses Ctrl-C" in check_interrupted_wait_breaks_its_group
LATE_JOIN_S = 5.0  # when rank 0 joins that all-reduce
NEVER_GROUPS = 6  # groups with a collective their peers never join, in exit-dropped
KILL_STEP = 2


def _group(world: sparta.World, check_inputs: bool = True) -> Communicator:
    group = world.comm.split_groups([list(range(world.size))], CommConfig(timeout_s=SHORT_S, check_inputs=check_inputs))
    assert group is not None
    return group


def check_node_comms_are_made_once(world: sparta.World) -> None:
    intra, inter = world.node_comms()
    again = world.node_comms()
    assert again[0] is intra and again[1] is inter, "node_comms() made new groups on its second call"
    for group in (intra, inter):
        got = group.all_reduce(torch.tensor([float(world.rank)]))
        assert got.item() == sum(group.ranks), (group.name, got.item(), group.ranks)


def check_dropped_handles_never_mispair(world: sparta.World) -> None:
    """Each dropped collective carries values that would be caught if a later one read them."""
    comm, n, r = world.comm, world.size, world.rank
    for i in range(3):
        comm.all_reduce(torch.full((4,), 1000.0 * (i + 1)), async_op=True)  # dropped at once
        comm.all_to_all(torch.full((n, 2), -1.0 - i), async_op=True)
        gc.collect()
        total = comm.all_reduce(torch.full((4,), float(r)))
        assert total.tolist() == [float(sum(range(n)))] * 4, total
        rows = comm.all_to_all(torch.arange(n, dtype=torch.float32).view(n, 1) + 10 * r)
        assert rows.view(-1).tolist() == [10.0 * src + r for src in range(n)], rows


def check_dropped_failed_handle_breaks_its_communicator(world: sparta.World) -> None:
    """Rank 0 joins the dropped all-reduce only after its peers gave up on it: they must see
    an error that says so at their next call, and a broken communicator after."""
    group = _group(world, check_inputs=False)  # no agreement round: the dropped op starts at once
    if world.rank == 0:
        time.sleep(SHORT_S + 2)
        try:  # lets MPI's call threads on the other ranks finish (gloo's gave up already)
            group.all_reduce(torch.ones(2))
        except CollectiveError:
            pass
        return
    group.all_reduce(torch.ones(2), async_op=True)
    gc.collect()
    with raises(CollectiveError, "dropped without wait"):
        group.all_reduce(torch.ones(2))
    assert group.broken is not None
    with raises(CollectiveError, "broken"):
        group.barrier()


def check_interrupted_wait_breaks_its_group(world: sparta.World) -> None:
    """Ctrl-C reaches rank 1 while it waits in an all-reduce that rank 0 joins seconds
    later: the wait must end at once (a blocking engine wait would hold it until rank 0
    came) with KeyboardInterrupt, and the group refuse every call after, since its op may
    still run; the op still completes for the others once rank 0 joins."""
    group = world.comm.split_groups([list(range(world.size))], CommConfig(timeout_s=60, check_inputs=False))
    assert group is not None
    total = float(sum(range(1, world.size + 1)))
    if world.rank == 0:
        time.sleep(LATE_JOIN_S)
    if world.rank != 1:
        got = group.all_reduce(torch.tensor([float(world.rank + 1)]))
        assert got.item() == total, (got.item(), total)
        world.comm.barrier()  # the next check's groups have a short timeout: start it together
        return
    threading.Timer(INTERRUPT_AFTER_S, os.kill, (os.getpid(), signal.SIGINT)).start()
    began = time.monotonic()
    try:
        group.all_reduce(torch.tensor([2.0]))
    except KeyboardInterrupt:
        waited = time.monotonic() - began
    else:
        raise AssertionError("the all-reduce returned: the interrupt came only after rank 0 joined")
    assert waited < LATE_JOIN_S - 1, f"Ctrl-C took {waited:.1f} s to end a wait (rank 0 joined at {LATE_JOIN_S} s)"
    assert group.broken is not None and "interrupted (KeyboardInterrupt)" in group.broken, group.broken
    with raises(CollectiveError, "broken"):
        group.barrier()
    world.comm.barrier()


def check_late_split_times_out_naming_the_groups(world: sparta.World) -> None:
    """Rank 0 joins a split only after its peers gave up: those in its new group (on MPI and
    Horovod, where the split is one collective of the world, every peer) must time out
    naming the groups."""
    group = _group(world)
    halves = [list(range(world.size // 2)), list(range(world.size // 2, world.size))]
    if world.rank == 0:
        time.sleep(SHORT_S + 2)
        try:  # the late member: completes the split the others' engines may still be in
            group.split_groups(halves)
        except CollectiveError:
            pass
        return
    if world.rank not in halves[0] and world.backend == "torch":  # its other groups form without rank 0
        assert group.split_groups(halves) is not None
        return
    with raises(CollectiveTimeoutError, "split.*" + re.escape(str(halves))):
        group.split_groups(halves)


def lifecycle(world: sparta.World) -> int:
    atexit.register(lambda: report(world.rank, "user_atexit_ran", True))
    checks = [
        check_node_comms_are_made_once,
        check_dropped_handles_never_mispair,
        check_dropped_failed_handle_breaks_its_communicator,
        check_interrupted_wait_breaks_its_group,
        check_late_split_times_out_naming_the_groups,
    ]
    failures = run_checks(world, checks)
    world.comm.barrier()  # the late rank is back
    world.shutdown()
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    # gloo's own threads: one left running into the interpreter's finalization is what
    # aborted clean runs (see World.shutdown)
    alive += [name for name in native_thread_names() if "gloo" in name]
    report(world.rank, "no_thread_after_shutdown", not alive, f"alive: {alive}")
    return failures + bool(alive)


def native_thread_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as comm:
            names.append(comm.read().strip())
    return names


def meet_on_disk(size: int, check: str) -> None:
    """Wait until every rank has reported `check`, through the results directory: a broken
    world cannot synchronise, and Horovod aborts a process as soon as a peer leaves."""
    folder = Path(os.environ[RESULTS_DIR])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if sum(f'"check": "{check}"' in p.read_text() for p in folder.glob("rank-*.jsonl")) == size:
            return
        time.sleep(0.1)


def shm_files() -> list[str]:
    """The files under /dev/shm this process maps or holds open."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                found.add(fields[5].strip().removesuffix(" (deleted)"))
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            found.add(target.removesuffix(" (deleted)"))
    return sorted(found)


def kill(world: sparta.World, victim: int) -> int:
    torch.manual_seed(0)
    layer = MoELayer(16, 32, 2 * world.size, top_k=2, ep_size=world.size, comm=world.comm).train()
    x = torch.randn(64, 16)
    began = time.monotonic()
    try:
        for step in range(KILL_STEP + 3):
            began = time.monotonic()
            y = layer(x)
            if step == KILL_STEP and world.rank == victim:
                report(world.rank, "shm_files", True, files=shm_files())
                y.register_hook(lambda _: os.kill(os.getpid(), signal.SIGKILL))  # in backward
            y.square().mean().backward()
            if step == 0:  # the transports are set up by now
                if world.rank != victim:
                    report(world.rank, "shm_files", True, files=shm_files())
    except SpartaError as exc:
        report(world.rank, "survivor_raised", True, waited_s=time.monotonic() - began, message=str(exc))
    except Exception as exc:  # a survivor must raise Sparta's error, not the engine's
        report(world.rank, "survivor_raised", False, f"{type(exc).__name__}: {exc}")
        return 1
    else:
        report(world.rank, "survivor_raised", False, "training went on without the killed rank")
        return 1
    try:
        world.comm.all_reduce(torch.ones(1))
    except CollectiveError as exc:
        report(world.rank, "refuses_after_failure", True, message=str(exc))
    else:
        report(world.rank, "refuses_after_failure", False, "an all_reduce after the failure returned")
    return 1  # the job failed: say so to the launcher


def exit_dropped(world: sparta.World) -> int:
    """Rank 0 drops all-reduces, lets go of their groups and shuts down at once: one its
    peers join a second later, which shutdown must still complete for them, and one on each
    of NEVER_GROUPS groups they never join, which shutdown must report (CollectiveError
    naming them) within about one timeout of their issue, together, instead of ending the
    job silently."""
    # no agreement rounds: rank 0's ops start at once, alone
    late = world.comm.split_groups([list(range(world.size))], CommConfig(timeout_s=60, check_inputs=False))
    never, *more = [_group(world, check_inputs=False) for _ in range(NEVER_GROUPS)]
    assert late is not None
    n = world.size
    world.comm.barrier()
    if world.rank != 0:
        time.sleep(1.0)
        got = late.all_reduce(torch.full((1 << 20,), float(world.rank + 1)))
        want = n * (n + 1) / 2
        ok = bool((got == want).all())
        report(world.rank, "dropped_op_completed", ok, "" if ok else f"got {got.unique().tolist()}, want {want}")
        if world.rank == 1:
            return int(not ok) + shutdown_beside_an_error(world, never)
        return int(not ok)
    late.all_reduce(torch.full((1 << 20,), 1.0), async_op=True)
    for group in (never, *more):
        group.all_reduce(torch.ones(2), async_op=True)
    del late, never, more, group
    gc.collect()
    began = time.monotonic()
    try:
        world.shutdown()
    except CollectiveError as exc:
        report(world.rank, "shutdown_names_unfinished", True, message=str(exc), waited_s=time.monotonic() - began)
    else:
        report(world.rank, "shutdown_names_unfinished", False, "shutdown returned quietly")
    return 1  # the job failed: a collective was never joined


def shutdown_beside_an_error(world: sparta.World, never: Communicator) -> int:
    """Rank 1 drops a collective that ranks 2 and 3 never join, then shuts down while its
    own error is being handled: shutdown must log the unfinished collective, not replace
    that error with its own."""
    never.all_reduce(torch.ones(2), async_op=True)
    gc.collect()
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("sparta.comm").addHandler(handler)
    try:
        try:
            raise RuntimeError("the user's own error")
        except RuntimeError:
            world.shutdown()
    except CollectiveError as exc:
        report(world.rank, "shutdown_logs_beside_an_error", False, f"raised: {exc}")
        return 1
    ok = any("did not complete" in m for m in logged)
    report(world.rank, "shutdown_logs_beside_an_error", ok, "" if ok else f"logged: {logged}")
    return 1  # the job failed


def stage_fails(world: sparta.World) -> int:
    """Stage 0's forward raises in the second step; its rank catches that and stays alive
    (its sockets open) for three timeouts. Stage 1 waits in torch's receive for activations
    that never come: it must raise within about the world's timeout, naming it."""
    layout = build_layout(ParallelDims(pp=2, dp=world.size // 2), world)
    placed = all(
        dist.get_process_group_ranks(layout.mesh.get_group(d)) == layout.mesh[d].mesh.tolist()
        for d in "pp dp tp".split()
    )
    report(world.rank, "mesh_groups_match_the_mesh", placed)
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=32))
    pm = parallelize(model, layout, ParallelConfig(schedule="1F1B", microbatches=2, split_points=("layers.1",)))
    ids = torch.randint(0, 32, (4, 8))
    pm.step(ids, ids)  # a good step first: the stages' shapes are known, no setup collective is left
    if layout.pp_rank == 0:

        def planted(*_: object) -> None:
            raise RuntimeError("a planted failure in stage 0's forward")

        pm.parts[0].register_forward_pre_hook(planted)
        try:
            pm.step(ids, ids)
        except RuntimeError as exc:  # torch's "[Stage 0] failed to run forward", from the planted one
            ok = "planted" in str(exc) or "planted" in str(exc.__cause__)
            report(world.rank, "failing_stage_raised", ok, message=f"{exc} (from: {exc.__cause__})")
        time.sleep(2 * world.comm.config.timeout_s + 5)  # alive: a closed socket would end the peer's wait
        return 1
    began = time.monotonic()
    try:
        pm.step(ids, ids)
    except Exception as exc:  # noqa: BLE001  (what it raises is the point: reported, then checked)
        report(
            world.rank,
            "peer_stage_raised",
            True,
            message=f"{type(exc).__name__}: {exc}",
            waited_s=time.monotonic() - began,
        )
    else:
        report(world.rank, "peer_stage_raised", False, "step returned")
    return 1


def after(world: sparta.World) -> int:
    got = world.comm.all_reduce(torch.tensor([float(world.rank + 1)]))
    ok = got.item() == world.size * (world.size + 1) / 2
    report(world.rank, "new_job_runs", ok, "" if ok else f"all_reduce gave {got.item()}")
    return int(not ok)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    cases = ("lifecycle", "late-split", "kill", "exit-dropped", "stage-fails", "after")
    parser.add_argument("--case", choices=cases, required=True)
    parser.add_argument("--victim", type=int, default=-1)
    parser.add_argument("--timeout", type=float, default=90.0)
    opts, _ = parser.parse_known_args()
    world, _ = start(timeout_s=opts.timeout)
    code = 1
    try:
        if opts.case == "lifecycle":
            code = lifecycle(world)
        elif opts.case == "late-split":  # alone: on Horovod it breaks the whole world
            code = run_checks(world, [check_late_split_times_out_naming_the_groups])
            meet_on_disk(world.size, check_late_split_times_out_naming_the_groups.__name__)
        elif opts.case == "kill":
            code = kill(world, opts.victim % world.size)
        elif opts.case == "exit-dropped":
            code = exit_dropped(world)
        elif opts.case == "stage-fails":
            code = stage_fails(world)
        else:
            code = after(world)
        world.exit(code)
    finally:
        report(world.rank, "finally_ran", True)
