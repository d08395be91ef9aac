from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

# The ``backend`` fixture (PyTorch / Triton kernels parametrisation) for every test module.
pytest_plugins = ("backends",)

# Bounded, deadline-free property tests: these CPUs are slow and noisy.
settings.register_profile("default", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
