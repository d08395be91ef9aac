r"""The SFT / NLL term with its own reduction and normaliser: :func:`nll_loss`.

An RL step often adds a supervised term on a chosen set of tokens (the correct responses: VAPO's
positive-example LM loss, NeMo-RL ``positive_example_nll_weight``, prime-rl ``ce_scale``, SkyRL
``cross_entropy``, slime ``sft_loss_function``). It is a term of the policy objective on the
same log-probabilities, which is why it lives next to :func:`rlobjectives.policy_loss`; its
reduction and normaliser are its own (a token mean over the correct tokens is not the policy
loss's token mean), so that it stays exact under micro-batches and data parallelism with its
own global count (``docs/objectives/policy.md``, "RL + NLL on the correct responses").

:func:`dft_loss` is the same term weighted by each token's detached probability (Dynamic
Fine-Tuning, TRL's ``SFTConfig(loss_type="dft")``).
"""

from __future__ import annotations

import torch

from .._core.masked import validate_token_reduction
from .._core.reduction import Reduction, masked_fill_zero
from .._core.validation import ArrayLike, Scalar, checks_environment, compute_dtype

__all__ = ["dft_loss", "nll_loss"]


@checks_environment
def nll_loss(
    log_probs: ArrayLike,
    mask: ArrayLike,
    *,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    group_size: int | None = None,
    group_ids: ArrayLike | None = None,
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
        reduction: a reduction of :func:`rlobjectives.aggregate` (``"token_mean"``, ...,
            ``"prompt_mean"``, ``"none"``).
        normalizer: optional positive denominator (the global count of the selected tokens for
            ``"token_mean"``, of the non-empty selected sequences for ``"sequence_mean"``).
        max_response_length: Dr. GRPO's constant for ``"sequence_sum_normalized"``.
        group_size: ``"prompt_mean"``'s prompt groups (contiguous), or ``group_ids``: one label
            per sequence (as :func:`rlobjectives.aggregate`).
        group_ids: see ``group_size``.
        cu_seqlens: optional ``(S + 1,)`` boundaries of packed sequences.
        context_group: the ``torch.distributed`` process group of the ranks holding the other
            tokens of the same sequences (context parallelism, as :func:`rlobjectives.aggregate`:
            every rank returns the whole sequences' loss), or None.

    Returns:
        The loss (a scalar; ``(B, T)`` for ``"none"``, zeros at unselected tokens) in the dtype
        of ``log_probs``.

    Raises:
        ValueError: a shape or device mismatch, an unknown ``reduction``, a non-positive
            ``normalizer``, a fractional ``max_response_length``, ``"prompt_mean"`` without its
            groups, or malformed ``cu_seqlens``.
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
        group_size=group_size,
        group_ids=group_ids,
    )
    return call.finish(call.values.neg())


@checks_environment
def dft_loss(
    log_probs: ArrayLike,
    mask: ArrayLike,
    *,
    reduction: Reduction = "token_mean",
    normalizer: Scalar | None = None,
    max_response_length: Scalar | None = None,
    group_size: int | None = None,
    group_ids: ArrayLike | None = None,
    cu_seqlens: ArrayLike | None = None,
    context_group: object = None,
) -> torch.Tensor:
    r"""Dynamic Fine-Tuning: the NLL of each token weighted by its detached probability.

    .. math::

        \mathcal{L}_{DFT} = \mathrm{reduce}_M\big(-\mathrm{sg}(p_{it})\,\ell_{it}\big),
        \qquad p_{it} = e^{\ell_{it}}, \qquad
        \frac{\partial \mathcal{L}_{DFT}}{\partial \ell_{it}} = -\frac{M_{it}\,p_{it}}{d_i D},

    the SFT gradient rescaled by the probability of each target token (the implicit reward of
    SFT seen as a policy gradient, corrected), reduced by the reductions of
    :func:`rlobjectives.aggregate` with its own ``normalizer``. The probability is formed from
    the selected log-probabilities only, in float32 (float64 for float64 input): NaN/inf at
    unselected tokens reach neither the value nor the gradient; nothing selected gives 0. A
    selected :math:`\ell = -\infty` gives NaN (as TRL).

    Peer: TRL 1.16 ``SFTConfig(loss_type="dft")``: ``-log_probs * log_probs.exp().detach()``
    summed over the label tokens and divided by ``num_items_in_batch`` (times the processes
    with ``average_tokens_across_devices``), else by the micro-batch's label tokens:
    ``dft_loss(log_probs, labels != -100, normalizer=num_items_in_batch / num_processes)``
    (``presets.trl_sft_loss``).

    Args:
        log_probs: ``(B, T)`` log-probabilities of the target tokens (packed: ``(N,)`` or
            ``(1, N)``), with gradient.
        mask: bool/numeric, the shape of ``log_probs``; nonzero selects the token.
        reduction: a reduction of :func:`rlobjectives.aggregate`.
        normalizer: optional positive denominator (the global count of the selected tokens for
            ``"token_mean"``).
        max_response_length: Dr. GRPO's constant for ``"sequence_sum_normalized"``.
        group_size: ``"prompt_mean"``'s groups (contiguous), or ``group_ids`` (one label per
            sequence).
        group_ids: see ``group_size``.
        cu_seqlens: optional ``(S + 1,)`` boundaries of packed sequences.
        context_group: the process group of the ranks holding the other tokens of the same
            sequences (context parallelism, as :func:`rlobjectives.aggregate`), or None.

    Returns:
        The loss (a scalar; ``(B, T)`` for ``"none"``, zeros at unselected tokens) in the dtype
        of ``log_probs``.

    Raises:
        ValueError: as :func:`nll_loss` (shapes, devices, reduction, normaliser, groups,
            ``cu_seqlens``, ``context_group``).
        TypeError: non-numeric inputs or a ``context_group`` that is not a process group.

    References:
        Wu et al. 2025, "On the Generalization of SFT: A Reinforcement Learning Perspective
        with Reward Rectification", arXiv:2508.05629 Eq. 9 (the DFT loss).

    Examples:
        >>> lp = torch.log(torch.tensor([[0.5, 0.25, 1.0], [0.1, 1.0, 1.0]]))
        >>> dft_loss(lp, torch.tensor([[1, 1, 0], [0, 0, 0]]))  # (0.5 ln 2 + 0.25 ln 4) / 2
        tensor(0.3466)

    .. versionadded:: 0.4.0
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
        group_size=group_size,
        group_ids=group_ids,
    )
    log_probs_t = call.values
    dtype = compute_dtype(log_probs_t)
    selected = masked_fill_zero(log_probs_t.to(dtype), call.mask)  # (B, T), 0 unselected
    per_token = -(selected.exp().detach() * selected)  # -sg(p) l
    return call.finish(per_token)  # half precision: reduced in float32, rounded once
