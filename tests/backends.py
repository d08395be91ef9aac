"""Backend parametrisation: run a test once on the PyTorch path and once on the Triton kernels.

The Triton kernels run through Triton's interpreter on CPU tensors (``RLOBJECTIVES_KERNELS=triton``;
see ``rlobjectives.kernels.loading``). ``tests/conftest.py`` loads this module as a plugin, so
every test module can take the ``backend`` fixture::

    from backends import dtype_for

    def test_something(backend: str) -> None:  # RLOBJECTIVES_KERNELS=torch, then =triton
        batch = make_batch(..., dtype=dtype_for(backend))
        ...

float64 inputs always take the PyTorch path (the kernels compute in float32), so a test that
runs in float64 on PyTorch runs in float32 on the kernels (:func:`dtype_for`), compared with
the same float64 references at the float32 tolerance of ``tests/tolerances.py``.

Under the interpreter every program runs in Python/numpy (about 15 ms a launch), so:

- keep shapes small;
- a hypothesis property test runs :data:`TRITON_EXAMPLES` examples on the ``triton`` backend
  (its own count on ``torch``), or the count of a ``@pytest.mark.triton_examples(n)`` marker;
  property tests taking the fixture need
  ``@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])`` (the fixture sets
  the environment once for all examples, which is what these tests want).

The ``triton`` case is skipped when triton is not importable (CI installs it: test extra).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

import reference
from rlobjectives._core.backend import triton_available, use_backend

__all__ = [
    "BACKEND_PARAMS",
    "KERNEL_SURROGATES",
    "FIXTURE_HEALTH",
    "TRITON",
    "TRITON_EXAMPLES",
    "backend",
    "dtype_for",
    "on_kernels",
    "requires_triton",
    "triton_param",
]

TRITON = triton_available()
requires_triton = pytest.mark.skipif(not TRITON, reason="triton is not installed")
TRITON_EXAMPLES = 6
# Property tests that take the ``backend`` fixture (see the module docstring).
FIXTURE_HEALTH = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


# The surrogates the kernels compute; "gmpo", "vespo", "m2po", "clip_cov" and "kl_cov" rows
# take the PyTorch path on both.
KERNEL_SURROGATES = ("clip", "cispo", "sapo", "dppo", "dro")


def on_kernels(options: dict[str, Any]) -> bool:
    """Whether a row of keyword arguments runs on the kernels (a token-level surrogate)."""
    return reference.surrogate_name(options.get("surrogate", "clip")) in KERNEL_SURROGATES


def triton_param(*values: Any, id: str | None = None) -> Any:  # noqa: A002
    """A ``pytest.param`` of the ``triton`` backend (skipped without triton, marked kernels)."""
    return pytest.param("triton", *values, id=id, marks=[requires_triton, pytest.mark.kernels])


# ``-m kernels`` selects the interpreter cases (``-m "not kernels"`` skips them).
BACKEND_PARAMS = ["torch", triton_param()]


def dtype_for(backend: str, dtype: torch.dtype = torch.float64) -> torch.dtype:
    """The dtype a test runs at: ``dtype`` on PyTorch; float32 for float64 on the kernels."""
    return torch.float32 if backend == "triton" and dtype == torch.float64 else dtype


@contextlib.contextmanager
def _fewer_examples(request: pytest.FixtureRequest) -> Iterator[None]:
    """Lower a hypothesis test's ``max_examples`` for this call (restored afterwards).

    Hypothesis reads a test's settings when it is called, from the attribute its ``@settings``
    decorator sets; a test without it (or another hypothesis) is left as it is.
    """
    function = getattr(request, "function", None)
    current = getattr(function, "_hypothesis_internal_use_settings", None)
    if current is None:
        yield
        return
    marker = request.node.get_closest_marker("triton_examples")
    examples = TRITON_EXAMPLES if marker is None else int(marker.args[0])
    function._hypothesis_internal_use_settings = settings(  # type: ignore[union-attr]
        current, max_examples=min(examples, current.max_examples)
    )
    try:
        yield
    finally:
        function._hypothesis_internal_use_settings = current  # type: ignore[union-attr]


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """The backend name, with ``RLOBJECTIVES_KERNELS`` set to it for the test's duration."""
    with use_backend(request.param):
        if request.param == "triton":
            with _fewer_examples(request):
                yield request.param
        else:
            yield request.param
