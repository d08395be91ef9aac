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


#: Folders whose every test runs a whole program: the peers' real training steps and verl's own
#: test suite (tests/integrations/).
SLOW_FOLDERS = ("integrations",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``slow`` on the multi-process and whole-run tests (``-m "not slow"``: the quick check).

    Every ``distributed`` test (spawned gloo ranks, torchrun) and every test of
    :data:`SLOW_FOLDERS` is ``slow``; the demo's whole runs carry the marker themselves.
    """
    for item in items:
        if "distributed" in item.keywords or item.path.parent.name in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)
