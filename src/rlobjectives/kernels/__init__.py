"""Optional Triton backend: the LM head's log-probabilities and entropy without the logits.

The one place where a compiler cannot do the job: from hidden states ``(N, H)`` and the head's
weight ``(V, H)`` the kernels form each logits tile in registers and fold it into an online
log-sum-exp, so no ``(N, V)`` tensor is ever written (Cut Cross-Entropy's scheme). Everything
else in the library is written once in PyTorch and compiled by ``torch.compile``.

This package imports ``torch`` and :mod:`rlobjectives._core` only; nothing here imports
``triton`` at module import time (the kernels are loaded by :func:`.loading.kernels` on the
first launch), and ``import rlobjectives`` imports none of it. The autograd Function that
uses the launchers lives in :mod:`rlobjectives.logprobs.triton_head`. Install with
``pip install "rlobjectives[kernels]"``.

Modules:

- :mod:`.head_forward` / :mod:`.head_backward`: the launchers (log-probabilities, entropy,
  ``lse``; a vocabulary slice's statistics; the recomputing backward);
- :mod:`.loading`: the kernels compiled (CUDA) or through Triton's interpreter (CPU);
  :mod:`.interpreter`: the interpreter's adaptation, imported for interpreted launches only;
- :mod:`.common`: launch helpers; :mod:`.jit`: the ``@triton.jit`` code.
"""
