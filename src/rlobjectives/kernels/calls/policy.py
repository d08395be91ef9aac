r"""The policy loss of the public functions on the token-loss kernel (the Triton backend).

:func:`rlobjectives.policy_loss` and :func:`rlobjectives.grpo_clipped_surrogate` validate their
arguments once (a :class:`~rlobjectives.policy.inputs.PolicyCall`), then call :func:`run_kernels`
/ :func:`seed_outputs` here when :func:`~rlobjectives._core.backend.kernel_backend` selects
the kernels. This module maps the validated call onto the flat launcher of
:mod:`rlobjectives.kernels.token_loss`:

- every per-token tensor becomes ``(N,)`` (padded ``(B, T)`` rows or a packed ``(1, N)`` row);
  per-sequence advantages and importance weights ``(B, 1)`` are read per row (``row_length=T``);
- the reduction enters as per-token weights :math:`\partial\mathcal{L}/\partial L_{it}` from
  :func:`rlobjectives._core.reduction.row_weights` and the
  :class:`~rlobjectives._core.layout.Layout`
  (the same weights as the fused PyTorch path), so every reduction and both layouts are one
  weighted sum in the kernel; ``reduction="none"`` and ``return_per_token`` use the kernel's
  per-token loss (differentiable) and reduce it with :func:`rlobjectives._core.reduction.reduce`;
- GSPO's sequence log-ratio (the mean selected log-ratio of each sequence) is formed through
  the layout and read per row (padded) or per token (packed);
- the entropy bonus is a term of the kernel's per-token loss (gradient :math:`-c_H w`);
- the diagnostics are the kernel's last nine sums over the selected-token count (or
  ``diagnostics_normalizer``);
- under context parallelism (``layout.context``) the counts and GSPO's sums come from the
  layout (whole sequences), and the kernel's weighted sum and its totals are summed over the
  group in one all-reduce.

:func:`kernel_options` returns None when a hyperparameter cannot be handed to the kernel (a
tensor that requires grad): the caller then takes the PyTorch path.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..._core.layout import Layout
from ..._core.reduction import (
    ReductionSpec,
    masked_fill_zero,
    reduce,
    reduction_counts,
    row_weights,
    safe_divide,
    token_gradient_weights,
)
from ...policy.inputs import (
    PolicyCall,
    PolicyInputs,
    PolicyLossDiagnostics,
    PolicyLossOutput,
    SurrogateOptions,
)
from ..common import KERNEL_DTYPES
from ..token_loss import TokenLossFunction, TokenLossOptions

__all__ = [
    "FlatInputs",
    "diagnostics_of",
    "flat_inputs",
    "flat_values",
    "host_number",
    "kernel_dtype",
    "kernel_options",
    "reduction_weights",
    "run_kernels",
    "seed_outputs",
]

_NOT_READABLE = object()  # a hyperparameter the kernel cannot take (a tensor that requires grad)


def host_number(value: float | torch.Tensor | None) -> object:
    """``value`` as a Python float (None stays None), or a marker when it requires grad.

    A 0-d tensor hyperparameter is read on the host (validation at the boundary reads it too);
    one that requires grad is differentiated by the PyTorch path instead.
    """
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return _NOT_READABLE if value.requires_grad else float(value)
    return float(value)


def kernel_options(
    options: SurrogateOptions, entropy_coef: float | torch.Tensor = 0.0, **extra: Any
) -> TokenLossOptions | None:
    """The launcher's options for a token-local surrogate, or None (PyTorch path).

    None for a sequence-level surrogate (GMPO, VESPO) and for a hyperparameter the kernel
    cannot take (a tensor that requires grad). ``extra``: the KL options of the hidden-state
    path (``kl_coef``, ``kl_estimator``...).
    """
    surrogate = options.surrogate
    if not surrogate.token_local:
        return None
    fields = [  # the numeric fields (DPPO's divergence is a name)
        host_number(value) for value in vars(surrogate).values() if not isinstance(value, str)
    ]
    bound = host_number(options.log_ratio_bound)
    coef = host_number(entropy_coef)
    if any(value is _NOT_READABLE for value in (*fields, bound, coef)):
        return None
    return TokenLossOptions(
        surrogate=surrogate,
        log_ratio_bound=bound,  # type: ignore[arg-type]
        entropy_coef=coef,  # type: ignore[arg-type]
        **extra,
    )


def flat_values(values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A tensor broadcastable to ``shape`` in the launcher's flat layout (no copy if possible).

    One value: ``(1,)``; per row ``(B, 1)``: ``(B,)`` (read with ``row_length=T``); otherwise
    the ``(N,)`` tokens.
    """
    rows, tokens = shape
    if values.numel() == 1:
        return values.reshape(1)
    if tuple(values.shape) == (rows, 1) and tokens > 0:
        return values.reshape(rows)
    return values.expand(shape).reshape(-1)


def kernel_dtype(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in a dtype the kernels read (float64 entropies or weights: float32)."""
    return tensor if tensor.dtype in KERNEL_DTYPES else tensor.to(torch.float32)


class FlatInputs(NamedTuple):
    """The tensors of one call in the launcher's flat layout."""

    log_probs: torch.Tensor  # (N,), differentiable
    old_log_probs: torch.Tensor  # (N,)
    advantages: torch.Tensor  # (N,), (B,) or (1,)
    mask: torch.Tensor  # (N,) bool
    importance_weights: torch.Tensor | None  # (N,), (B,) or (1,)
    shape: tuple[int, int]  # (B, T) or packed (1, N)


def flat_inputs(inputs: PolicyInputs) -> FlatInputs:
    """:class:`FlatInputs` of validated policy inputs."""
    shape = (inputs.mask.shape[0], inputs.mask.shape[1])
    weights = inputs.importance_weights
    return FlatInputs(
        log_probs=inputs.log_probs.reshape(-1),
        old_log_probs=inputs.old_log_probs.reshape(-1),
        advantages=flat_values(inputs.advantages, shape),
        mask=inputs.mask.reshape(-1),
        importance_weights=None if weights is None else flat_values(kernel_dtype(weights), shape),
        shape=shape,
    )


def reduction_weights(mask: torch.Tensor, spec: ReductionSpec, layout: Layout) -> torch.Tensor:
    """Per-token weights :math:`1 / (d_i D)` of ``spec`` in the flat layout (float32)."""
    counts = reduction_counts(mask, spec, layout)  # (S,) (under CP: what the reduction reads)
    weights = row_weights(counts, spec, dtype=torch.float32, batch=layout.num_sequences)
    gradient = token_gradient_weights(weights, layout, torch.float32)  # (B, 1), (1, N) or (1, 1)
    return flat_values(gradient, (mask.shape[0], mask.shape[1]))


def _sequence_log_ratio(inputs: PolicyInputs, layout: Layout) -> torch.Tensor:
    """GSPO: each sequence's mean selected log-ratio, ``(B, 1)`` or ``(1, N)`` (constant)."""
    with torch.no_grad():
        log_ratio = inputs.log_probs.float() - inputs.old_log_probs.float()  # (B, T)
        selected = masked_fill_zero(log_ratio, inputs.mask)
        counts = layout.row_counts(inputs.mask).clamp(min=1).float()  # (S,)
        return layout.expand(layout.row_sums(selected) / counts)


def _launch(
    flat: FlatInputs,
    options: TokenLossOptions,
    weights: torch.Tensor | None,
    sequence_log_ratio: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, per_token, totals)`` of :class:`TokenLossFunction`.

    Without ``weights``: the per-token mode (the per-token loss is differentiable).
    """
    kwargs: dict[str, Any] = {
        "options": options,
        "row_length": flat.shape[1],
        "importance_weights": flat.importance_weights,
        "return_per_token": weights is None,
    }
    if sequence_log_ratio is not None:
        kwargs["sequence_log_ratio"] = flat_values(sequence_log_ratio, flat.shape)
    result: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = TokenLossFunction.apply(  # type: ignore[no-untyped-call]
        flat.log_probs, entropy, flat.old_log_probs, flat.advantages, flat.mask, weights, kwargs
    )
    return result


def diagnostics_of(
    totals: torch.Tensor, normalizer: float | torch.Tensor | None
) -> PolicyLossDiagnostics:
    """The diagnostics from the kernel's sums (the last nine over the selected count).

    ``selected_fraction`` is 0: the kernels compute the token-local surrogates, which select no
    tokens of the batch.
    """
    if normalizer is None:
        denominator = totals[7].clamp(min=1)
    else:  # an explicit normaliser is honoured exactly
        denominator = torch.as_tensor(normalizer, dtype=totals.dtype, device=totals.device)
    fractions = totals[8:17] / denominator
    return PolicyLossDiagnostics(*torch.cat([fractions, torch.zeros_like(fractions[:1])]).unbind())


def run_kernels(
    call: PolicyCall, options: TokenLossOptions, *, return_per_token: bool
) -> PolicyLossOutput:
    """:func:`rlobjectives.policy_loss` of a validated ``call`` on the token-loss kernel."""
    inputs, spec, layout = call.inputs, call.reduction, call.layout
    flat = flat_inputs(inputs)
    entropy = None
    if inputs.entropy is not None and options.entropy_coef != 0.0:
        entropy = kernel_dtype(inputs.entropy).reshape(-1)
    sequence = None
    if call.options.ratio_level == "sequence":
        sequence = _sequence_log_ratio(inputs, layout)
    per_token_wanted = return_per_token or spec.reduction == "none"
    weights = None if per_token_wanted else reduction_weights(inputs.mask, spec, layout)
    loss, per_token, totals = _launch(flat, options, weights, sequence, entropy)
    if layout.context is not None:  # the sums of the whole sequences, one all-reduce
        if weights is None:  # per-token mode: reduce() below sums the loss over the group
            (totals,) = layout.combine(totals)
        else:  # identity backward: the kernel's gradient is that of the summed loss
            loss, totals = layout.combine(loss, totals)
    per_token_loss = None
    if per_token_wanted:
        per_token_loss = per_token.view(flat.shape)  # (B, T), zeros at unselected tokens
        none = spec.reduction == "none"
        loss = per_token_loss if none else reduce(per_token_loss, inputs.mask, spec, layout)
    output_dtype = inputs.output_dtype
    kept = per_token_loss if return_per_token else None
    return PolicyLossOutput(
        loss.to(output_dtype),
        None if kept is None else kept.to(output_dtype),
        diagnostics_of(totals, call.diagnostics_normalizer),
    )


def seed_outputs(
    inputs: PolicyInputs, options: SurrogateOptions, layout: Layout
) -> dict[str, torch.Tensor] | None:
    """:func:`rlobjectives.grpo_clipped_surrogate`'s outputs on the kernel, or None.

    The per-token surrogate (differentiable) gives the token-mean loss and the per-sequence
    means; ``clipped_fraction`` is the kernel's out-of-band count over the selected tokens.
    """
    kernel = kernel_options(options)
    if kernel is None:
        return None
    flat = flat_inputs(inputs)
    _, per_token, totals = _launch(flat, kernel, None, None, None)  # per_token = -s
    surrogate = -per_token.view(flat.shape)  # (B, T), zeros at unselected tokens
    counts = layout.row_counts(inputs.mask)  # (S,)
    output_dtype = inputs.output_dtype
    loss = safe_divide(per_token.sum(), counts.sum())  # the token mean of -s
    return {
        "loss": loss.to(output_dtype),
        "per_sequence_surrogate": safe_divide(layout.row_sums(surrogate), counts).to(output_dtype),
        "clipped_fraction": safe_divide(totals[8], totals[7]).to(output_dtype),
    }
