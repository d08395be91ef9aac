r"""The single-process functions with the statistics or selections of every rank's tokens.

:func:`global_masked_whiten` (whitening statistics of all ranks), :func:`global_top_entropy_mask`
(the entropy quantile of all ranks), :func:`global_m2po_mask` and :func:`global_cov_selection`
(M2PO's kept tokens and the Cov selections of the global batch). Each is a collective that every
rank of ``group`` must call; without an initialised process group each is its single-process
function. The collectives behind them: :mod:`rlobjectives.distributed.collectives`,
:mod:`~rlobjectives.distributed.entropy`, :mod:`~rlobjectives.distributed.selection`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._core.validation import ArrayLike, Scalar, checks_environment
from ..policy.surrogates.cov import ClipCov, CovSelection, KLCov
from ..selection.batch import cov_selection, m2po_mask
from .collectives import process_group_active, whiten_over_ranks
from .entropy import top_entropy_mask_over_ranks
from .selection import cov_selection_over_ranks, m2po_mask_over_ranks

__all__ = [
    "global_cov_selection",
    "global_m2po_mask",
    "global_masked_whiten",
    "global_top_entropy_mask",
]


@checks_environment
def global_masked_whiten(
    values: ArrayLike,
    mask: ArrayLike,
    *,
    group: dist.ProcessGroup | None = None,
    shift_mean: bool = True,
    unbiased: bool = True,
    eps: Scalar = 1e-8,
) -> torch.Tensor:
    r""":func:`rlobjectives.masked_whiten` with the statistics of every rank's selected values.

    Each rank passes its shard (any shape, e.g. its ``(B, T)`` GAE advantages). With
    :math:`N = \sum_r N_r` the selected entries of all ranks of ``group``, :math:`\mu` their
    mean and :math:`\sigma^2` their variance (divisor :math:`N - 1` when ``unbiased``, as verl;
    :math:`N` otherwise, as OpenRLHF), every rank returns

    .. math::

        w = (x - \mu)\,(\sigma^2 + \epsilon)^{-1/2} \;(+\,\mu \text{ when }
        \texttt{shift\_mean=False}),

    exactly what :func:`rlobjectives.masked_whiten` gives on the concatenation of all shards.
    Each rank computes its local ``[count, mean, M2]`` in float64 and writes it into its row of
    a zero ``(W, 3)`` tensor; **one** ``all_reduce(SUM)`` gathers the rows (adding zeros is
    exact), and the rows are combined with Chan et al.'s pairwise formula, which has no
    cancellation. Without an initialised process group the local statistics are used (equal to
    :func:`rlobjectives.masked_whiten`). It is a collective: every rank of ``group`` must call
    it, also with nothing selected.

    The statistics are data preparation, as in every peer (advantage whitening runs under
    ``torch.no_grad`` there): the result is computed without autograd and has no gradient.

    Args:
        values: this rank's values, any shape.
        mask: bool or numeric, the shape of ``values``; nonzero selects the entry.
        group: the data-parallel process group (None: the default group).
        shift_mean: False adds the global mean back after scaling.
        unbiased: Bessel-corrected global variance (verl); False for the population variance.
        eps: :math:`\epsilon \ge 0` added to the variance.

    Returns:
        The whitened values, the shape of ``values``, zeros at unselected entries, float32
        (float64 for float64 input), on the device of ``values``; no gradient.

    Raises:
        ValueError: if ``mask`` has another shape or device, ``eps`` is negative/non-finite, or
            ``group`` is given without an initialised process group.
        TypeError: on non-numeric inputs or non-bool ``shift_mean``/``unbiased``.

    References:
        Chan, Golub and LeVeque 1979, "Updating formulae and a pairwise algorithm for computing
        sample variances"; Hu et al. 2025, REINFORCE++, arXiv:2501.03262 Eq. 10 (global batch
        normalization); verl ``masked_whiten``.

    Examples:
        >>> import torch
        >>> global_masked_whiten(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 1, 1]))
        tensor([-1.,  0.,  1.])

    .. versionadded:: 0.2.0
    """
    return whiten_over_ranks(
        values, mask, group=group, shift_mean=shift_mean, unbiased=unbiased, eps=eps
    )


@checks_environment
def global_top_entropy_mask(
    entropy: ArrayLike,
    mask: ArrayLike,
    *,
    quantile: float,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    r""":func:`rlobjectives.top_entropy_mask` with the quantile over the tokens of every rank.

    .. math::

        K^{(r)}_{it} = M^{(r)}_{it} \wedge \big(H^{(r)}_{it} \ge
            Q_q(\{H^{(s)}_{js} : M^{(s)}_{js},\ s = 1..W\})\big)

    The threshold is the linear-interpolation quantile of the selected entropies of all ``W``
    ranks of ``group`` (TRL's ``get_high_entropy_mask`` with several processes, which gathers
    them); each rank gets the mask of its own tokens. One ``all_gather`` of the per-rank counts
    (read on the host to size the next one), one of the entropies padded with ``+inf``, one
    ``all_reduce`` of the count. Without an initialised process group it is
    :func:`rlobjectives.top_entropy_mask`. It is a collective: every rank must call it (a rank
    with nothing selected too). TRL's ``top_entropy_quantile=ρ`` is ``quantile=1 - ρ``.

    Args:
        entropy: ``(B, T)`` this rank's per-token entropies (B and T may differ between ranks;
            the dtype must be the same on every rank).
        mask: ``(B, T)`` bool/numeric; nonzero selects the token.
        quantile: the quantile level :math:`q`, ``0 <= q <= 1`` (a Python number).
        group: the data-parallel process group (None: the default group).

    Returns:
        ``(B, T)`` bool mask, a subset of ``mask``; the threshold is the same on every rank.

    Raises:
        ValueError: as :func:`rlobjectives.top_entropy_mask`, or ``group`` given without an
            initialised process group.
        TypeError: on non-numeric inputs.

    References:
        Wang et al. 2025, arXiv:2506.01939 Sec. 4; TRL ``GRPOTrainer.get_high_entropy_mask``.

    Examples:
        >>> import torch
        >>> entropy = torch.tensor([[0.5, 2.0, 1.0]])
        >>> global_top_entropy_mask(entropy, torch.ones(1, 3), quantile=0.5)  # one process
        tensor([[False,  True,  True]])

    .. versionadded:: 0.2.0
    """
    active = process_group_active(group)
    return top_entropy_mask_over_ranks(entropy, mask, quantile=quantile, group=group, active=active)


@checks_environment
def global_m2po_mask(
    log_ratio: ArrayLike,
    mask: ArrayLike,
    *,
    threshold: Scalar = 0.04,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    r""":func:`rlobjectives.m2po_mask` over the selected tokens of every rank.

    M2PO's kept tokens of the global batch (the ranks' batches concatenated in rank order): the
    fewest largest :math:`\Delta^2` of all ranks are masked so that the second moment of the
    kept ones is below ``threshold``, and each rank gets the mask of its own tokens; ties are
    broken by the rank, then the row-major position. One ``all_gather`` of the per-rank counts
    (read on the host to size the next one) and one of the squared log-ratios (in float32,
    float64 for float64 input: the dtype must be the same on every rank); every rank then runs
    the same sort. Without an initialised process group it is :func:`rlobjectives.m2po_mask`.
    It is a collective: every rank must call it (a rank with nothing selected too). AReaL
    computes M2PO per micro-batch and rank; this makes it independent of the split. Pass the
    result as the ``mask`` of :func:`rlobjectives.policy_loss` with the surrogate on the kept
    tokens (``Clip(low=None)`` for the paper's :math:`rA`, ``Clip(low=eps_clip)`` for AReaL's),
    with the global kept count as the ``normalizer`` (:func:`global_normalizers` of the masks).

    Args:
        log_ratio: ``(B, T)`` (or ``(N,)``) this rank's log-ratios (shapes may differ between
            ranks).
        mask: the shape of ``log_ratio``, bool/numeric; nonzero selects the token.
        threshold: :math:`\tau > 0` (AReaL ``m2_threshold``; the paper's 0.04).
        group: the data-parallel process group (None: the default group).

    Returns:
        bool mask of this rank's kept tokens, the shape of ``log_ratio``; no gradient.

    Raises:
        ValueError: as :func:`rlobjectives.m2po_mask`, or ``group`` given without an initialised
            process group.
        TypeError: on non-numeric inputs.

    References:
        Zheng et al. 2025, M2PO, arXiv:2510.01161; AReaL ``_get_m2po_loss_mask``.

    Examples:
        >>> import torch
        >>> # suffix means of the sorted squares 1, .25, .09, .01: .3375, .1167, .05, .01 < .04
        >>> global_m2po_mask(torch.tensor([[0.1, -0.5, 0.3, 1.0]]), torch.ones(1, 4))
        tensor([[ True, False, False, False]])

    .. versionadded:: 0.3.0
    """
    if not process_group_active(group):
        return m2po_mask(log_ratio, mask, threshold=threshold)
    return m2po_mask_over_ranks(log_ratio, mask, threshold=threshold, group=group)


@checks_environment
def global_cov_selection(
    log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    surrogate: ClipCov | KLCov,
    log_ratio_bound: Scalar | None = 20.0,
    group: dist.ProcessGroup | None = None,
) -> CovSelection:
    r""":func:`rlobjectives.cov_selection` over the selected tokens of every rank.

    The tokens a :class:`~rlobjectives.ClipCov` / :class:`~rlobjectives.KLCov` acts on in the
    global batch (the ranks' batches concatenated in rank order): the covariance
    :math:`(A_t - \bar A)(\ell_t - \bar\ell)` with the global means, :math:`k =
    \max(\lfloor\rho N\rfloor, 1)` of the global count :math:`N`, KL-Cov's global top-k
    (ties by rank, then position), Clip-Cov's :math:`\min(k, n)` of the global candidates drawn
    with one seed from rank 0's ``surrogate.generator`` (or its default generator), keyed by
    each token's global ordinal: the single-process selection of the concatenated batch with
    that seed. One ``all_reduce`` of :math:`(\sum A, \sum\ell, N)`, ``all_gather`` of counts
    and of the padded scores (Clip-Cov also one ``broadcast`` of the seed). Without an
    initialised process group it is :func:`rlobjectives.cov_selection`. It is a collective:
    every rank must call it. verl and SkyRL select per micro-batch and rank; this makes the
    selection independent of the split. Hand it to the object:
    ``policy_loss(..., surrogate=dataclasses.replace(surrogate, selection=result.selected))``.

    Args:
        log_probs: ``(B, T)`` this rank's current log-probabilities (detached here).
        old_log_probs: ``(B, T)`` behaviour log-probabilities.
        advantages: ``(B,)``, ``(B, 1)`` or ``(B, T)``.
        mask: ``(B, T)`` bool/numeric; nonzero selects the token.
        surrogate: a :class:`~rlobjectives.ClipCov` or :class:`~rlobjectives.KLCov` without a
            ``selection``.
        log_ratio_bound: as :func:`rlobjectives.policy_loss`.
        group: the data-parallel process group (None: the default group).

    Returns:
        :class:`~rlobjectives.CovSelection` of this rank's tokens (``count`` is the global
        :math:`k`); no gradient.

    Raises:
        ValueError / TypeError: as :func:`rlobjectives.cov_selection`, a surrogate with a
            ``selection``, or ``group`` given without an initialised process group.

    References:
        Cui et al. 2025, arXiv:2505.22617 (Clip-Cov, KL-Cov).

    .. versionadded:: 0.3.0
    """
    if not process_group_active(group):
        return cov_selection(
            log_probs,
            old_log_probs,
            advantages,
            mask,
            surrogate=surrogate,
            log_ratio_bound=log_ratio_bound,
        )
    return cov_selection_over_ranks(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        surrogate=surrogate,
        log_ratio_bound=log_ratio_bound,
        group=group,
    )
