"""The simulated timeline's network gaps and the gradient pieces that fill them."""

from __future__ import annotations

import pytest

from sparta.errors import ConfigError
from sparta.scheduling.chunks import PipelineDegrees
from sparta.scheduling.cost_model import CostModel, LayerShape
from sparta.scheduling.partition import bucketed_exposed_s, partition_gradients
from sparta.scheduling.profiler import LinearFit, Profile
from sparta.scheduling.timeline import timeline

AR = LinearFit.fit([(1e5, 1e-3 + 1e-8 * 1e5), (1e7, 1e-3 + 1e-8 * 1e7)])  # 1 ms + 100 MB/s


def test_timeline_of_one_chunk() -> None:
    t = timeline(comm_s=[2.0], compute_s=[3.0])
    assert t.network == ((0.0, 2.0), (5.0, 7.0)) and t.compute == ((2.0, 5.0),) and t.end_s == 7.0
    assert t.idle_network() == ((2.0, 5.0),)


def test_pipelined_timeline_keeps_network_fifo_and_compute_serial() -> None:
    t = timeline(comm_s=[1.0] * 4, compute_s=[1.5] * 4)
    assert all(a[1] <= b[0] + 1e-12 for a, b in zip(t.network, sorted(t.network)[1:], strict=False))
    assert all(a[1] <= b[0] + 1e-12 for a, b in zip(t.compute, t.compute[1:], strict=False))
    busy = sum(e - b for b, e in t.network) + sum(e - b for b, e in t.idle_network())
    assert busy == pytest.approx(t.end_s)


def test_pieces_fill_gaps_that_fit_and_the_rest_is_exposed() -> None:
    part = partition_gradients(2_000_000, [0.011, 0.0005, 0.101], AR)
    assert part.gaps == (0, 2) and part.exposed_s == 0.0 and sum(part.pieces) == 2_000_000
    assert part.pieces[0] == pytest.approx(1_000_000, abs=2)  # (11 ms - 1 ms) at 100 MB/s
    big = partition_gradients(50_000_000, [0.011, 0.101], AR)
    assert big.gaps == (0, 1, -1) and sum(big.pieces) == 50_000_000
    assert big.exposed_s == pytest.approx(AR(39_000_000), rel=1e-6)
    assert big.exposed_s < bucketed_exposed_s(50_000_000, AR)
    whole = partition_gradients(2_000_000, [0.0110001, 0.101], AR, element_bytes=4)
    assert all(n % 4 == 0 for n in whole.pieces) and sum(whole.pieces) == 2_000_000
    with pytest.raises(ConfigError, match="element_bytes = 4; .* a multiple of element_bytes"):
        partition_gradients(6, [1.0], AR, element_bytes=4)
    with pytest.raises(ConfigError, match="gaps_s"):
        partition_gradients(1, [-1.0], AR)
    # a flat fit (a noisy one's negative slope clamped to 0): a gap shorter than the call holds none
    flat = LinearFit(1e-3, 0.0, 0.0, ())
    short = partition_gradients(10_000_000, [1e-6, 1e-6], flat, element_bytes=4)
    assert short.gaps == (-1,) and short.exposed_s == pytest.approx(1e-3)
    assert partition_gradients(10_000_000, [2e-3], flat, element_bytes=4).gaps == (0,)


def test_gaps_of_a_planned_backward() -> None:
    line = {k: LinearFit(1e-4, b, 0.0, ()) for k, b in (("all_to_all/world", 8e-9), ("all_reduce/world", 1e-8))}
    rows = {
        "expert_fwd/512x1024": LinearFit(0.0, 1.6e-5, 0.0, ()),
        "expert_bwd/512x1024": LinearFit(0.0, 3.2e-5, 0.0, ()),
    }
    model = CostModel(Profile({**line, **rows}))
    shape = LayerShape(tokens=4096, top_k=2, d_model=512, d_ff=1024, ep_size=4)
    gaps = model.backward_timeline(shape, PipelineDegrees(4, 4), hierarchical=False).idle_network()
    assert gaps and all(e > b for b, e in gaps)
    part = partition_gradients(8 * 2**20, [e - b for b, e in gaps], model.profile.fit("all_reduce", "world"))
    assert part.exposed_s < bucketed_exposed_s(8 * 2**20, model.profile.fit("all_reduce", "world"))
