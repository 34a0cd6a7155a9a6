"""Bad configurations and inputs raise Sparta errors that name the value and the fix."""

from __future__ import annotations

import pytest
import torch

from sparta.errors import ConfigError, InputError, SpartaError
from sparta.moe import MoEConfig, MoELayer


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_experts": 6, "ep_size": 4}, r"num_experts=6 is not divisible by ep_size=4"),
        ({"num_experts": 4, "top_k": 5}, r"top_k=5 exceeds num_experts=4: use top_k <= 4"),
        ({"top_k": 0}, r"top_k=0 is invalid: route each token to at least 1 expert"),
        ({"capacity_factor": 0.0}, r"capacity_factor=0.0 is invalid: use a finite number > 0.*or None"),
        ({"capacity_factor": float("inf")}, r"capacity_factor=inf is invalid"),
        ({"capacity_factor": -1.5}, r"capacity_factor=-1.5 is invalid"),
        (
            {"router": "hash"},
            r"router='hash' is unknown: choose one of topk, switch, sigmoid, xmoe, expert_choice, soft",
        ),
        ({"activation": "tanh"}, r"activation='tanh' is unknown: choose one of gelu, gelu_tanh, relu, silu, swiglu"),
        ({"router": "switch", "top_k": 2}, r"router='switch'.*top_k=2: set top_k=1"),
        ({"router": "soft", "capacity_factor": 1.0}, r"router='soft' never drops tokens.*capacity_factor=None"),
        ({"d_model": 0}, r"d_model=0 is invalid: it must be an integer >= 1"),
        ({"aux_loss_coef": -0.1}, r"aux_loss_coef=-0.1 is invalid: it must be a number >= 0"),
        ({"pipeline_degree": 0}, r"pipeline_degree=0 is invalid: use an int >= 1 \(1 = no pipelining\)"),
        ({"pipeline_degree": (2, 0)}, r"pipeline_degree=\(2, 0\) is invalid.*\(forward, backward\) pair"),
        ({"pipeline_degree": "fast"}, r"pipeline_degree='fast' is invalid.*tune_schedule"),
        ({"pipeline_degree": (4, 4, 5)}, r"pipeline_degree=\(4, 4, 5\) is invalid.*taper in \[0, 3\]"),
    ],
)
def test_bad_config(kwargs: dict[str, object], pattern: str) -> None:
    values: dict[str, object] = {"d_model": 8, "d_ff": 16, "num_experts": 4, **kwargs}
    with pytest.raises(ConfigError, match=pattern):
        MoEConfig(**values)
    with pytest.raises(ConfigError, match=pattern):
        MoELayer(**values)


def test_unknown_option_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown options \['jitter'\]: pass a MoEConfig, or its fields .*jitter"):
        MoELayer(8, 16, 4, jitter=0.1)


def test_expert_parallel_needs_matching_comm() -> None:
    with pytest.raises(ConfigError, match=r"ep_size=2 needs a Communicator of size 2, got no comm"):
        MoELayer(8, 16, 4, ep_size=2)


def test_wrong_last_dim() -> None:
    layer = MoELayer(8, 16, 4)
    with pytest.raises(InputError, match=r"'moe' expects \[\.\.\., d_model=8\] input, got shape \(2, 3, 7\)"):
        layer(torch.randn(2, 3, 7))


def test_integer_input() -> None:
    with pytest.raises(InputError, match=r"got torch.int64 input: pass floating-point"):
        MoELayer(8, 16, 4)(torch.ones(3, 8, dtype=torch.int64))


def test_errors_are_sparta_errors() -> None:
    assert issubclass(InputError, SpartaError) and issubclass(ConfigError, SpartaError)


def test_config_given_whole_or_by_fields() -> None:
    config = MoEConfig(8, 16, 4, top_k=1)
    assert MoELayer(config).config is config
    assert MoELayer(8, 16, 4, top_k=1).config == config
    with pytest.raises(ConfigError, match=r"multiple values for argument 'd_model'"):
        MoELayer(8, 16, 4, d_model=8)
