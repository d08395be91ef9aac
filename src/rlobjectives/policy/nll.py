r"""The SFT / NLL term with its own reduction and normaliser: :func:`nll_loss`.

An RL step often adds a supervised term on a chosen set of tokens (the correct responses: VAPO's
positive-example LM loss, NeMo-RL ``positive_example_nll_weight``, prime-rl ``ce_scale``, SkyRL
``cross_entropy``, slime ``sft_loss_function``). It is a term of the policy objective on the
same log-probabilities, which is why it lives next to :func:`rlobjectives.policy_loss`; its
reduction and normaliser are its own (a token mean over the correct tokens is not the policy
loss's token mean), so that it stays exact under micro-batches and data parallelism with its
own global count (``docs/objectives/policy.md``, "RL + NLL on the correct responses").
"""

from __future__ import annotations

import torch

from .._core.reduction import Reduction, validate_token_reduction
from .._core.validation import ArrayLike, Scalar, checks_environment

__all__ = ["nll_loss"]


@checks_environment
def nll_loss(
    log_probs: ArrayLike,
    mask: ArrayLike,
    *,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    cu_seqlens: ArrayLike | None = None,
    context_group: object = None,
) -> torch.Tensor:
    r"""Negative log-likelihood :math:`-\ell` of the selected tokens, reduced like ``aggregate``.

    .. math::

        \mathcal{L}_{NLL} = \mathrm{reduce}_M(-\ell), \qquad
        \frac{\partial \mathcal{L}_{NLL}}{\partial \ell_{it}} = -\frac{M_{it}}{d_i D},

    with the reduction's row divisors :math:`d_i` and denominator :math:`D` of
    :func:`rlobjectives.aggregate` (``"token_mean"``: :math:`D = \sum M` or ``normalizer``).
    ``mask`` chooses the tokens (e.g. ``response_mask & (rewards > 0)[:, None]``, the correct
    responses); the reduction and the normaliser are chosen independently of the policy loss's.
    Add it to the policy loss with its coefficient: ``policy_loss(...).loss + mu *
    nll_loss(log_probs, correct, normalizer=N_correct)``; with ``normalizer`` the global count of
    the selected tokens (:func:`rlobjectives.distributed.global_normalizers` of the masks), the
    micro-batch terms add up to the full-batch term on every split and rank. Computed in float32
    (float64 for float64 input); NaN/inf at unselected tokens reach neither the value nor the
    gradient; nothing selected gives 0.

    Args:
        log_probs: ``(B, T)`` log-probabilities (packed: ``(N,)`` or ``(1, N)``), with gradient.
        mask: bool/numeric, the shape of ``log_probs``; nonzero selects the token.
        reduction: ``"token_mean"``, ``"sequence_mean"``, ``"sequence_sum_normalized"``,
            ``"length_weighted"`` or ``"none"`` (see :func:`rlobjectives.aggregate`).
        normalizer: optional positive denominator (the global count of the selected tokens for
            ``"token_mean"``, of the non-empty selected sequences for ``"sequence_mean"``).
        max_response_length: Dr. GRPO's constant for ``"sequence_sum_normalized"``.
        cu_seqlens: optional ``(S + 1,)`` boundaries of packed sequences.
        context_group: the ``torch.distributed`` process group of the ranks holding the other
            tokens of the same sequences (context parallelism, as :func:`rlobjectives.aggregate`:
            every rank returns the whole sequences' loss), or None.

    Returns:
        The loss (a scalar; ``(B, T)`` for ``"none"``, zeros at unselected tokens) in the dtype
        of ``log_probs``.

    Raises:
        ValueError: a shape or device mismatch, an unknown ``reduction``, a non-positive
            ``normalizer``, a fractional ``max_response_length`` or malformed ``cu_seqlens``.
        TypeError: non-numeric inputs.
        Also, naming ``context_group``: TypeError if it is not a ``torch.distributed`` process
            group; ValueError if this rank is not in it or no process group is initialised.

    References:
        Yue et al. 2025, VAPO, arXiv:2504.05118 Eq. 10 (the positive-example LM loss, a token
        mean over the correct responses). Peers: prime-rl ``ce_scale`` (token mean over the
        global count of ce tokens), NeMo-RL ``positive_example_nll_weight`` (a token mean over
        a micro-batch's correct tokens), SkyRL ``cross_entropy`` (a global token mean), slime
        ``sft_loss_function`` (``"sequence_mean"`` over the global sample count).

    Examples:
        >>> lp = torch.tensor([[-0.5, -1.0, -2.0], [-4.0, -4.0, -4.0]])
        >>> nll_loss(lp, torch.tensor([[1, 1, 0], [1, 0, 0]]))  # (0.5 + 1 + 4) / 3
        tensor(1.8333)

    .. versionadded:: 0.3.0
    """
    call = validate_token_reduction(
        log_probs,
        mask,
        "log_probs",
        reduction=reduction,
        normalizer=normalizer,
        max_response_length=max_response_length,
        cu_seqlens=cu_seqlens,
        context_group=context_group,
    )
    return call.finish(call.values.neg())
