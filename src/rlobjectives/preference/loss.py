r"""The preference loss on per-token log-probabilities: :func:`preference_loss`."""

from __future__ import annotations

from .._core.validation import ArrayLike, Scalar, checks_environment
from .inputs import (
    PairCall,
    PreferenceLossOutput,
    denominators,
    finish,
    nll_sums,
    pair_quantities,
    pair_weights,
    side_sums,
    validate_pair_call,
    wpo_weights,
)
from .objectives.base import PreferenceObjective
from .objectives.margin import DPO

__all__ = ["preference_loss", "run_pair_call"]


def run_pair_call(call: PairCall) -> PreferenceLossOutput:
    """The loss of a validated call: sums, quantities, the objective's formula, reduction."""
    weights_c, weights_r = pair_weights(call)
    chosen = side_sums(call.chosen, call.dtype, weights_c, call.chosen.log_probs)
    rejected = side_sums(call.rejected, call.dtype, weights_r, call.rejected.log_probs)
    totals = denominators(call, chosen.lengths, rejected.lengths)
    nll = nll_sums(call, call.chosen.log_probs, chosen.plain)
    q = pair_quantities(chosen, rejected, nll, totals)
    return finish(call, q, totals, wpo_weights(chosen, rejected))


@checks_environment
def preference_loss(
    chosen_log_probs: ArrayLike,
    rejected_log_probs: ArrayLike,
    chosen_mask: ArrayLike,
    rejected_mask: ArrayLike,
    *,
    ref_chosen_log_probs: ArrayLike | None = None,
    ref_rejected_log_probs: ArrayLike | None = None,
    objective: PreferenceObjective = DPO(beta=0.1),  # noqa: B008 - a frozen dataclass
    nll_mask: ArrayLike | None = None,
    ld_alpha: Scalar | None = None,
    chosen_log_sum_sq_probs: ArrayLike | None = None,
    rejected_log_sum_sq_probs: ArrayLike | None = None,
    normalizer: Scalar | None = None,
    nll_normalizer: Scalar | None = None,
    cu_seqlens: tuple[ArrayLike, ArrayLike] | None = None,
) -> PreferenceLossOutput:
    r"""A preference loss (DPO and its family, SimPO, ORPO, CPO, ...) on per-token log-probs.

    Per pair :math:`i` the chosen and rejected responses' log-probabilities are summed over
    their selected tokens, :math:`S = \sum_t M_t a_t \ell_t` (:math:`a_t = 1`, or LD-DPO's
    weight: 1 on the first :math:`\min(n_c, n_r)` tokens and ``ld_alpha`` after), with the
    reference's :math:`R` alike; the objective's formula gives the pair's loss :math:`L_i`
    (``objective.loss``, its docstring) and

    .. math::

        \mathcal{L} = \frac{1}{D}\sum_{i\ \text{valid}} w_i L_i, \qquad
        \mathrm{nll}_i = -\frac{D}{N_{nll}}\sum_{t} N_t \ell_{c,t},

    :math:`D` = ``normalizer`` (default: the valid pairs, both responses non-empty),
    :math:`w_i` WPO's constant weight (given the :math:`\log\sum_v\pi_v^2`, else 1), ``nll``
    the NLL share of ORPO / CPO / SFT over ``nll_mask`` (default the chosen mask), :math:`N_{nll}`
    = ``nll_normalizer`` (default their count); ``docs/objectives/preference.md``. NaN/inf at
    unselected tokens reach nothing; a pair with an empty response gives 0 everywhere.

    Args:
        chosen_log_probs: ``(B, T_c)`` per-token log-probabilities (packed ``(N_c,)``).
        rejected_log_probs: ``(B, T_r)`` of the rejected responses (packed ``(N_r,)``).
        chosen_mask: bool/numeric, ``chosen_log_probs``' shape: the response tokens.
        rejected_mask: the same for the rejected responses.
        ref_chosen_log_probs: the reference's, per token or summed ``(B,)``; required by the
            reference-based objectives, refused by SimPO, ORPO, CPO, SFT.
        ref_rejected_log_probs: the same for the rejected responses.
        objective: ``DPO(...)``, ``IPO``, ..., ``SFT`` or a weighted sum of them.
        nll_mask: the chosen responses' NLL tokens (e.g. prompt and response for TRL's ORPO).
        ld_alpha: LD-DPO's :math:`\alpha \in [0, 1]` (TRL ``ld_alpha``), or None.
        chosen_log_sum_sq_probs: per-token :math:`\log\sum_v\pi_v^2` of the chosen responses
            (WPO; TRL ``use_weighting``), with the rejected ones, or None.
        rejected_log_sum_sq_probs: the same for the rejected responses.
        normalizer: :math:`D`, the global count of valid pairs for exact micro-batches.
        nll_normalizer: :math:`N_{nll}`, the global count of NLL tokens.
        cu_seqlens: packed layout: ``(chosen_cu_seqlens, rejected_cu_seqlens)``, each
            ``(B + 1,)``; the sequences of the two sides pair up in order.

    Returns:
        :class:`PreferenceLossOutput` ``(loss, pair_losses, chosen_rewards, rejected_rewards,
        margins, accuracy, chosen_log_probs, rejected_log_probs)``: a scalar loss in the
        chosen log-probabilities' dtype, ``(B,)`` per-pair values in the computation dtype.

    Raises:
        ValueError: shapes, devices, a missing (or refused) reference, one side's
            ``log_sum_sq_probs`` alone, values out of range, malformed ``cu_seqlens`` (named).
        TypeError: non-numeric inputs, ``objective`` not a preference objective.

    References:
        DPO arXiv:2305.18290; LD-DPO arXiv:2409.06411 Eq. 9; WPO arXiv:2406.11827 Eq. 2.

    Examples:
        >>> import torch
        >>> lp = torch.tensor([[-1.0, -2.0]]); mask = torch.ones(1, 2, dtype=torch.bool)
        >>> out = preference_loss(lp, lp - 1, mask, mask, ref_chosen_log_probs=lp,
        ...                       ref_rejected_log_probs=lp, objective=DPO(beta=0.5))
        >>> round(out.loss.item(), 4)  # -log sigmoid(0.5 * (0 - (-2))) = softplus(-1)
        0.3133

    .. versionadded:: 0.3.0
    """
    call = validate_pair_call(
        (chosen_log_probs, chosen_mask, ref_chosen_log_probs, chosen_log_sum_sq_probs),
        (rejected_log_probs, rejected_mask, ref_rejected_log_probs, rejected_log_sum_sq_probs),
        objective=objective,
        nll_mask=nll_mask,
        ld_alpha=ld_alpha,
        normalizer=normalizer,
        nll_normalizer=nll_normalizer,
        cu_seqlens=cu_seqlens,
    )
    out = run_pair_call(call)
    return out._replace(loss=out.loss.to(call.output_dtype))
