"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def deterministic():
    """Deterministic kernels for one test: inductor's CPU kernels otherwise accumulate in parallel, so
    two equal compiled runs could differ in the last bit."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)
