"""Shared setup of the MoE tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_single_thread() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
