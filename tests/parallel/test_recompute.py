"""Stage-aware activation recomputation (ParallelConfig.recompute) in one process: a
recomputed block keeps its parameter names, its gradients and losses (the MoE aux loss
counted once), and saves only its input in forward; bad values are refused by name. The
multi-rank parity under TP, MoE, FSDP2, DDP and zero-bubble schedules is in
tests/dist/parallel_checks.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import sparta
from sparta.errors import ConfigError
from sparta.parallel import (
    Decoder,
    DecoderConfig,
    MoESpec,
    ParallelConfig,
    ParallelDims,
    build_layout,
    moe_layers,
    parallelize,
)
from sparta.parallel.config_file import load_config
from sparta.parallel.parallelize import recompute_layers

CFG = DecoderConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=4, n_heads=4, d_ff=32)
MOE = MoESpec(num_experts=4, top_k=2, aux_loss_coef=1e-2)


def _saved_bytes(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The loss of ``model`` on ``ids`` and the bytes its forward saved for backward,
    (inside the layers.* blocks, outside them), as autograd's saved-tensor hooks see them."""
    inside, counts = [False], [0, 0]
    hooks = []
    for block in model.layers.values():  # type: ignore[union-attr, operator]
        hooks.append(block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)))
        hooks.append(block.register_forward_hook(lambda *_: inside.__setitem__(0, False)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        counts[0 if inside[0] else 1] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    for hook in hooks:
        hook.remove()
    return loss, counts[0], counts[1]


def test_a_recomputed_block_keeps_names_and_gradients_and_saves_only_its_input() -> None:
    torch.manual_seed(0)
    plain = Decoder(CFG)
    moe_layers(plain, MOE, None)
    recomputed = copy.deepcopy(plain)
    recompute_layers(recomputed)
    assert list(recomputed.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in recomputed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    ids = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len), generator=torch.Generator().manual_seed(1))
    loss, blocks, rest = _saved_bytes(plain, ids)
    loss_rc, blocks_rc, rest_rc = _saved_bytes(recomputed, ids)
    # each block now keeps its input [4, 8, 16] float32 and nothing else; the rest is unchanged
    assert (blocks_rc, rest_rc) == (CFG.n_layers * 4 * CFG.seq_len * CFG.d_model * 4, rest)
    assert blocks > 10 * blocks_rc, f"the blocks saved {blocks} bytes, recomputed {blocks_rc}"
    loss.backward()
    loss_rc.backward()
    torch.testing.assert_close(loss_rc, loss, rtol=0, atol=0)
    grads = {n: p.grad for n, p in plain.named_parameters()}
    # the routers' gradients carry the MoE aux loss, applied in backward: counted once, as without
    assert any("router" in n for n in grads)
    for name, p in recomputed.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=1e-7, msg=name)


def test_parallelize_recomputes_the_stages_it_is_told_and_trains_alike() -> None:
    world = sparta.init(backend="torch")
    layout = build_layout(ParallelDims(), world)
    ids = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=torch.Generator().manual_seed(2))
    runs = []
    for recompute in ((), (0,)):
        torch.manual_seed(0)
        config = ParallelConfig(microbatches=2, moe=MOE, recompute=recompute)
        pm = parallelize(Decoder(CFG), layout, config)
        try:
            loss = pm.step(ids[:, :-1], ids[:, 1:])
        finally:
            pm.close()
        assert pm.plan.recompute == recompute
        assert ("stage 0 (recomputed):" in str(pm.plan)) == bool(recompute), str(pm.plan)
        runs.append((loss, {n: p.grad for part in pm.parts for n, p in part.named_parameters()}))
    (loss, grads), (loss_rc, grads_rc) = runs
    assert loss_rc == pytest.approx(loss, abs=1e-6) and list(grads_rc) == list(grads)
    for name, grad in grads_rc.items():
        torch.testing.assert_close(grad, grads[name], rtol=0, atol=1e-7, msg=name)


def test_bad_recompute_values_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"recompute=\[0, 0\] names a stage twice"):
        ParallelConfig(recompute=(0, 0))
    with pytest.raises(ConfigError, match=r"holds -1: stage indices are integers >= 0"):
        ParallelConfig(recompute=(-1,))
    with pytest.raises(ConfigError, match="must be a list of stage indices"):
        ParallelConfig(recompute=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"names stage 2, but the pipeline has 2 stage\(s\).*0\.\.1"):
        ParallelConfig(microbatches=2, recompute=(0, 2)).check(ParallelDims(pp=2))
    with pytest.raises(ConfigError, match="router='sigmoid'"):
        ParallelConfig(moe=MoESpec(router="sigmoid"), recompute=(0,)).check(ParallelDims())
    assert ParallelConfig(recompute=[1, 0]).recompute == (0, 1)  # type: ignore[arg-type]


def test_the_run_file_takes_recompute() -> None:
    base = ["data.source='random'", "parallel.pp=2", "parallel.microbatches=2"]
    assert load_config(None, [*base, "parallel.recompute=[1]"]).parallel.recompute == (1,)
    with pytest.raises(ConfigError, match=r"--set: recompute=\[2\] names stage 2.*use indices 0\.\.1"):
        load_config(None, [*base, "parallel.recompute=[2]"])
    with pytest.raises(ConfigError, match=r"parallel\.recompute\[0\]='a' must be an integer"):
        load_config(None, [*base, "parallel.recompute=['a']"])
