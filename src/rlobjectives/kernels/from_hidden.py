r"""Autograd functions of the hidden-state path on the Triton kernels.

- :class:`LogProbsFromHiddenFunction`: :math:`\ell` (and :math:`H`) of the sampled tokens from
  ``hidden @ weight.T (+ bias)`` / :math:`\tau`; forward saves only ``lse`` (and :math:`H`),
  backward recomputes the logits (:mod:`._lm_head_backward`).
- :class:`FusedPolicyLossFromHiddenFunction`: the same forward, then the token-loss kernel on the
  log-probabilities (its coefficient :math:`c = w\,\partial L / \partial \ell` becomes the
  log-probabilities' gradient :math:`g_\ell = c \cdot g`, and the entropy bonus gives
  :math:`g_H = -c_H w g`), then the recomputing backward. No ``(N, V)`` tensor is formed.

Rows are flat: ``hidden`` is ``(N, H)``, every per-token tensor ``(N,)``.
"""

from __future__ import annotations

from typing import Any

import torch

from .common import first_order_only
from .head_backward import lm_head_backward
from .head_forward import LMHeadForward, lm_head_forward, lm_head_slice_forward
from .token_loss import TokenLossOptions, scale_by_mask, token_loss_forward

__all__ = ["FusedPolicyLossFromHiddenFunction", "LogProbsFromHiddenFunction"]


def _slice_tokens(tokens: torch.Tensor, head_kwargs: dict[str, Any]) -> torch.Tensor:
    """The ids the kernels read: local, -1 off this rank's slice (``shard`` in the kwargs)."""
    shard = head_kwargs.get("shard")
    if shard is None:
        return tokens
    local, owned = shard.local_ids(tokens)
    return torch.where(owned, local, -1)


def _head_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    kwargs: dict[str, Any],
) -> LMHeadForward:
    """:func:`lm_head_forward`, or :func:`lm_head_slice_forward` with a ``shard``."""
    shard = kwargs.get("shard")
    forward = {k: v for k, v in kwargs.items() if k not in ("chunk_bytes", "shard")}
    if shard is None:
        return lm_head_forward(hidden, weight, tokens, mask, bias=bias, **forward)
    return lm_head_slice_forward(hidden, weight, tokens, mask, bias=bias, shard=shard, **forward)


class LogProbsFromHiddenFunction(torch.autograd.Function):
    """``apply(hidden, weight, bias, tokens, mask, head_kwargs) -> (log_probs, entropy)``.

    ``head_kwargs``: ``temperature``, ``with_entropy`` and optionally ``blocks``/``splits``
    (forward), ``chunk_bytes`` (backward) and ``shard`` (vocabulary parallelism: ``weight`` and
    ``bias`` are this rank's rows, ``tokens`` global ids; the gradients are this rank's).
    Outputs are ``(N,)`` float32, zeros at masked rows; ``entropy`` is an empty tensor without
    ``with_entropy``. Gradients flow to ``hidden``, ``weight`` and ``bias``. First-order only.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        head_kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass (see the class docstring)."""
        tokens = _slice_tokens(tokens, head_kwargs)
        out = _head_forward(hidden, weight, bias, tokens, mask, head_kwargs)
        entropy = out.entropy if out.entropy is not None else out.lse.new_empty(0)
        ctx.save_for_backward(hidden, weight, bias, tokens, mask, out.lse, out.entropy)
        ctx.head_kwargs = head_kwargs
        return out.log_probs, entropy

    @staticmethod
    @first_order_only
    def backward(  # type: ignore[override]
        ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        hidden, weight, bias, tokens, mask, lse, entropy = ctx.saved_tensors
        options = ctx.head_kwargs
        if grad_log_probs is None:
            grad_log_probs = torch.zeros_like(lse)
        if entropy is None or grad_entropy is None or not grad_entropy.numel():
            grad_entropy = None
        # Rows whose outputs receive no gradient are treated as masked: their hidden states are
        # not read, so a NaN row the caller selected away cannot reach grad_weight (0 * NaN).
        active = grad_log_probs != 0
        if grad_entropy is not None:
            active = active | (grad_entropy != 0)
        mask = mask & active
        grads = lm_head_backward(
            hidden, weight, tokens, mask, lse, grad_log_probs.float().contiguous(),
            bias=bias, temperature=options.get("temperature", 1.0), entropy=entropy,
            grad_entropy=None if grad_entropy is None else grad_entropy.float().contiguous(),
            need_hidden=ctx.needs_input_grad[0], need_weight=ctx.needs_input_grad[1],
            need_bias=ctx.needs_input_grad[2], chunk_bytes=options.get("chunk_bytes"),
            blocks=options.get("blocks"),
        )  # fmt: skip
        return grads.hidden, grads.weight, grads.bias, None, None, None


class FusedPolicyLossFromHiddenFunction(torch.autograd.Function):
    r"""Fused policy loss from hidden states: ``(loss, log_probs, entropy, totals)``.

    ``apply(hidden, weight, bias, tokens, mask, old_log_probs, advantages, weights, head_kwargs,
    loss_kwargs)``: ``head_kwargs`` as :class:`LogProbsFromHiddenFunction` (``with_entropy`` is
    implied by ``options.entropy_coef != 0``), ``loss_kwargs`` the keyword arguments of
    :func:`~rlobjectives.kernels.token_loss.token_loss_forward` other than ``weights`` and
    ``entropy`` (``options``, ``row_length``, ``importance_weights``, ``ref_log_probs``,
    ``sequence_log_ratio``...). ``loss`` (0-d float32, :math:`\sum_n w_n L_n`) is
    differentiable with respect to ``hidden``, ``weight`` and ``bias``; ``log_probs`` /
    ``entropy`` (``(N,)`` float32) and ``totals`` (the 17 sums of
    :class:`~rlobjectives.kernels.token_loss.TokenLossSums`) are detached. One backward pass
    per forward (a second raises, as the PyTorch path).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        weights: torch.Tensor | None,
        head_kwargs: dict[str, Any],
        loss_kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward pass (see the class docstring)."""
        options: TokenLossOptions = loss_kwargs.get("options", TokenLossOptions())
        with_entropy = options.entropy_coef != 0.0
        forward_kwargs = {
            k: v for k, v in head_kwargs.items() if k not in ("chunk_bytes", "with_entropy")
        }
        head = lm_head_forward(
            hidden, weight, tokens, mask, bias=bias, with_entropy=with_entropy, **forward_kwargs
        )
        out = token_loss_forward(
            head.log_probs, old_log_probs, advantages, mask,
            weights=weights, entropy=head.entropy, **loss_kwargs,
        )  # fmt: skip
        ctx.save_for_backward(
            hidden, weight, bias, tokens, mask, head.lse, head.entropy, out.coefficient, weights
        )
        ctx.spent = False
        ctx.head_kwargs = head_kwargs
        ctx.entropy_coef = options.entropy_coef
        ctx.row_length = loss_kwargs.get("row_length")
        entropy = head.entropy if head.entropy is not None else head.lse.new_empty(0)
        ctx.mark_non_differentiable(head.log_probs, entropy, out.totals)
        return out.totals[0].clone(), head.log_probs, entropy, out.totals

    @staticmethod
    @first_order_only
    def backward(  # type: ignore[override]
        ctx: Any, grad_loss: torch.Tensor, *_: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        if ctx.spent:  # the contract of the PyTorch path (its gradients are formed in forward)
            raise RuntimeError(
                "fused_policy_loss_from_hidden supports one backward pass per forward"
            )
        ctx.spent = True
        hidden, weight, bias, tokens, mask, lse, entropy, coefficient, weights = ctx.saved_tensors
        gradient = grad_loss.float()
        grad_log_probs = coefficient * gradient  # (N,) c g, zero at masked rows
        grad_entropy = None
        if entropy is not None and ctx.entropy_coef != 0.0:
            factor = weights if weights is not None else torch.ones_like(gradient)
            grad_entropy = scale_by_mask(
                factor, -ctx.entropy_coef * gradient, mask, torch.float32,
                row_length=ctx.row_length,
            )  # fmt: skip
        options = ctx.head_kwargs
        grads = lm_head_backward(
            hidden, weight, tokens, mask, lse, grad_log_probs,
            bias=bias, temperature=options.get("temperature", 1.0), entropy=entropy,
            grad_entropy=grad_entropy, need_hidden=ctx.needs_input_grad[0],
            need_weight=ctx.needs_input_grad[1], need_bias=ctx.needs_input_grad[2],
            chunk_bytes=options.get("chunk_bytes"), blocks=options.get("blocks"),
        )  # fmt: skip
        return (grads.hidden, grads.weight, grads.bias) + (None,) * 7
