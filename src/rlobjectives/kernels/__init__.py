"""Optional Triton backend: fused kernels for the token losses and the hidden-state path.

Nothing here is imported by ``import rlobjectives``, and nothing here imports ``triton`` at
module import time: :func:`triton_available` checks lazily, and the kernels are loaded by
:func:`rlobjectives.kernels.loading.kernels` on the first launch. Install with
``pip install "rlobjectives[kernels]"``.

Modules (launchers take plain tensors in the flat token layout, see each docstring):

- :mod:`._dispatch`: ``kernel_backend(device)``, the ``RLOBJECTIVES_KERNELS`` override, loading
  the kernels compiled (CUDA) or through Triton's interpreter (CPU).
- :mod:`._token_loss`: the token-level policy loss (every token-level surrogate, importance
  weights, KL and entropy terms): forward launcher and autograd function.
- :mod:`._kl`: ``kl_loss`` and ``kl_penalized_rewards``.
- :mod:`._lm_head_forward` / :mod:`._lm_head_backward`: log-probabilities and entropy from
  hidden states and the LM head without materialising logits, and their gradients.
- :mod:`._from_hidden`: autograd functions of the hidden-state path (log-probs, fused loss).
"""

from __future__ import annotations

import functools
import importlib.util

__all__ = ["triton_available"]


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
