"""The 3D trainer's checkpoints across layouts, crashes and bad input (tests/parallel/test_checkpoint.py).

One decoder (MoE MLPs, sharded embeddings) trains with AdamW on a global batch of 8
sequences, cut into the same 4 chunks of 2 in every layout (dp ranks x micro-batches), so
that every layout's loss is one process's. Phases (``--phase``), one launch each:

- ``eight`` (8 ranks, pp2 x dp2 x tp2 ep2, FSDP2): trains 3 steps, saves step 3, records the
  probe loss and the losses of steps 3 and 4 (the reference). Bad input on the same ranks: a
  checkpoint of another model, an unwritable directory, a full disk on one rank each raise
  CheckpointError on every rank, and the good checkpoint still loads. It also loads into the
  vocabulary stages (the token embedding and the head as pp stages of rows each,
  Interleaved1F1B x3), which train steps 3 and 4 alike and save checkpoint V.
- ``crash`` (4 ranks, dp4 ep4): trains with a checkpoint every 2 steps; rank 0 is SIGKILLed
  while it writes the checkpoint of step 6 (pickling ``extra`` kills it).
- ``four`` (4 ranks, dp4 ep4, DDP): loads the 8-rank checkpoint (experts 4 ways instead of 2,
  the tables 4 ways, no TP, no pipeline), gives the same probe loss, saves it again and trains
  steps 3 and 4 as the 8 ranks did; a column-sharded table reloads row-sharded. Then resumes
  the crashed run: the partial step 6 is ignored and removed, step 4 loads, and the losses
  from step 4 on equal an uninterrupted run's exactly.
- ``one`` (one process, no process group): the plain decoder loads the 8-rank and the 4-rank
  checkpoints to the same parameters and optimizer state, gives the same probe loss and the
  same next steps; and checkpoint V, its rows chunks of the whole tables, to V's probe loss.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from checkpoint_fixture import (
    CHUNKS,
    LAYOUTS,
    LR,
    MODEL,
    MOE,
    PROBE,
    SAME,
    STEPS_TOL,
    batch,
    build,
    close,
    mine,
    train,
    write_gaps,
)
from runner import raises, report, run_checks, start
from torch import nn

import sparta
from sparta.embedding import SparseEmbedding, VocabParallelHead
from sparta.parallel import (
    Decoder,
    DecoderConfig,
    Layout,
    build_layout,
    moe_layers,
)
from sparta.parallel.checkpoint import Checkpointer, CheckpointError


# ------------------------------------------------------------------------ eight
def eight(layout: Layout, base: Path) -> list[Callable[[], None]]:
    rank = layout.world.rank
    pm, opt = build(layout, "fsdp")
    ckpt = Checkpointer(base / "A", keep=2)

    def trains_saves_and_records_the_reference() -> None:
        train(pm, opt, range(3))
        path = ckpt.save(3, pm.parts, opt, {"seed": 0})
        assert path == base / "A" / "step_3" and ckpt.steps() == [3], ckpt.steps()
        reference = {"probe": pm.evaluate(*mine(layout, PROBE)), "steps": train(pm, opt, range(3, 5))}
        if rank == 0:
            (base / "reference.json").write_text(json.dumps(reference))

    def another_model_names_its_keys() -> None:
        torch.manual_seed(0)
        other = Decoder(DecoderConfig(vocab_size=80, seq_len=8, d_model=16, n_layers=4, n_heads=4, d_ff=32))
        moe_layers(other, MOE, None)
        del other.layers["3"]
        other.extra = nn.Linear(2, 2)
        names = (
            r"missing keys \(2\): model.extra.bias, model.extra.weight; unexpected keys \(\d+\): "
            r"model.layers.3.attn.wk.bias, .*; shape mismatches \(\d\): model.output.*, "
            r"model.tok_emb.weight \(checkpoint \(64, 16\), model \(80, 16\)\)"
        )
        with raises(CheckpointError, names):
            ckpt.load([other], None)

    def unwritable_directory_fails_everywhere() -> None:
        blocker = base / "a-file"
        if rank == 0:
            blocker.write_text("not a directory")
        dist.barrier()
        with raises(CheckpointError, r"rank 0: cannot create .*a-file/ckpt/.tmp-step_1"):
            Checkpointer(blocker / "ckpt").save(1, pm.parts, opt)

    def full_disk_on_one_rank_fails_everywhere() -> None:
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        if rank == 5:
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
        try:
            with raises(
                CheckpointError, r"writing .*\.tmp-step_5 failed: rank 5: OSError: \[Errno 27\] File too large"
            ):
                ckpt.save(5, pm.parts, opt, {"seed": 0})
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
            signal.signal(signal.SIGXFSZ, old)
        assert ckpt.steps() == [3], ckpt.steps()
        assert sorted(p.name for p in ckpt.path.iterdir()) == ["step_3"], list(ckpt.path.iterdir())

    def the_good_checkpoint_still_loads() -> None:
        fresh, fresh_opt = build(layout, "fsdp", seed=1)
        assert ckpt.load(fresh.parts, fresh_opt) == {"seed": 0, "step": 3}
        want = json.loads((base / "reference.json").read_text())
        close([fresh.evaluate(*mine(layout, PROBE))], [want["probe"]], SAME, "probe loss after loading")
        close(train(fresh, fresh_opt, range(3, 5)), want["steps"], 0.0, "the same layout continues exactly")
        fresh.close()

    def loads_into_vocab_stages_and_saves_them() -> None:
        stages, stages_opt = build(layout, "sparta", seed=2, vocab_stages=True)
        assert "stage 0: tok_emb[0:32]" in str(stages.plan) and "stage 5: output[32:64]" in str(stages.plan)
        assert ckpt.load(stages.parts, stages_opt) == {"seed": 0, "step": 3}
        want = json.loads((base / "reference.json").read_text())
        close([stages.evaluate(*mine(layout, PROBE))], [want["probe"]], SAME, "probe loss, 8 ranks -> vocab stages")
        close(train(stages, stages_opt, range(3, 5)), want["steps"], STEPS_TOL, "steps 3 and 4 in vocab stages")
        Checkpointer(base / "V").save(5, stages.parts, stages_opt, {"seed": 0})
        probe = stages.evaluate(*mine(layout, PROBE))
        if rank == 0:
            (base / "vocab.json").write_text(json.dumps({"probe": probe}))
        stages.close()

    return [
        trains_saves_and_records_the_reference,
        another_model_names_its_keys,
        unwritable_directory_fails_everywhere,
        full_disk_on_one_rank_fails_everywhere,
        the_good_checkpoint_still_loads,
        loads_into_vocab_stages_and_saves_them,
    ]


# ------------------------------------------------------------------------ crash
class _DieWhenPickled:
    """Pickling it SIGKILLs the process: DCP pickles rank 0's ``extra`` while it writes, so
    rank 0 dies in the middle of a checkpoint, after the other ranks may have written."""

    def __reduce__(self) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


def crash(layout: Layout, base: Path) -> list[Callable[[], None]]:
    def dies_while_saving_step_6() -> None:
        pm, opt = build(layout, "sparta")
        ckpt = Checkpointer(base / "run", keep=2)
        losses = base / "crashed.jsonl"
        for step in range(8):
            loss = train(pm, opt, range(step, step + 1))[0]
            if layout.world.rank == 0:
                with losses.open("a") as f:
                    f.write(json.dumps({"step": step, "loss": loss}) + "\n")
            if (step + 1) % 2 == 0:
                extra = {"seed": 0, "crash": _DieWhenPickled()} if step + 1 == 6 else {"seed": 0}
                ckpt.save(step + 1, pm.parts, opt, extra)
        raise AssertionError("the run should have died saving step 6")

    return [dies_while_saving_step_6]


# ------------------------------------------------------------------------- four
def four(layout: Layout, base: Path) -> list[Callable[[], None]]:
    rank = layout.world.rank

    def loads_the_eight_rank_checkpoint() -> None:
        pm, opt = build(layout, "ddp", seed=2)
        extra = Checkpointer(base / "A").load(pm.parts, opt)
        assert extra == {"seed": 0, "step": 3}, extra
        want = json.loads((base / "reference.json").read_text())
        close([pm.evaluate(*mine(layout, PROBE))], [want["probe"]], SAME, "probe loss, 8 ranks -> 4")
        Checkpointer(base / "B").save(3, pm.parts, opt, {"seed": 0})
        close(train(pm, opt, range(3, 5)), want["steps"], STEPS_TOL, "steps 3 and 4, 8 ranks -> 4")
        pm.close()

    def sharded_tables_reload_in_other_cuts() -> None:
        """A column-sharded table reloads row-sharded; a vocabulary-parallel head's row shards
        and a table tied to a head are saved as whole tables too."""
        torch.manual_seed(5)
        tied = SparseEmbedding(10, 8, comm=layout.dp)
        saved = nn.ModuleDict(
            {
                "table": SparseEmbedding(10, 8, comm=layout.dp, sharding="column"),
                "head": VocabParallelHead(8, 10, layout.dp),
                "tied": tied,
                "tied_head": VocabParallelHead(8, 10, layout.dp, tie=tied),
            }
        )
        full = {"table": saved["table"].full_weight(), "tied": tied.full_weight()}
        full["head"] = torch.cat(layout.dp.all_gather(saved["head"].weight.detach()))
        Checkpointer(base / "C").save(0, saved)
        torch.manual_seed(6)
        other = SparseEmbedding(10, 8, comm=layout.dp)
        loaded = nn.ModuleDict(
            {
                "table": SparseEmbedding(10, 8, comm=layout.dp, sharding="row"),
                "head": VocabParallelHead(8, 10, layout.dp),
                "tied": other,
                "tied_head": VocabParallelHead(8, 10, layout.dp, tie=other),
            }
        )
        Checkpointer(base / "C").load(loaded)
        assert torch.equal(loaded["table"].full_weight(), full["table"])
        assert torch.equal(torch.cat(layout.dp.all_gather(loaded["head"].weight.detach())), full["head"])
        assert torch.equal(other.full_weight(), full["tied"])
        if rank == 0:
            torch.save(full, base / "tables.pt")

    def resumes_the_crashed_run_exactly() -> None:
        run = Checkpointer(base / "run", keep=2)
        assert run.steps() == [2, 4], run.steps()
        assert (base / "run" / ".tmp-step_6").is_dir(), "the crash left no partial checkpoint"
        dist.barrier()  # every rank has looked before the load removes it
        uninterrupted = train(*build(layout, "sparta"), range(8))
        pm, opt = build(layout, "sparta", seed=3)
        extra = run.load(pm.parts, opt)
        assert extra == {"seed": 0, "step": 4}, extra
        assert not (base / "run" / ".tmp-step_6").exists(), "load left the partial checkpoint"
        resumed = train(pm, opt, range(4, 8))
        crashed = [json.loads(line)["loss"] for line in (base / "crashed.jsonl").read_text().splitlines()]
        assert len(crashed) == 6, crashed
        assert crashed == uninterrupted[:6], (crashed, uninterrupted)
        assert resumed == uninterrupted[4:], f"resumed {resumed} vs uninterrupted {uninterrupted[4:]}"

    return [
        loads_the_eight_rank_checkpoint,
        sharded_tables_reload_in_other_cuts,
        resumes_the_crashed_run_exactly,
    ]


# -------------------------------------------------------------------------- one
def one_process(base: Path) -> list[Callable[[], None]]:
    """No process group: the plain decoder (nn.Embedding, experts in one MoELayer each)."""

    def model() -> tuple[Decoder, torch.optim.Optimizer]:
        torch.manual_seed(4)
        decoder = Decoder(MODEL)
        moe_layers(decoder, MOE, None)
        return decoder, torch.optim.AdamW(decoder.parameters(), lr=LR)

    def chunked(decoder: Decoder, opt: torch.optim.Optimizer | None, step: int) -> float:
        """The global batch in the trainer's 4 chunks: mean loss; with ``opt``, one step."""
        ids, targets = batch(step)
        total = 0.0
        for x, y in zip(ids.chunk(CHUNKS), targets.chunk(CHUNKS), strict=True):
            with torch.set_grad_enabled(opt is not None):
                loss = nn.functional.cross_entropy(decoder(x).flatten(0, 1), y.flatten())
            if opt is not None:
                loss.backward()
            total += float(loss)
        if opt is not None:
            for p in decoder.parameters():  # the gradient of the chunks' mean, as the trainer's
                if p.grad is not None:
                    p.grad /= CHUNKS
            opt.step()
            opt.zero_grad()
        return total / CHUNKS

    def loads_both_without_a_process_group() -> None:
        assert not dist.is_initialized()
        want = json.loads((base / "reference.json").read_text())
        loaded = []
        for name in "AB":
            decoder, opt = model()
            assert Checkpointer(base / name).load(decoder, opt) == {"seed": 0, "step": 3}
            close([chunked(decoder, None, PROBE)], [want["probe"]], SAME, f"probe loss, checkpoint {name} -> 1")
            loaded.append((decoder, opt))
        (a, opt_a), (b, opt_b) = loaded
        for (key, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            assert torch.equal(x, y), f"{key} differs between the 8-rank and the 4-rank checkpoint"
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert opt_a.state[p].keys() == {"step", "exp_avg", "exp_avg_sq"}, opt_a.state[p].keys()
            for name in opt_a.state[p]:
                assert torch.equal(opt_a.state[p][name], opt_b.state[q][name]), name
            assert float(opt_a.state[p]["step"]) == 3
        close([chunked(a, opt_a, s) for s in (3, 4)], want["steps"], STEPS_TOL, "steps 3 and 4, 8 ranks -> 1")

    def loads_the_vocab_stages_rows_as_whole_tables() -> None:
        decoder, opt = model()
        assert Checkpointer(base / "V").load(decoder, opt) == {"seed": 0, "step": 5}
        want = json.loads((base / "vocab.json").read_text())
        close([chunked(decoder, None, PROBE)], [want["probe"]], SAME, "probe loss, vocab stages -> 1")
        assert all(float(opt.state[p]["step"]) == 5 for p in decoder.parameters())

    def loads_the_sharded_tables_as_plain_modules() -> None:
        tied = nn.Embedding(10, 8)
        head = nn.Linear(8, 10, bias=False)
        model = nn.ModuleDict({"table": nn.Embedding(10, 8), "head": head, "tied": tied})
        model.tied_head = nn.Module()
        model.tied_head.tied = tied  # the head's key of the tied table: tied_head.tied.weight
        Checkpointer(base / "C").load(model)
        full = torch.load(base / "tables.pt")
        assert torch.equal(model["table"].weight, full["table"])
        assert torch.equal(head.weight, full["head"])
        assert torch.equal(tied.weight, full["tied"])

    return [
        loads_both_without_a_process_group,
        loads_the_vocab_stages_rows_as_whole_tables,
        loads_the_sharded_tables_as_plain_modules,
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=[*LAYOUTS, "one"], required=True)
    parser.add_argument("--dir", type=Path, required=True)
    args, _ = parser.parse_known_args()
    torch.set_num_threads(1)
    if args.phase == "one":  # no sparta.init, no process group
        failures = 0
        for check in one_process(args.dir):
            try:
                check()
            except Exception:
                failures += 1
                report(0, check.__name__, False, traceback.format_exc()[-2000:])
            else:
                report(0, check.__name__, True)
        write_gaps(args.dir, args.phase)
        sys.exit(1 if failures else 0)
    world, _ = start(timeout_s=120.0)
    layout = build_layout(LAYOUTS[args.phase], world)
    checks = {"eight": eight, "crash": crash, "four": four}[args.phase](layout, args.dir)
    failures = run_checks(world, [_bound(check) for check in checks])
    if world.rank == 0:
        write_gaps(args.dir, args.phase)
    world.shutdown()
    # DeviceMesh's process groups outlive the world's shutdown; their destructors at
    # interpreter exit can abort a clean run (see World.shutdown), so leave without them.
    sys.stdout.flush()
    os._exit(1 if failures else 0)


def _bound(check: Callable[[], None]) -> Callable[[sparta.World], None]:
    def bound(world: sparta.World) -> None:
        check()

    bound.__name__ = check.__name__
    return bound


if __name__ == "__main__":
    main()
