r"""Log-probabilities (and entropies) from hidden states on the Triton LM-head kernels.

:class:`TritonLogProbs` wraps the launchers of :mod:`rlobjectives.kernels` in one autograd
Function: the forward (online log-sum-exp over vocabulary tiles, no logits in memory) saves the
per-row ``lse`` (and entropy); the backward recomputes the logits chunk by chunk
(:func:`rlobjectives.kernels.head_backward.lm_head_backward`). Under vocabulary parallelism
each rank's slice statistics are combined here (:func:`.vocab_parallel.combine_rows`: the
kernels run no collective). :func:`triton_log_probs` is what
:func:`rlobjectives.token_log_probs_from_hidden` and the policy loss from hidden states call
when the Triton backend is selected (``docs/kernels.md``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels.common import first_order_only
from ..kernels.head_forward import LogitOptions
from .head import Head
from .vocab_parallel import Shard, combine_rows

__all__ = ["TritonLogProbs", "triton_log_probs"]


def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    transform: tuple[LogitOptions, float] | float,
    with_entropy: bool,
    shard: Shard | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy, lse, local_tokens)``, ``(N,)`` float32, zeros at masked rows.

    ``transform``: the kernels' logit options and the one temperature (when not per row).
    """
    from ..kernels.head_forward import lm_head_forward, lm_head_slice_stats

    if not isinstance(transform, tuple):  # the temperature alone
        transform = (LogitOptions(), transform)
    options, temperature = transform
    # a selected id outside [0, V) raises, as the PyTorch path's gather does (no host read)
    vocab = weight.shape[0] if shard is None else shard.vocab_size()
    inside = (tokens >= 0) & (tokens < vocab)
    torch._assert_async(torch.all(inside | ~mask), "tokens must be ids in [0, V)")
    if shard is None:
        out = lm_head_forward(
            hidden, weight, tokens, mask, bias=bias, temperature=temperature,
            with_entropy=with_entropy, options=options,
        )  # fmt: skip
        return out.log_probs, out.entropy, out.lse, tokens
    local, owned = shard.local_ids(tokens)
    local = torch.where(owned, local, -1)  # the kernels never match -1
    stats = lm_head_slice_stats(
        hidden, weight, local, mask, bias=bias, temperature=temperature,
        with_entropy=with_entropy, options=options,
    )  # fmt: skip
    totals = combine_rows(stats.log_normalizer, stats.entropy, [stats.target], shard)
    log_probs = torch.where(mask, totals.sums[0] - totals.log_normalizer, 0.0)
    entropy = None if totals.entropy is None else torch.where(mask, totals.entropy, 0.0)
    return log_probs, entropy, torch.where(mask, totals.log_normalizer, 0.0), local


class TritonLogProbs(torch.autograd.Function):
    """``apply(hidden, weight, bias, tokens, mask, (options, temperature), with_entropy, shard)``.

    Returns ``(log_probs, entropy)``, ``(N,)`` float32, zeros at masked rows; ``entropy`` is an
    empty tensor without ``with_entropy``. Gradients flow to ``hidden``, ``weight`` and
    ``bias`` (this rank's rows under a ``shard``). First-order only.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        transform: tuple[LogitOptions, float] | float,
        with_entropy: bool,
        shard: Shard | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass (see the class docstring)."""
        log_probs, entropy, lse, local = _forward(
            hidden, weight, bias, tokens, mask, transform, with_entropy, shard
        )
        ctx.save_for_backward(hidden, weight, bias, local, mask, lse, entropy)
        ctx.transform = transform if isinstance(transform, tuple) else (LogitOptions(), transform)
        return log_probs, entropy if entropy is not None else lse.new_empty(0)

    @staticmethod
    @first_order_only
    def backward(  # type: ignore[override]
        ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        from ..kernels.head_backward import lm_head_backward

        hidden, weight, bias, tokens, mask, lse, entropy = ctx.saved_tensors
        if grad_log_probs is None:
            grad_log_probs = torch.zeros_like(lse)
        if entropy is None or grad_entropy is None or not grad_entropy.numel():
            grad_entropy = None
        # Rows whose outputs receive no gradient are treated as masked: their hidden states are
        # not read, so a NaN row the caller selected away cannot reach grad_weight (0 * NaN).
        active = grad_log_probs != 0
        if grad_entropy is not None:
            active = active | (grad_entropy != 0)
        grads = lm_head_backward(
            hidden, weight, tokens, mask & active, lse, grad_log_probs.float().contiguous(),
            bias=bias, temperature=ctx.transform[1], entropy=entropy, options=ctx.transform[0],
            grad_entropy=None if grad_entropy is None else grad_entropy.float().contiguous(),
            need_hidden=ctx.needs_input_grad[0], need_weight=ctx.needs_input_grad[1],
            need_bias=ctx.needs_input_grad[2],
        )  # fmt: skip
        return grads.hidden, grads.weight, grads.bias, None, None, None, None, None


def triton_log_probs(
    head: Head, mask: torch.Tensor | None, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy)``, ``(N,)`` float32, of the head's tokens on the kernels.

    ``entropy`` is ``(0,)`` without ``with_entropy``; ``mask`` None selects every row.
    """
    if mask is None:
        mask = torch.ones(head.hidden.shape[0], dtype=torch.bool, device=head.hidden.device)
    transform = head.transform
    inverse = transform.inverse
    options = LogitOptions(
        scale=transform.scale,
        softcap=transform.softcap,
        inverse=inverse if isinstance(inverse, torch.Tensor) else None,
        round_product=head.rounds_product,
    )
    temperature = 1.0 if isinstance(inverse, torch.Tensor) else 1.0 / inverse
    outputs: tuple[torch.Tensor, torch.Tensor] = TritonLogProbs.apply(  # type: ignore[no-untyped-call]
        head.hidden, head.weight, head.bias, head.tokens, mask, (options, temperature),
        with_entropy, head.shard,
    )  # fmt: skip
    return outputs
