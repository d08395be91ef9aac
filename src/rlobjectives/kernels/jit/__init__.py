"""Triton kernels (``@triton.jit`` code only; the launchers live in ``rlobjectives.kernels``).

This package is never imported by ``import rlobjectives``. :mod:`rlobjectives.kernels.loading`
loads it on demand, once per execution mode: under its own name for compiled kernels (CUDA), and
a second time under the alias ``rlobjectives.kernels._interpreted_jit`` with
``TRITON_INTERPRET=1`` for Triton's interpreter (CPU tensors). Triton decides between the two
when ``@triton.jit`` decorates a function (it reads ``TRITON_INTERPRET`` at decoration time, not
at ``import triton`` nor at launch), so each mode needs its own module objects; the submodules
use relative imports only, which resolve inside whichever alias is being loaded.
"""

from . import lm_head

__all__ = ["lm_head"]
