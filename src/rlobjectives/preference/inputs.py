r"""The validated call of the preference losses and the per-pair quantities of its sequences.

Both entry points (log-probabilities, :func:`rlobjectives.preference_loss`; hidden states,
:mod:`rlobjectives.preference.hidden`) build the same :class:`PairCall` at the boundary, then the
per-sequence sums of :class:`SideSums` (one per side: chosen, rejected), then the
:class:`~rlobjectives.preference.objectives.base.PairQuantities` of the formula
(:func:`pair_quantities`), which :func:`finish` reduces:

.. math::

    \mathcal{L} = \frac{1}{D}\sum_{i \text{ valid}} w_i L_i,

with :math:`D` the ``normalizer`` (default: the number of valid pairs, at least 1), :math:`w_i`
WPO's constant pair weight (1 without it) and a pair valid when both of its responses have a
selected token. Every sum selects with ``torch.where`` (NaN/inf at unselected tokens reach
nothing) and runs in the computation dtype (float32, float64 when an input is).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .._core.layout import Layout, sequence_layout, token_matrix
from .._core.reduction import masked_fill_zero
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    compute_dtype,
    describe,
    scalar_number,
    validate_scalar,
)
from .objectives.base import PairQuantities, PreferenceObjective

__all__ = [
    "PairCall",
    "PreferenceLossOutput",
    "SideInputs",
    "SideSums",
    "check_objective",
    "Denominators",
    "denominators",
    "ld_weights",
    "nll_counts",
    "nll_sums",
    "wpo_weights",
    "finish",
    "pair_losses",
    "pair_quantities",
    "pair_weights",
    "reference_sums",
    "side_sums",
    "validate_ld_alpha",
    "validate_pair_call",
    "validate_reference",
]


class PreferenceLossOutput(NamedTuple):
    r"""Result of :func:`rlobjectives.preference_loss` (and its hidden-state form).

    Attributes:
        loss: the scalar loss :math:`\frac{1}{D}\sum_i w_i L_i` (dtype of the chosen
            log-probabilities; the hidden-state form: the computation dtype).
        pair_losses: ``(B,)`` :math:`w_i L_i`, 0 for a pair with an empty response (detached
            in the hidden-state form, whose gradient is the loss's only).
        chosen_rewards: ``(B,)`` the objective's implicit reward of the chosen responses
            (:math:`\beta x_c` for the reference-based ones), detached.
        rejected_rewards: ``(B,)`` the same for the rejected responses.
        margins: ``(B,)`` ``chosen_rewards - rejected_rewards``.
        accuracy: ``(B,)`` 1.0 where ``chosen_rewards > rejected_rewards``, else 0.0.
        chosen_log_probs: ``(B,)`` :math:`S_c`, the chosen responses' summed log-probabilities
            (LD-DPO-weighted with ``ld_alpha``), detached.
        rejected_log_probs: ``(B,)`` :math:`S_r`.

    Every per-pair entry is 0 for a pair with an empty response; all are in the computation
    dtype (float32, float64 for float64 inputs).
    """

    loss: torch.Tensor
    pair_losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    margins: torch.Tensor
    accuracy: torch.Tensor
    chosen_log_probs: torch.Tensor
    rejected_log_probs: torch.Tensor


class SideInputs(NamedTuple):
    """One side (chosen or rejected) of the validated call."""

    log_probs: torch.Tensor  # (B, T) padded or (1, N) packed, with gradient
    mask: torch.Tensor  # bool, the shape of log_probs
    ref: torch.Tensor | None  # per token (log_probs' shape) or per sequence (S,)
    log_sum_sq: torch.Tensor | None  # per token, WPO's log sum_v pi^2
    layout: Layout


class PairCall(NamedTuple):
    """The validated arguments of a preference call."""

    chosen: SideInputs
    rejected: SideInputs
    nll_mask: torch.Tensor | None  # bool, the chosen side's shape
    objective: PreferenceObjective
    ld_alpha: float | torch.Tensor | None
    normalizer: float | torch.Tensor | None
    nll_normalizer: float | torch.Tensor | None
    dtype: torch.dtype  # computation dtype
    output_dtype: torch.dtype


def check_objective(objective: object, name: str = "objective") -> PreferenceObjective:
    """The objective must be a preference object (``DPO(...)``, a combination, ...)."""
    if not isinstance(objective, PreferenceObjective):
        raise TypeError(
            f"{name} must be a preference objective (DPO(beta=...), IPO(...), SimPO(...), a "
            f"weighted combination such as 0.8 * DPO() + 0.2 * BCO(), ...), got "
            f"{describe(objective)} ({objective!r})"
        )
    return objective


def validate_ld_alpha(value: Scalar | None) -> float | torch.Tensor | None:
    """LD-DPO's ``ld_alpha``: None, or a number in ``[0, 1]``."""
    if value is None:
        return None
    checked = validate_scalar(value, "ld_alpha", minimum=0.0)
    number = scalar_number(checked)
    if number is not None and number > 1.0:
        raise ValueError(f"ld_alpha must be <= 1 (a weight in [0, 1]), got {number}")
    return checked


def _boundaries(cu_seqlens: object) -> tuple[ArrayLike | None, ArrayLike | None]:
    """``cu_seqlens``: None, or one ``(S + 1,)`` boundary tensor per side."""
    if cu_seqlens is None:
        return None, None
    if isinstance(cu_seqlens, (str, bytes)) or not isinstance(cu_seqlens, Sequence):
        raise TypeError(
            "cu_seqlens must be None or a pair (chosen_cu_seqlens, rejected_cu_seqlens) of "
            f"(S + 1,) integer boundaries, got {describe(cu_seqlens)}"
        )
    if len(cu_seqlens) != 2:
        raise ValueError(
            "cu_seqlens must be a pair (chosen_cu_seqlens, rejected_cu_seqlens), one per side, "
            f"got {len(cu_seqlens)} entries"
        )
    return cu_seqlens[0], cu_seqlens[1]


def _per_token(
    value: ArrayLike, name: str, packed: bool, device: torch.device | None
) -> torch.Tensor:
    return token_matrix(as_float_tensor(value, name, device), name, packed)


def validate_reference(
    value: ArrayLike | None, name: str, log_probs: torch.Tensor, layout: Layout, side: str
) -> torch.Tensor | None:
    """Per-token reference log-probabilities (the log-probs' shape) or per-sequence sums."""
    if value is None:
        return None
    ref = as_float_tensor(value, name, log_probs.device)
    sequences = layout.num_sequences
    if layout.sequence_ids is None:
        if tuple(ref.shape) == tuple(log_probs.shape):
            return ref
        if ref.shape in ((sequences,), (sequences, 1)):
            return ref.reshape(sequences)
        raise ValueError(
            f"{name} must have the shape of {side} {tuple(log_probs.shape)} (per token) or "
            f"(B,) = ({sequences},) (per-sequence sums), got shape {tuple(ref.shape)}"
        )
    tokens = log_probs.shape[-1]
    if ref.shape in ((sequences,), (sequences, 1)):
        return ref.reshape(sequences)
    if ref.shape in ((tokens,), (1, tokens)):
        return ref.reshape(1, tokens)
    raise ValueError(
        f"{name} must have shape (N,) / (1, N) with N = {tokens} (per token) or (S,) = "
        f"({sequences},) (per-sequence sums) in the packed layout of {side}, got shape "
        f"{tuple(ref.shape)}"
    )


def _side(
    log_probs: ArrayLike,
    mask: ArrayLike,
    ref: ArrayLike | None,
    log_sum_sq: ArrayLike | None,
    cu_seqlens: ArrayLike | None,
    names: tuple[str, str, str, str],
    other: torch.Tensor | None = None,
) -> SideInputs:
    lp_name, mask_name, ref_name, sq_name = names
    packed = cu_seqlens is not None
    values = _per_token(log_probs, lp_name, packed, None)
    if other is not None:  # the rejected side: the chosen side's device and rows first
        check_same_device({"chosen_log_probs": other, lp_name: values})
        if not packed and values.shape[0] != other.shape[0]:
            raise ValueError(
                f"{lp_name} must hold as many rows as chosen_log_probs (one pair each): "
                f"{other.shape[0]} chosen, got shape {tuple(values.shape)}"
            )
    mask_t = token_matrix(as_mask(mask, mask_name, values.device), mask_name, packed)
    check_same_device({lp_name: values, mask_name: mask_t})
    check_shape(mask_t, mask_name, values.shape, lp_name)
    layout = sequence_layout(cu_seqlens, values)
    ref_t = validate_reference(ref, ref_name, values, layout, lp_name)
    sq_t = None
    if log_sum_sq is not None:
        sq_t = _per_token(log_sum_sq, sq_name, packed, values.device)
        check_shape(sq_t, sq_name, values.shape, lp_name)
    extra = {name: t for name, t in ((ref_name, ref_t), (sq_name, sq_t)) if t is not None}
    check_same_device({lp_name: values, **extra})
    return SideInputs(values, mask_t, ref_t, sq_t, layout)


def validate_pair_call(
    chosen: tuple[ArrayLike, ArrayLike, ArrayLike | None, ArrayLike | None],
    rejected: tuple[ArrayLike, ArrayLike, ArrayLike | None, ArrayLike | None],
    *,
    objective: object,
    nll_mask: ArrayLike | None,
    ld_alpha: Scalar | None,
    normalizer: Scalar | None,
    nll_normalizer: Scalar | None,
    cu_seqlens: object,
) -> PairCall:
    """Validate :func:`rlobjectives.preference_loss`'s arguments (names as in its signature).

    ``chosen`` / ``rejected``: ``(log_probs, mask, ref_log_probs, log_sum_sq_probs)``.
    """
    checked = check_objective(objective)
    chosen_cu, rejected_cu = _boundaries(cu_seqlens)
    c = _side(*chosen, chosen_cu, _NAMES["chosen"])
    r = _side(*rejected, rejected_cu, _NAMES["rejected"], c.log_probs)
    check_same_device({"chosen_log_probs": c.log_probs, "rejected_log_probs": r.log_probs})
    if c.layout.num_sequences != r.layout.num_sequences:
        what = "sequences" if c.layout.sequence_ids is not None else "rows"
        raise ValueError(
            f"rejected_log_probs must hold as many {what} as chosen_log_probs (one pair each): "
            f"{c.layout.num_sequences} chosen, got {r.layout.num_sequences}"
        )
    _check_reference(checked, c.ref, r.ref)
    if (c.log_sum_sq is None) != (r.log_sum_sq is None):
        missing = "chosen" if c.log_sum_sq is None else "rejected"
        raise ValueError(
            f"{missing}_log_sum_sq_probs must be given with the other side's (WPO weights the "
            "pair by both responses), got None"
        )
    nll_t = None
    if nll_mask is not None:
        nll_t = token_matrix(
            as_mask(nll_mask, "nll_mask", c.log_probs.device), "nll_mask", chosen_cu is not None
        )
        check_same_device({"chosen_log_probs": c.log_probs, "nll_mask": nll_t})
        check_shape(nll_t, "nll_mask", c.log_probs.shape, "chosen_log_probs")
    sides = (c.log_probs, r.log_probs, c.ref, r.ref, c.log_sum_sq, r.log_sum_sq)
    floating = [t for t in sides if t is not None]
    return PairCall(
        chosen=c,
        rejected=r,
        nll_mask=nll_t,
        objective=checked,
        ld_alpha=validate_ld_alpha(ld_alpha),
        normalizer=_positive(normalizer, "normalizer"),
        nll_normalizer=_positive(nll_normalizer, "nll_normalizer"),
        dtype=compute_dtype(*floating),
        output_dtype=c.log_probs.dtype,
    )


_NAMES = {
    side: (
        f"{side}_log_probs",
        f"{side}_mask",
        f"ref_{side}_log_probs",
        f"{side}_log_sum_sq_probs",
    )
    for side in ("chosen", "rejected")
}


def _positive(value: Scalar | None, name: str) -> float | torch.Tensor | None:
    if value is None:
        return None
    return validate_scalar(value, name, minimum=0.0, strict=True)


def _check_reference(objective: PreferenceObjective, ref_c: Any, ref_r: Any) -> None:
    if objective.needs_reference:
        for side, ref in (("chosen", ref_c), ("rejected", ref_r)):
            if ref is None:
                raise ValueError(
                    f"ref_{side}_log_probs is required by {objective!r} (it compares the policy "
                    "with the reference model), got None"
                )
        return
    for side, ref in (("chosen", ref_c), ("rejected", ref_r)):
        if ref is not None:
            raise ValueError(
                f"ref_{side}_log_probs must be None for {objective!r}: it is reference-free and "
                "would ignore it"
            )


class SideSums(NamedTuple):
    """Per-sequence sums of one side, each ``(B,)`` in the computation dtype."""

    sums: torch.Tensor  # S = sum_t a_t l_t (a: the mask, LD-DPO's weights with ld_alpha)
    lengths: torch.Tensor  # n, the selected tokens (float)
    ref: torch.Tensor | None  # R, the reference's S
    plain: torch.Tensor  # sum_t M l (unweighted), the NLL sum when nll_mask is None
    wpo: torch.Tensor | None  # sum_t M (l - log sum pi^2), detached (WPO)


def ld_weights(
    mask: torch.Tensor, layout: Layout, shared: torch.Tensor, alpha: float | torch.Tensor
) -> torch.Tensor:
    """LD-DPO's per-token weights: 1 on the first ``shared`` selected tokens, ``alpha`` after.

    ``shared`` ``(S,)`` is the pair's shorter response length; 0 at unselected tokens.
    """
    counts = layout.row_counts(mask)  # (S,)
    position = layout.expand(counts) - layout.local_selected_after(mask)  # (rows, T), 1-based
    inside = position <= layout.expand(shared)
    one = torch.ones((), dtype=shared.dtype, device=mask.device)
    weight = torch.where(inside, one, torch.as_tensor(alpha, dtype=shared.dtype).to(mask.device))
    return masked_fill_zero(weight, mask)


def reference_sums(
    side: SideInputs, dtype: torch.dtype, weights: torch.Tensor | None
) -> torch.Tensor | None:
    """``(B,)`` :math:`R`: the reference's sums under the side's mask (or the given sums)."""
    if side.ref is None:
        return None
    if side.ref.ndim == 1:  # per-sequence sums, given
        return side.ref.detach().to(dtype)
    selected = masked_fill_zero(side.ref.detach().to(dtype), side.mask)
    return side.layout.row_sums(selected if weights is None else selected * weights)


def side_sums(
    side: SideInputs, dtype: torch.dtype, weights: torch.Tensor | None, log_probs: torch.Tensor
) -> SideSums:
    """The per-sequence sums of ``log_probs`` (the side's, or detached ones) under the mask."""
    layout, mask = side.layout, side.mask
    selected = masked_fill_zero(log_probs.to(dtype), mask)  # (rows, T)
    plain = layout.row_sums(selected)
    sums = plain if weights is None else layout.row_sums(selected * weights)
    wpo = None
    if side.log_sum_sq is not None:
        squares = side.log_sum_sq.detach().to(dtype)
        aligned = masked_fill_zero(log_probs.detach().to(dtype) - squares, mask)
        wpo = layout.row_sums(aligned)
    lengths = layout.row_counts(mask).to(dtype)
    return SideSums(sums, lengths, reference_sums(side, dtype, weights), plain, wpo)


def pair_weights(call: PairCall) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """LD-DPO's per-token weights of the two sides (None without ``ld_alpha``)."""
    if call.ld_alpha is None:
        return None, None
    c, r = call.chosen, call.rejected
    shared = torch.minimum(c.layout.row_counts(c.mask), r.layout.row_counts(r.mask)).to(call.dtype)
    return (
        ld_weights(c.mask, c.layout, shared, call.ld_alpha),
        ld_weights(r.mask, r.layout, shared, call.ld_alpha),
    )


def nll_counts(call: PairCall) -> torch.Tensor:
    """``(B,)`` the NLL tokens of each chosen response (``nll_mask``, or the chosen mask)."""
    c = call.chosen
    mask = c.mask if call.nll_mask is None else call.nll_mask
    return c.layout.row_counts(mask)


def nll_sums(call: PairCall, log_probs: torch.Tensor, plain: torch.Tensor) -> torch.Tensor:
    """``(B,)`` :math:`U`, the chosen responses' summed log-probabilities over the NLL tokens."""
    if call.nll_mask is None:
        return plain
    c = call.chosen
    return c.layout.row_sums(masked_fill_zero(log_probs.to(call.dtype), call.nll_mask))


class Denominators(NamedTuple):
    """The pair normaliser :math:`D`, the NLL token normaliser and the valid pairs."""

    pairs: torch.Tensor  # () D
    nll_tokens: torch.Tensor  # () N_nll
    valid: torch.Tensor  # (B,) bool


def denominators(
    call: PairCall, chosen_lengths: torch.Tensor, rejected_lengths: torch.Tensor
) -> Denominators:
    """:math:`D` and :math:`N_{nll}`: the normalisers, or the counts of the valid pairs (>= 1)."""
    valid = (chosen_lengths > 0) & (rejected_lengths > 0)
    dtype, device = call.dtype, valid.device
    if call.normalizer is None:
        pairs = valid.sum().to(dtype).clamp(min=1)
    else:
        pairs = torch.as_tensor(call.normalizer, dtype=dtype, device=device)
    if call.nll_normalizer is not None:
        tokens = torch.as_tensor(call.nll_normalizer, dtype=dtype, device=device)
    elif call.objective.uses_nll:
        counts = masked_fill_zero(nll_counts(call), valid)
        tokens = counts.sum().to(dtype).clamp(min=1)
    else:
        tokens = torch.ones((), dtype=dtype, device=device)
    return Denominators(pairs, tokens, valid)


def pair_quantities(
    chosen: SideSums, rejected: SideSums, nll: torch.Tensor, totals: Denominators
) -> PairQuantities:
    """The formula's :class:`PairQuantities`: invalid pairs' sums replaced by -1."""
    valid = totals.valid
    placeholder = torch.full((), -1.0, dtype=chosen.sums.dtype, device=valid.device)

    def keep(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else torch.where(valid, values, placeholder)

    share = masked_fill_zero(-nll * (totals.pairs / totals.nll_tokens), valid)
    return PairQuantities(
        chosen=torch.where(valid, chosen.sums, placeholder),
        rejected=torch.where(valid, rejected.sums, placeholder),
        chosen_length=chosen.lengths,
        rejected_length=rejected.lengths,
        ref_chosen=keep(chosen.ref),
        ref_rejected=keep(rejected.ref),
        nll=share,
        valid=valid,
    )


def wpo_weights(chosen: SideSums, rejected: SideSums) -> torch.Tensor | None:
    r"""WPO's pair weight :math:`w_c w_r`.

    :math:`w = \exp(\sum_t M_t(\ell_t - \log\sum_v \pi_v^2) / \max(n, 1))`, detached.
    """
    if chosen.wpo is None or rejected.wpo is None:
        return None
    log_w_c = chosen.wpo / chosen.lengths.clamp(min=1)
    log_w_r = rejected.wpo / rejected.lengths.clamp(min=1)
    return torch.exp(log_w_c + log_w_r).detach()


def pair_losses(
    objective: PreferenceObjective,
    q: PairQuantities,
    totals: Denominators,
    weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, per-pair losses)``: the objective's formula, WPO's weights, the reduction."""
    losses = objective.loss(q)  # (B,)
    if weights is not None:
        losses = losses * weights
    losses = masked_fill_zero(losses, q.valid)
    return losses.sum() / totals.pairs, losses


def finish(
    call: PairCall,
    q: PairQuantities,
    totals: Denominators,
    weights: torch.Tensor | None,
) -> PreferenceLossOutput:
    """Reduce the objective's per-pair losses; the rewards, margins and accuracy."""
    loss, losses = pair_losses(call.objective, q, totals, weights)
    with torch.no_grad():
        chosen_rewards, rejected_rewards = call.objective.rewards(q)
        chosen_rewards = masked_fill_zero(chosen_rewards.detach(), q.valid)
        rejected_rewards = masked_fill_zero(rejected_rewards.detach(), q.valid)
        margins = chosen_rewards - rejected_rewards
        accuracy = (chosen_rewards > rejected_rewards).to(margins.dtype)
        chosen_sums = masked_fill_zero(q.chosen.detach(), q.valid)
        rejected_sums = masked_fill_zero(q.rejected.detach(), q.valid)
    return PreferenceLossOutput(
        loss=loss,
        pair_losses=losses,
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
        margins=margins,
        accuracy=accuracy,
        chosen_log_probs=chosen_sums,
        rejected_log_probs=rejected_sums,
    )
