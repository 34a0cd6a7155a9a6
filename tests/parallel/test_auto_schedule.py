"""AutoSchedule's bookkeeping in one process (the tuning itself is collective: the dist checks
`parity_*_auto_degrees` run it under torchrun, and `sparta train` under horovodrun and mpirun)."""

from __future__ import annotations

import pytest
import torch

from sparta.errors import InputError
from sparta.moe import MoELayer
from sparta.parallel.auto_schedule import AutoSchedule


def test_records_each_layers_last_input_and_leaves_no_hook() -> None:
    """The last: a pipeline stage's first run is torch's shape-learning pass, whose inputs
    after stage 0 are uninitialised memory."""
    layers = {f"layers.{i}.mlp": MoELayer(8, 16, 4, top_k=2) for i in range(2)}
    auto = AutoSchedule(layers, None)
    assert auto.pending and auto.describe() == "co-scheduler tuned: not yet"
    first, second = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    with auto.recording():
        for x in (first, second):
            for layer in layers.values():
                x = layer(x)
    assert torch.equal(auto.samples["layers.0.mlp"], second) and auto.samples["layers.1.mlp"].shape == first.shape
    auto.samples.clear()
    layers["layers.0.mlp"](torch.randn(2, 8))  # outside recording(): its hooks are gone
    assert auto.samples == {}
    assert not AutoSchedule({}, None).pending  # a rank without MoE layers has nothing to tune


def test_a_layer_that_never_ran_is_named() -> None:
    auto = AutoSchedule({"layers.3.mlp": MoELayer(8, 16, 4, top_k=2)}, None)
    with pytest.raises(InputError, match=r"\['layers\.3\.mlp'\] did not run"):
        auto.tune()


def test_blocks_are_recorded_and_their_overlap_described() -> None:
    """The blocks the tuner may cut into micro-batches record their own input beside
    their MoE layers', must have run before `tune`, and `describe` says what they took."""
    from sparta.parallel.decoder import Block, DecoderConfig

    cfg = DecoderConfig(d_model=8, n_heads=2, d_ff=16)
    block = Block(cfg)
    block.mlp = MoELayer(8, 16, 4, top_k=2)
    auto = AutoSchedule({"layers.0.mlp": block.mlp}, None, blocks={"layers.0": block})
    x = torch.randn(2, 5, 8)
    with auto.recording():
        block(x)
    assert torch.equal(auto.samples["layers.0"], x) and auto.samples["layers.0.mlp"].shape == x.shape
    unrun = AutoSchedule({}, None, blocks={"layers.1": Block(cfg)})
    with pytest.raises(InputError, match=r"\['layers\.1'\] did not run"):
        unrun.tune()
    auto.overlaps = {"layers.0": (2, True), "layers.1": (2, True), "layers.2": (1, False)}
    assert auto.describe() == (
        "co-scheduler tuned: not yet; blocks: whole (1 blocks); 2 micro-batches, deduplicated (2 blocks)"
    )
