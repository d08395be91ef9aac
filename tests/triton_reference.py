"""Float64 reference of the Triton LM-head kernels' contract (plain autograd, flat rows).

Written from the math in ``rlobjectives.kernels`` docstrings; nothing here imports the kernels.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
F64 = torch.float64


def _where(mask: Tensor, values: Tensor) -> Tensor:
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype))


def head_log_probs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    mask: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Float64 ``(log_probs, entropy)`` via ``log_softmax`` (leaves may require grad).

    Masked rows are zeroed before the product (so NaN there reaches nothing); the entropy uses
    ``xlogy``-style ``p log p = 0`` at ``p = 0``.
    """
    h = _where(mask[:, None], hidden.to(F64))
    logits = h @ weight.to(F64).T
    if bias is not None:
        logits = logits + bias.to(F64)
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    p = log_p.exp()
    finite_log_p = torch.where(p > 0, log_p, torch.zeros((), dtype=F64))  # no 0 * -inf
    entropy = -(p * finite_log_p).sum(-1)
    safe_tokens = torch.where(mask, tokens, 0)
    chosen = log_p.gather(1, safe_tokens[:, None])[:, 0]
    return _where(mask, chosen), _where(mask, entropy)
