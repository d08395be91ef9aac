"""Optional Triton backend: fused kernels for the token losses and the hidden-state path.

Nothing here is imported by ``import rlobjectives``, and nothing here imports ``triton`` at
module import time; which backend a call uses is decided by
:func:`rlobjectives._core.backend.kernel_backend`, and the kernels are loaded by
:func:`rlobjectives.kernels.loading.kernels` on the first launch. Install with
``pip install "rlobjectives[kernels]"``.

Modules (launchers take plain tensors in the flat token layout, see each docstring):

- :mod:`.loading`: loading the kernels compiled (CUDA) or through Triton's interpreter (CPU);
  :mod:`.interpreter`: the interpreter's adaptation, imported for interpreted launches only.
- :mod:`.token_loss`: the token-level policy loss (every token-level surrogate, importance
  weights, KL and entropy terms): forward launcher and autograd function.
- :mod:`.kl`: ``kl_loss`` and ``kl_penalized_rewards``.
- :mod:`.head_forward` / :mod:`.head_backward`: log-probabilities and entropy from hidden states
  and the LM head without materialising logits, and their gradients.
- :mod:`.from_hidden`: autograd functions of the hidden-state path (log-probs, fused loss).
- :mod:`.calls`: the public functions' wiring onto the launchers.
- :mod:`.jit`: the ``@triton.jit`` code.
"""
