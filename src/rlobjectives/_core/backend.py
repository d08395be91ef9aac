"""Which implementation runs a call: the PyTorch paths or the Triton kernels.

Rule (``RLOBJECTIVES_KERNELS``, read and validated at every call, so tests and users can switch
it per call):

- unset or ``auto``: CUDA tensors use the Triton kernels when ``triton`` is importable,
  everything else the PyTorch path;
- ``torch``: always the PyTorch path;
- ``triton``: always the Triton kernels; on CPU tensors they run through Triton's interpreter
  (slow: meant for tests and debugging). Raises when triton is not importable;
- in every mode float64 inputs, code being traced by ``torch.compile`` and devices other than
  CUDA and CPU use PyTorch: the kernels compute in float32, their launchers are not traceable,
  and they run compiled on CUDA or interpreted on CPU only.

Nothing here imports ``triton`` (:func:`triton_available` does, once, on its first call); the
kernels are loaded by :mod:`rlobjectives.kernels.loading` on the first launch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Literal

import torch

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "Backend",
    "kernel_backend",
    "requested_backend",
    "triton_available",
    "use_kernels",
]

ENV_VAR = "RLOBJECTIVES_KERNELS"
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")
Backend = Literal["triton", "torch"]

_KERNEL_DEVICES = ("cuda", "cpu")  # compiled, interpreted; other devices keep PyTorch


def requested_backend() -> str:
    """The validated value of ``RLOBJECTIVES_KERNELS`` (``"auto"`` when unset or empty).

    Raises:
        ValueError: naming the variable, on any value other than auto, triton or torch.
    """
    value = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(
            f"{ENV_VAR} must be one of {', '.join(BACKENDS)} (or unset), "
            f"got {os.environ.get(ENV_VAR)!r}"
        )
    return value


def kernel_backend(device: torch.device | str, *, dtype: torch.dtype | None = None) -> Backend:
    """``"triton"`` or ``"torch"``: the implementation a call on ``device`` should use.

    Args:
        device: the device of the call's tensors.
        dtype: the computation dtype, if known: float64 always uses ``"torch"``.

    Returns:
        ``"triton"`` or ``"torch"`` (see the module docstring for the rule).

    Raises:
        ValueError: on an invalid ``RLOBJECTIVES_KERNELS``.
        RuntimeError: with ``RLOBJECTIVES_KERNELS=triton`` when triton is not importable.
    """
    if torch.compiler.is_compiling():  # the launchers are not traceable
        return "torch"
    choice = requested_backend()
    kind = torch.device(device).type
    if choice == "torch" or dtype == torch.float64 or kind not in _KERNEL_DEVICES:
        return "torch"
    if choice == "triton":
        if not triton_available():
            raise RuntimeError(
                f"{ENV_VAR}=triton but triton is not importable; install it with "
                '`pip install "rlobjectives[kernels]"` or unset the variable'
            )
        return "triton"
    return "triton" if kind == "cuda" and triton_available() else "torch"


@contextlib.contextmanager
def use_kernels(backend: str) -> Iterator[None]:
    """Set ``RLOBJECTIVES_KERNELS`` to ``backend`` inside the block, restore it afterwards.

    Meant for tests (parametrising a suite over the backends) and benchmarks.

    Raises:
        ValueError: if ``backend`` is not auto, triton or torch.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    previous = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = backend
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = previous


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` succeeds (cached; imports triton on the first call only).

    Returns:
        True when the ``triton`` package is installed and importable.
    """
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install (missing driver libraries, ABI mismatch)
        return False
    return True
