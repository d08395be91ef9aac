r"""KTO on unpaired desirable / undesirable responses: :func:`kto_loss`.

Each response :math:`i` has a label (desirable or not), its summed log-ratio
:math:`x_i = S_i - R_i` against the reference and the reference point :math:`z_0`, the
(detached) KL estimate of the batch, clamped at 0:

.. math::

    L_i = \begin{cases} \lambda_D\,\big(1 - \sigma(\beta(x_i - z_0))\big) & \text{desirable}\\
    \lambda_U\,\big(1 - \sigma(\beta(z_0 - x_i))\big) & \text{undesirable} \end{cases},
    \qquad \mathcal{L} = \frac{1}{D}\sum_i L_i.

``kind="apo_zero_unpaired"`` replaces them by :math:`\lambda_D(1 - \sigma(\beta x_i))` and
:math:`\lambda_U\sigma(\beta x_i)` (APO-zero on unpaired data, no :math:`z_0`).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from .._core.layout import per_sequence, sequence_layout, token_matrix
from .._core.reduction import masked_fill_zero
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    checks_environment,
    compute_dtype,
    validate_choice,
    validate_scalar,
)
from .inputs import SideInputs, side_sums, validate_reference

__all__ = ["KTOLossOutput", "KTOCall", "kto_formula", "kto_loss", "validate_kto_call"]

KTOKind = Literal["kto", "apo_zero_unpaired"]
_KINDS = ("kto", "apo_zero_unpaired")


class KTOLossOutput(NamedTuple):
    r"""Result of :func:`rlobjectives.kto_loss` (and its hidden-state form).

    Attributes:
        loss: the scalar loss.
        example_losses: ``(B,)`` :math:`L_i`, 0 for an empty response (detached in the
            hidden-state form).
        rewards: ``(B,)`` :math:`\beta x_i` (detached; 0 for an empty response).
        kl: ``()`` the reference point :math:`z_0` used (``max(kl, 0)``).
        log_probs: ``(B,)`` :math:`S_i`, the summed log-probabilities (detached).
    """

    loss: torch.Tensor
    example_losses: torch.Tensor
    rewards: torch.Tensor
    kl: torch.Tensor
    log_probs: torch.Tensor


class KTOCall(NamedTuple):
    """The validated KTO call."""

    side: SideInputs
    desirable: torch.Tensor  # (B,) bool
    kl: float | torch.Tensor | None
    beta: float | torch.Tensor
    weights: tuple[float | torch.Tensor, float | torch.Tensor]
    kind: str
    normalizer: float | torch.Tensor | None
    dtype: torch.dtype
    output_dtype: torch.dtype


def validate_kto_call(
    log_probs: ArrayLike,
    mask: ArrayLike,
    desirable: ArrayLike,
    ref_log_probs: ArrayLike,
    *,
    kl: Scalar | None,
    beta: Scalar,
    desirable_weight: Scalar,
    undesirable_weight: Scalar,
    kind: object,
    normalizer: Scalar | None,
    cu_seqlens: ArrayLike | None,
) -> KTOCall:
    """Validate :func:`kto_loss`'s arguments (names as in its signature)."""
    packed = cu_seqlens is not None
    values = token_matrix(as_float_tensor(log_probs, "log_probs"), "log_probs", packed)
    mask_t = token_matrix(as_mask(mask, "mask", values.device), "mask", packed)
    check_same_device({"log_probs": values, "mask": mask_t})
    check_shape(mask_t, "mask", values.shape, "log_probs")
    layout = sequence_layout(cu_seqlens, values)
    if ref_log_probs is None:
        raise ValueError("ref_log_probs is required (KTO compares with the reference), got None")
    ref = validate_reference(ref_log_probs, "ref_log_probs", values, layout, "log_probs")
    labels = as_mask(desirable, "desirable", values.device)
    assert ref is not None  # given
    check_same_device({"log_probs": values, "desirable": labels, "ref_log_probs": ref})
    labels = per_sequence(labels, "desirable", layout, "log_probs")
    validate_choice(kind, "kind", _KINDS)
    if kl is not None:
        kl = validate_scalar(kl, "kl", minimum=None)
    side = SideInputs(values, mask_t, ref, None, layout)
    normalizer_value = None
    if normalizer is not None:
        normalizer_value = validate_scalar(normalizer, "normalizer", minimum=0.0, strict=True)
    return KTOCall(
        side=side,
        desirable=labels,
        kl=kl,
        beta=validate_scalar(beta, "beta", minimum=0.0, strict=True),
        weights=(
            validate_scalar(desirable_weight, "desirable_weight"),
            validate_scalar(undesirable_weight, "undesirable_weight"),
        ),
        kind=str(kind),
        normalizer=normalizer_value,
        dtype=compute_dtype(values, ref),
        output_dtype=values.dtype,
    )


def kto_formula(
    call: KTOCall, sums: torch.Tensor, ref: torch.Tensor, z0: torch.Tensor
) -> torch.Tensor:
    r"""The per-example losses :math:`L_i` of the module docstring, ``(B,)``."""
    x = sums - ref
    beta = call.beta
    if call.kind == "kto":
        good = 1.0 - torch.sigmoid(beta * (x - z0))
        bad = 1.0 - torch.sigmoid(beta * (z0 - x))
    else:
        good = 1.0 - torch.sigmoid(beta * x)
        bad = torch.sigmoid(beta * x)
    weight_d, weight_u = call.weights
    return torch.where(call.desirable, weight_d * good, weight_u * bad)


def reference_point(call: KTOCall, device: torch.device) -> torch.Tensor:
    r""":math:`z_0 = \max(kl, 0)`, detached (0 without ``kl`` or for APO-zero)."""
    zero = torch.zeros((), dtype=call.dtype, device=device)
    if call.kl is None or call.kind != "kto":
        return zero
    return torch.as_tensor(call.kl, dtype=call.dtype, device=device).detach().clamp(min=0)


def kto_finish(
    call: KTOCall, sums: torch.Tensor, lengths: torch.Tensor, ref: torch.Tensor
) -> KTOLossOutput:
    """Reduce the formula's per-example losses (an empty response gives 0)."""
    valid = lengths > 0
    placeholder = torch.full((), -1.0, dtype=sums.dtype, device=sums.device)
    sums_v, ref_v = torch.where(valid, sums, placeholder), torch.where(valid, ref, placeholder)
    z0 = reference_point(call, sums.device)
    losses = masked_fill_zero(kto_formula(call, sums_v, ref_v, z0), valid)
    if call.normalizer is None:
        denominator = valid.sum().to(sums.dtype).clamp(min=1)
    else:
        denominator = torch.as_tensor(call.normalizer, dtype=sums.dtype, device=sums.device)
    with torch.no_grad():
        rewards = masked_fill_zero(call.beta * (sums_v - ref_v).detach(), valid)
        log_probs = masked_fill_zero(sums_v.detach(), valid)
    return KTOLossOutput(losses.sum() / denominator, losses, rewards, z0, log_probs)


@checks_environment
def kto_loss(
    log_probs: ArrayLike,
    mask: ArrayLike,
    desirable: ArrayLike,
    *,
    ref_log_probs: ArrayLike,
    kl: Scalar | None = None,
    beta: Scalar = 0.1,
    desirable_weight: Scalar = 1.0,
    undesirable_weight: Scalar = 1.0,
    kind: KTOKind = "kto",
    normalizer: Scalar | None = None,
    cu_seqlens: ArrayLike | None = None,
) -> KTOLossOutput:
    r"""KTO (prospect-theoretic alignment) on unpaired desirable / undesirable responses.

    With :math:`x_i = S_i - R_i` the summed log-ratio of response :math:`i` against the
    reference over its selected tokens and :math:`z_0 = \max(\mathrm{kl}, 0)` (detached),

    .. math::

        L_i = \lambda_D\big(1 - \sigma(\beta(x_i - z_0))\big)\ \text{(desirable)}, \quad
        L_i = \lambda_U\big(1 - \sigma(\beta(z_0 - x_i))\big)\ \text{(undesirable)}, \quad
        \mathcal{L} = \frac{1}{D}\sum_i L_i,

    :math:`D` = ``normalizer`` (default: the responses with a selected token). ``kl`` is KTO's
    reference point: TRL's estimate is the mean over mismatched (prompt, completion) pairs of
    their summed log-ratio, averaged over the processes (clamped at 0 here as there); pass it
    computed on the whole batch for exact micro-batches. ``kind="apo_zero_unpaired"``:
    :math:`\lambda_D(1-\sigma(\beta x_i))`, :math:`\lambda_U\sigma(\beta x_i)`. NaN/inf at
    unselected tokens reach nothing; an empty response gives 0.

    Args:
        log_probs: ``(B, T)`` per-token log-probabilities (packed ``(N,)``), with gradient.
        mask: the response tokens, ``log_probs``' shape.
        desirable: ``(B,)`` bool, True for a desirable response (TRL's ``label``).
        ref_log_probs: the reference's, per token (``log_probs``' shape) or summed ``(B,)``.
        kl: the reference point before clamping (a number or 0-d tensor; None: 0).
        beta: :math:`\beta > 0`.
        desirable_weight: :math:`\lambda_D \ge 0`.
        undesirable_weight: :math:`\lambda_U \ge 0`.
        kind: ``"kto"`` or ``"apo_zero_unpaired"`` (TRL ``KTOConfig.loss_type``).
        normalizer: :math:`D`, the global count of responses for exact micro-batches.
        cu_seqlens: ``(B + 1,)`` boundaries of packed sequences.

    Returns:
        :class:`KTOLossOutput` ``(loss, example_losses, rewards, kl, log_probs)``: a scalar in
        ``log_probs``' dtype, ``(B,)`` values and ``()`` :math:`z_0` in the computation dtype.

    Raises:
        ValueError: shapes, devices, a missing ``ref_log_probs``, values out of range, an
            unknown ``kind``, malformed ``cu_seqlens``; each naming the argument.
        TypeError: non-numeric inputs.

    References:
        Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization",
        arXiv:2402.01306 Eq. 7-8. Peers: TRL ``KTOTrainer`` (``beta``, ``desirable_weight``,
        ``undesirable_weight``, ``loss_type``); Liger ``LigerFusedLinearKTOLoss``.

    Examples:
        >>> import torch
        >>> lp = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]])
        >>> out = kto_loss(lp, torch.ones(2, 2), torch.tensor([True, False]),
        ...                ref_log_probs=lp, beta=1.0)
        >>> out.loss  # (1 - sigmoid(0)) for both: 0.5
        tensor(0.5000)

    .. versionadded:: 0.3.0
    """
    call = validate_kto_call(
        log_probs, mask, desirable, ref_log_probs, kl=kl, beta=beta,
        desirable_weight=desirable_weight, undesirable_weight=undesirable_weight, kind=kind,
        normalizer=normalizer, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    sums = side_sums(call.side, call.dtype, None, call.side.log_probs)
    assert sums.ref is not None  # validated
    out = kto_finish(call, sums.sums, sums.lengths, sums.ref)
    return out._replace(loss=out.loss.to(call.output_dtype))
