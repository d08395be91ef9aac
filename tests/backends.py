"""Backend parametrisation: run a test once on the PyTorch path and once on the Triton kernels.

The Triton kernels run through Triton's interpreter on CPU tensors (``RLOBJECTIVES_KERNELS=triton``;
see ``rlobjectives._triton._dispatch``). To parametrise an existing suite over the backends::

    from backends import backend  # noqa: F401  (pytest fixture)

    def test_something(backend):  # runs with RLOBJECTIVES_KERNELS=torch, then =triton
        ...

The ``triton`` case is skipped when triton is not importable. Keep shapes small under the
interpreter (it executes every program in Python/numpy).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rlobjectives._triton import triton_available
from rlobjectives._triton._dispatch import use_kernels

TRITON = triton_available()
requires_triton = pytest.mark.skipif(not TRITON, reason="triton is not installed")
BACKEND_PARAMS = ["torch", pytest.param("triton", marks=requires_triton)]


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """The backend name, with ``RLOBJECTIVES_KERNELS`` set to it for the test's duration."""
    with use_kernels(request.param):
        yield request.param
