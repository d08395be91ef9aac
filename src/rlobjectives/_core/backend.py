"""Which implementation of the LM head runs a call: PyTorch's chunk loop or the Triton kernels.

The choice concerns the functions with a Triton LM head
(:func:`rlobjectives.token_log_probs_from_hidden`,
:func:`rlobjectives.fused_policy_loss_from_hidden`); every other function has one
implementation. It is made explicitly, by :func:`use_backend` (a context manager, innermost
wins) or else by ``RLOBJECTIVES_KERNELS`` (the documented default; both validated on every call):

- ``auto`` (unset): the Triton kernels for CUDA tensors when ``triton`` imports and the call is
  one they take (float32/bfloat16/float16, no kept set, not being traced by ``torch.compile``),
  else PyTorch;
- ``torch``: always PyTorch;
- ``triton``: always the kernels (on CPU tensors through Triton's interpreter: slow, for tests).
  A call they cannot take raises a ``ValueError`` saying why (float64, a kept set, another
  device, code being traced by ``torch.compile``: there only a :func:`use_backend` block is
  read, not the environment), and a missing ``triton`` a ``RuntimeError``: an explicit request
  is never dropped silently.

Nothing here imports ``triton`` (:func:`triton_available` does, once, on its first call).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from typing import Literal

import torch

from .validation import BACKENDS, KERNELS_VARIABLE, checks_environment, requested_backend

__all__ = ["Backend", "lm_head_backend", "triton_available", "use_backend"]

Backend = Literal["triton", "torch"]

#: The choices of the open :func:`use_backend` blocks, innermost last (a plain list:
#: ``torch.compile`` reads it while it traces, which a ``ContextVar`` would forbid).
_CHOSEN: list[str] = []


class _BackendChoice:
    """The context manager :func:`use_backend` returns (sets and restores the choice)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def __enter__(self) -> None:
        _CHOSEN.append(self.backend)

    def __exit__(self, *exc: object) -> None:
        _CHOSEN.pop()


@checks_environment
def use_backend(backend: str) -> contextlib.AbstractContextManager[None]:
    """Run the LM-head functions on ``backend`` inside a ``with`` block.

    Overrides ``RLOBJECTIVES_KERNELS`` for the block (nested blocks: the innermost wins; the
    previous choice is restored on exit, also on an exception).

    Args:
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see the module docstring).

    Returns:
        A context manager; inside it the LM-head functions run their ``(B, T, H)`` hidden
        states (packed ``(N, H)``) on ``backend``.

    Raises:
        ValueError: for any other value (when called, before the block).

    Examples:
        >>> import torch, rlobjectives as rlo
        >>> with rlo.use_backend("torch"):
        ...     rlo.token_log_probs_from_hidden(torch.zeros(1, 1, 2), torch.zeros(2, 2),
        ...                                     torch.tensor([[1]]))
        tensor([[-0.6931]])
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return _BackendChoice(backend)


def chosen_backend() -> str:
    """The validated choice: the innermost :func:`use_backend`, else ``RLOBJECTIVES_KERNELS``."""
    return _CHOSEN[-1] if _CHOSEN else requested_backend()


def lm_head_backend(
    device: torch.device | str,
    *,
    dtype: torch.dtype,
    kept_set: bool = False,
    unsupported: str | None = None,
) -> Backend:
    """``"triton"`` or ``"torch"`` for an LM-head call on ``device`` computing in ``dtype``.

    ``kept_set``: the call has a kept set; ``unsupported``: another reason the kernels cannot
    take the call (a sentence naming the option), or None.

    Raises:
        ValueError: an explicit ``triton`` for a call the kernels cannot take (naming why), or
            an invalid ``RLOBJECTIVES_KERNELS``.
        RuntimeError: an explicit ``triton`` without an importable ``triton``.
    """
    if torch.compiler.is_compiling():  # the environment is not read while tracing
        choice = _CHOSEN[-1] if _CHOSEN else "auto"
    else:
        choice = chosen_backend()
    if choice == "torch":
        return "torch"
    kind = torch.device(device).type
    reason = None
    if torch.compiler.is_compiling():
        reason = "the call is being traced by torch.compile (the launchers are not traceable)"
    elif dtype == torch.float64:
        reason = "the kernels compute in float32 and the inputs are float64"
    elif kept_set:
        reason = "the kernels take no kept set (kept_ids, kept_mask, top_k, top_p, min_p)"
    elif unsupported is not None:
        reason = unsupported
    elif kind not in ("cuda", "cpu"):
        reason = f"the kernels run on CUDA (compiled) or CPU (interpreted), not {kind!r}"
    if choice == "auto":
        return "triton" if reason is None and kind == "cuda" and triton_available() else "torch"
    if reason is not None:
        raise ValueError(
            f"the Triton backend was requested (use_backend('triton') or {KERNELS_VARIABLE}="
            f"triton) but {reason}; use the 'torch' or 'auto' backend for this call"
        )
    if not triton_available():
        raise RuntimeError(
            f"the Triton backend was requested (use_backend('triton') or {KERNELS_VARIABLE}="
            "triton) but triton is not importable; install it with `pip install "
            '"rlobjectives[kernels]"` or choose the torch backend'
        )
    return "triton"


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
