"""The overlapped MoE block over real engines: micro-batched exchanges against the plain
block, and the block tuner's agreement across ranks. Run by `moe_checks.py`."""

from __future__ import annotations

import torch
from moe_cases import CASES, D_FF, D_MODEL, EXPERTS, SEQ, TOL
from runner import raises
from torch import nn

from sparta.comm import HierarchicalAllToAll, World
from sparta.errors import ConfigError
from sparta.moe import MoELayer, overlapped_moe_block


def check_overlapped_block_equals_the_plain_block(world: World) -> None:
    """A block (a dense layer, then the MoE layer) over 1, 2 and 3 micro-batches
    (`overlapped_moe_block`) gives the plain block's outputs, input and parameter gradients,
    aux loss (the balance term over the whole batch, weighted heavily here), counts and
    router state, for every dropless token-choice router, flat, two-level and node-
    deduplicated; a layer that cannot overlap raises ConfigError before any collective."""
    # (the layer's exchange, the node-deduplicating one): flat; then, posed as 2 nodes x 2
    # ranks, two-level, deduplicated, and both; at 2 ranks, deduplicated over 2 nodes of 1
    exchanges: list[tuple[HierarchicalAllToAll | None, HierarchicalAllToAll | None]] = [(None, None)]
    if world.size == 4:
        intra = world.comm.split_groups([[0, 1], [2, 3]])
        inter = world.comm.split_groups([[0, 2], [1, 3]])
        hier = HierarchicalAllToAll(world.comm, intra, inter)
        exchanges += [(hier, None), (None, hier), (hier, hier)]
    else:
        alone = world.comm.split_groups([[r] for r in range(world.size)])
        exchanges.append((None, HierarchicalAllToAll(world.comm, alone, world.comm)))  # type: ignore[arg-type]
    dropless = [c for c in CASES if c["capacity_factor"] is None and c["router"] not in ("expert_choice", "soft")]
    for case in dropless:
        for exchange, dedup in exchanges:
            torch.manual_seed(0)
            layer = MoELayer(
                D_MODEL, D_FF, EXPERTS, ep_size=world.size, comm=world.comm, aux_loss_coef=1.0, z_loss_coef=0.1, **case
            )
            layer.set_exchange(exchange)  # type: ignore[arg-type]
            dense = nn.Sequential(nn.Linear(D_MODEL, D_MODEL), nn.LayerNorm(D_MODEL))
            params = [*dense.parameters(), *layer.parameters()]

            def attend(piece: torch.Tensor, dense: nn.Module = dense) -> tuple[torch.Tensor, torch.Tensor]:
                h = piece + dense(piece)
                return h, h.tanh()

            gen = torch.Generator().manual_seed(world.rank)
            x = torch.randn(5 + world.rank % 2, SEQ, D_MODEL, generator=gen)
            up = torch.randn(x.shape, generator=gen)
            runs = []
            router_state = {k: v.clone() for k, v in layer.router.state_dict().items()}
            for m in (None, 1, 2, 3):  # None: the plain block
                layer.router.load_state_dict(router_state)  # the sigmoid router's bias moves each forward
                for p in params:
                    p.grad = None
                leaf = x.clone().requires_grad_()
                if m is None:
                    h, moe_in = attend(leaf)
                    y = h + layer(moe_in)
                else:
                    y = overlapped_moe_block(layer, leaf, m, attend, params, dedup=dedup)
                y.backward(up)
                stats = layer.last_stats
                assert stats is not None
                moved = [v.clone() for v in layer.router.state_dict().values()]
                runs.append((y.detach(), leaf.grad, [p.grad.clone() for p in params], layer.aux_loss, stats, moved))
            y1, g1, p1, aux1, stats1, moved1 = runs[0]
            for m, (y, g, ps, aux, stats, moved) in zip((1, 2, 3), runs[1:], strict=True):
                form = ("two-level" if exchange else "flat") + (", deduplicated" if dedup else "")
                where = f"{case['router']}, {form}, {m} micro-batches"
                torch.testing.assert_close(y, y1, **TOL, msg=lambda s, w=where: f"{w}: output: {s}")
                torch.testing.assert_close(g, g1, **TOL, msg=lambda s, w=where: f"{w}: input gradient: {s}")
                for p, a, b in zip(params, ps, p1, strict=True):
                    name = next(n for n, q in [*dense.named_parameters(), *layer.named_parameters()] if q is p)
                    torch.testing.assert_close(a, b, **TOL, msg=lambda s, w=where, n=name: f"{w}: {n}.grad: {s}")
                torch.testing.assert_close(aux, aux1, **TOL, msg=lambda s, w=where: f"{w}: aux_loss: {s}")
                assert stats == stats1, (where, stats, stats1)
                for a, b in zip(moved, moved1, strict=True):  # the load the router balances by: the batch's
                    torch.testing.assert_close(a, b, **TOL, msg=lambda s, w=where: f"{w}: router state: {s}")
    torch.manual_seed(0)
    for options, why in (
        ({"ep_size": world.size, "comm": world.comm, **CASES[1]}, "capacity_factor=1.25 would drop pairs"),
        ({"ep_size": world.size, "comm": world.comm, **CASES[-2]}, "router 'expert_choice' chooses across"),
        ({}, "not expert-parallel"),
    ):
        layer = MoELayer(D_MODEL, D_FF, EXPERTS, **options)
        with raises(ConfigError, why):
            overlapped_moe_block(layer, torch.randn(4, SEQ, D_MODEL), 2, lambda t: (t, t), [])


def check_block_tuning_agrees_on_candidates_when_ranks_hold_other_shapes(world: World) -> None:
    """The block tuner (pipeline_degree="auto") tries micro-batch counts up to the fewest
    sequences any rank of the group recorded: under documents the ranks' batches differ (4
    sequences on rank 0, 1 elsewhere), and a rank trying 2 and 4 micro-batches where another
    tries 1 would pair their exchanges wrongly. Then the block in 2 micro-batches on every
    rank, equal to the whole block."""
    from sparta.parallel.auto_schedule import _tune_overlap
    from sparta.parallel.decoder import Block, DecoderConfig

    cfg = DecoderConfig(vocab_size=32, seq_len=SEQ, d_model=D_MODEL, n_layers=1, n_heads=2, d_ff=D_FF)
    torch.manual_seed(0)
    block = Block(cfg)
    block.mlp = MoELayer(D_MODEL, D_FF, EXPERTS, ep_size=world.size, comm=world.comm)
    sample = torch.randn(4 if world.rank == 0 else 1, SEQ, D_MODEL)
    chosen, seconds = _tune_overlap(block, sample, trials=1, dedup=None)
    assert chosen == (1, False) and sorted(seconds) == [(1, False)], (chosen, seconds)
    # a block set to 2 micro-batches runs them on every rank, an empty one where a rank holds
    # one sequence (it had run whole there, and its exchanges paired with the others' wrongly)
    got = []
    for overlap in (2, 1):
        block.set_overlap(overlap)
        block.zero_grad()
        x = sample.clone().requires_grad_()
        y = block(x)
        y.square().sum().backward()
        got.append([y.detach(), x.grad, *(p.grad for p in block.parameters())])
    for a, b in zip(*got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
