"""Fixtures shared by the test modules."""

from __future__ import annotations

import os

import pytest
import torch

from sonar_fx.optim.saving import ON_SAVING_LOST_ENV


@pytest.fixture
def deterministic():
    """Deterministic kernels for one test: inductor's CPU kernels otherwise accumulate in parallel, so
    two equal compiled runs could differ in the last bit."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


# The saving guard raises in the whole suite (and in the CLI and worker processes tests start, which
# inherit the environment): a compiled graph that quietly leaves expert gradients to the hooks fails the
# test that compiled it. Tests of that path pass on_saving_lost="warn".
os.environ[ON_SAVING_LOST_ENV] = "raise"
