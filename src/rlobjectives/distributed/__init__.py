r"""Global normalisers for exact losses under data parallelism and gradient accumulation.

An optimizer step usually sees its batch in pieces: ``W`` data-parallel ranks, each running
``M`` micro-batches (gradient accumulation). A loss whose denominator is computed per piece
(each micro-batch divides by its own token count, or by ``M``) weights tokens differently
depending on how the batch was cut, so long and short responses get different weights and
gradients shrink or grow with the split. The cure is to count once, before the micro-batch
loop, over every micro-batch of the step and every rank, and to pass that count as the
``normalizer`` of every micro-batch loss: the micro-batch losses are then *additive*, and their
sum over micro-batches and ranks is the full-batch loss.

.. math::

    \mathcal{L}_{\text{full}} = \sum_{r=1}^{W} \sum_{m=1}^{M}
        \frac{\sum_{(i, t) \in \text{piece}_{rm}} M_{it} L_{it}}{N_{\text{global}}}

Data-parallel wrappers (``DistributedDataParallel``, FSDP with its default settings) *average*
gradients over the ``W`` ranks, so each rank must multiply its loss by ``W``
(:func:`data_parallel_loss_scale`) to obtain the gradient of the sum. The full recipe, with
the reasoning and the bugs it avoids, is in ``docs/distributed/data-parallel.md``; context
parallelism (``context_group=``) in ``docs/distributed/context-parallel.md``.

Example (one optimizer step on one rank)::

    counts = global_normalizers([mb.mask for mb in micro_batches], group=dp_group)
    normalizer = normalizer_for_reduction(counts, reduction="token_mean")
    scale = data_parallel_loss_scale(group=dp_group)
    diagnostics = []
    for k, mb in enumerate(micro_batches):
        with model.no_sync() if k < len(micro_batches) - 1 else contextlib.nullcontext():
            out = policy_loss(..., reduction="token_mean", normalizer=normalizer,
                              diagnostics_normalizer=normalizer)
            (out.loss * scale).backward()
        diagnostics.append(out.diagnostics)
    optimizer.step()
    step_diagnostics = sum_diagnostics(diagnostics, group=dp_group)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypeVar

import torch
import torch.distributed as dist

from .._core.reduction import REDUCTIONS
from .._core.validation import (
    ArrayLike,
    Scalar,
    canonical_reduction,
    checks_environment,
    validate_choice,
)
from ..policy.surrogates.cov import ClipCov, CovSelection, KLCov
from ..selection.batch import cov_selection, m2po_mask
from .collectives import (
    count_over_ranks,
    process_group_active,
    sum_over_ranks,
    whiten_over_ranks,
)
from .entropy import top_entropy_mask_over_ranks
from .selection import cov_selection_over_ranks, m2po_mask_over_ranks

__all__ = [
    "Normalizers",
    "data_parallel_loss_scale",
    "global_cov_selection",
    "global_m2po_mask",
    "global_masked_whiten",
    "global_normalizers",
    "global_top_entropy_mask",
    "normalizer_for_reduction",
    "sum_diagnostics",
]

_DiagnosticsT = TypeVar("_DiagnosticsT", bound=tuple[torch.Tensor, ...])


class Normalizers(NamedTuple):
    r"""Selected-token and sequence counts of one optimizer step, over all micro-batches and ranks.

    All three are 0-d ``int64`` tensors on the device the counts were reduced on; they are
    exact integer counts (no rounding, whatever the batch size) and identical on every rank.

    Attributes:
        tokens: :math:`N = \sum_{it} M_{it}`, the number of selected tokens: the
            ``normalizer`` of ``reduction="token_mean"`` and the ``diagnostics_normalizer`` of
            :func:`rlobjectives.policy_loss` (via :func:`normalizer_for_reduction`, which
            raises a zero count to 1).
        sequences_nonempty: :math:`S = \\#\\{i : \sum_t M_{it} > 0\\}`, the number of sequences
            with at least one selected token: the ``normalizer`` of ``"sequence_mean"``.
        sequences: :math:`B`, the number of sequences (rows), empty ones included: the
            ``normalizer`` of ``"sequence_sum_normalized"`` (Dr. GRPO).
    """

    tokens: torch.Tensor
    sequences_nonempty: torch.Tensor
    sequences: torch.Tensor


@checks_environment
def global_normalizers(
    masks: Sequence[ArrayLike] | torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    cu_seqlens: Sequence[ArrayLike | None] | torch.Tensor | None = None,
    context_group: dist.ProcessGroup | None = None,
) -> Normalizers:
    r"""Count selected tokens and sequences over all micro-batches of a step and all ranks.

    Call it once per optimizer step, before the micro-batch loop, with the masks of *every*
    micro-batch this rank will process in the step. With :math:`M^{(r, m)}` the mask of
    micro-batch :math:`m` on rank :math:`r`:

    .. math::

        N = \sum_{r, m} \sum_{it} M^{(r, m)}_{it}, \qquad
        S = \sum_{r, m} \#\{i : \textstyle\sum_t M^{(r, m)}_{it} > 0\}, \qquad
        B = \sum_{r, m} B^{(r, m)}.

    The local counts are stacked into one ``int64`` 3-vector and summed over the ranks with a
    single ``all_reduce(SUM)`` on ``group`` (the default group when None). Without an
    initialised process group the local counts are returned (the single-process case), so the
    same training code runs with and without ``torch.distributed``. Every rank of the group must
    call this function (it is a collective), even a rank without micro-batches (pass ``[]``).

    Micro-batches may have different padded lengths :math:`T`; only the masks are read (no
    log-probabilities), so NaN/inf in padded values cannot reach the counts. Packed
    micro-batches (``cu_seqlens``) count their :math:`S` sequences instead of rows.

    Data x context parallelism (``context_group``, ``docs/distributed/context-parallel.md``):
    the ranks of ``context_group`` hold parts of the same sequences (each rank its own tokens,
    the same ``S`` sequences per micro-batch), ``group`` is the data-parallel group (one rank of
    each context group). Each sequence's count is summed over ``context_group`` first (one
    all-reduce of the concatenated ``(S,)`` counts of the micro-batches), so a sequence split
    across ranks counts once in :math:`S` and :math:`B`, and its tokens once in :math:`N`;
    then the three totals over ``group``. Every rank of both groups gets the counts of the
    whole step; pass them as the ``normalizer`` of calls made with the same
    ``context_group``.

    Args:
        masks: one ``(B, T)`` mask (bool or numeric, nonzero selects the token) per micro-batch
            of this rank for the step, as a list/tuple; or a single ``(B, T)`` mask (one
            micro-batch). Shapes may differ between micro-batches.
        group: the data-parallel process group to sum over (None: the default group). With
            tensor/pipeline parallelism pass the data-parallel group only: ranks that see the
            same tokens must not count them twice.
        device: where to count and reduce; None uses the device of the first mask (CPU if
            there is none). With the NCCL backend this must be the rank's CUDA device.
        cu_seqlens: for packed micro-batches, the ``(S + 1,)`` boundaries of each mask (a
            list parallel to ``masks``, None for a padded one; for a single mask tensor, its
            boundaries); their masks are ``(N,)`` or ``(1, N)``.
        context_group: the context-parallel group of this rank (the ranks holding the other
            tokens of its sequences), or None. With it, ``group`` must be the data-parallel
            group: it shares exactly this rank with ``context_group``.

    Returns:
        :class:`Normalizers` ``(tokens, sequences_nonempty, sequences)``: 0-d ``int64``
        tensors, identical on every rank.

    Raises:
        TypeError: if ``masks`` is neither a tensor nor a list/tuple, or holds non-numeric data.
        ValueError: if a mask is not 2-D (packed: ``(N,)`` / ``(1, N)``), masks are on
            different devices, ``cu_seqlens`` does not match ``masks`` or is malformed,
            ``group`` or ``context_group`` is given without an initialised process group, or
            ``group`` shares ranks other than this one with ``context_group``.
        Also, naming ``context_group``: TypeError if it is not a ``torch.distributed`` process
            group; ValueError if this rank is not in it or no process group is initialised.

    References:
        Global token normalisation over the optimizer-step window: Yu et al. 2025, DAPO,
        arXiv:2503.14476 Eq. 8 (token-level loss); the per-micro-batch alternative is the bug
        class of huggingface/trl #3021, #3231 and verl-project/verl #5625, #7321.

    Examples:
        >>> import torch
        >>> counts = global_normalizers([torch.tensor([[1, 1, 0], [0, 0, 0]]),
        ...                              torch.tensor([[1, 0], [1, 1], [1, 0]])])
        >>> [int(count) for count in counts]
        [6, 4, 5]

    .. versionadded:: 0.1.0
    """
    tokens, nonempty, sequences = count_over_ranks(
        masks, group=group, device=device, cu_seqlens=cu_seqlens, context_group=context_group
    )
    return Normalizers(tokens=tokens, sequences_nonempty=nonempty, sequences=sequences)


@checks_environment
def normalizer_for_reduction(normalizers: Normalizers, *, reduction: str) -> torch.Tensor:
    r"""The ``normalizer`` to pass to a loss for ``reduction``, from the global counts.

    - ``"token_mean"``: ``normalizers.tokens`` (:math:`N`).
    - ``"sequence_mean"``: ``normalizers.sequences_nonempty`` (:math:`S`).
    - ``"sequence_sum_normalized"``: ``normalizers.sequences`` (:math:`B`); also pass the same
      explicit ``max_response_length`` :math:`C` to every micro-batch (the default, the padded
      length :math:`T` of each micro-batch, differs between micro-batches).
    - ``"length_weighted"``: ``normalizers.sequences`` (:math:`B`).

    A count of zero (nothing selected anywhere in the step) is raised to 1: every numerator is
    then 0 and the loss is 0, as in the full-batch reductions (0/0 gives 0), instead of an
    error for a non-positive ``normalizer``.

    Args:
        normalizers: the result of :func:`global_normalizers`.
        reduction: ``"token_mean"``, ``"sequence_mean"``, ``"sequence_sum_normalized"`` or
            ``"length_weighted"``.

    Returns:
        A 0-d ``int64`` tensor :math:`\max(\text{count}, 1)`, on the device of ``normalizers``.

    Raises:
        ValueError: for an unknown reduction, ``"none"`` (which takes no normalizer) or
            ``"prompt_mean"`` (its count is of prompts, not given by the masks).
        TypeError: if ``normalizers`` is not a :class:`Normalizers`.

    Examples:
        >>> import torch
        >>> counts = global_normalizers(torch.tensor([[1, 1, 0], [0, 0, 0]]))
        >>> int(normalizer_for_reduction(counts, reduction="sequence_sum_normalized"))
        2

    .. versionadded:: 0.1.0
    """
    if not isinstance(normalizers, Normalizers):
        raise TypeError(
            "normalizers must be the Normalizers returned by global_normalizers, got "
            f"{type(normalizers).__name__}"
        )
    # peers' spellings: alias or "did you mean"
    name = validate_choice(canonical_reduction(reduction), "reduction", REDUCTIONS)
    if name == "none":
        raise ValueError(
            "reduction='none' takes no normalizer (it returns the (B, T) per-token values); "
            "expected one of ['token_mean', 'sequence_mean', 'sequence_sum_normalized', "
            "'length_weighted']"
        )
    if name == "prompt_mean":
        raise ValueError(
            "reduction='prompt_mean' divides by prompt counts, which the masks alone do not "
            "give: pass as normalizer the number of prompts with a selected token over every "
            "micro-batch and rank (an all_reduce of the local counts), or every prompt (SkyRL)"
        )
    count = {
        "token_mean": normalizers.tokens,
        "sequence_mean": normalizers.sequences_nonempty,
        "sequence_sum_normalized": normalizers.sequences,
        "length_weighted": normalizers.sequences,
    }[name]
    return count.clamp(min=1)


@checks_environment
def data_parallel_loss_scale(*, group: dist.ProcessGroup | None = None) -> int:
    r"""The factor :math:`W` each rank multiplies its loss by when gradients are averaged.

    ``DistributedDataParallel`` and FSDP (both ``FullyShardedDataParallel`` and
    ``fully_shard`` with their default settings) divide the summed gradient by the number of
    data-parallel ranks :math:`W`. With a global ``normalizer`` each rank's loss is already its
    share of the full-batch loss, so the averaged gradient would be :math:`1/W` of the
    full-batch gradient; multiplying every rank's loss by :math:`W` undoes the average:

    .. math::

        \frac{1}{W} \sum_{r=1}^{W} \nabla (W \mathcal{L}_r)
        = \nabla \sum_{r=1}^{W} \mathcal{L}_r = \nabla \mathcal{L}_{\text{full}}.

    Do not multiply when the gradients are summed rather than averaged (for example a manual
    ``all_reduce(SUM)`` of the gradients, or FSDP with a gradient divide factor of 1).

    Args:
        group: the data-parallel process group the wrapper averages over (None: the default
            group).

    Returns:
        ``torch.distributed.get_world_size(group)``, or 1 without an initialised process group.

    Raises:
        ValueError: if ``group`` is given without an initialised process group.

    Examples:
        >>> data_parallel_loss_scale()  # no process group: single process
        1

    .. versionadded:: 0.1.0
    """
    if not process_group_active(group):
        return 1
    return int(dist.get_world_size(group))


@checks_environment
def sum_diagnostics(
    diagnostics: Sequence[_DiagnosticsT] | _DiagnosticsT,
    *,
    group: dist.ProcessGroup | None = None,
) -> _DiagnosticsT:
    r"""Sum additive diagnostics over this rank's micro-batches and over all ranks.

    Diagnostics computed with a global ``diagnostics_normalizer`` (for example
    :class:`rlobjectives.PolicyLossDiagnostics` with ``diagnostics_normalizer`` the global
    selected-token count ``normalizer_for_reduction(normalizers, reduction="token_mean")``)
    are additive like the losses: the sum over
    micro-batches and ranks is the full-batch value (clip fractions, ratio mean, approximate KL).
    The fields are summed over the micro-batches locally, then over the ranks with one
    ``all_reduce(SUM)`` of the stacked fields; without an initialised process group only the
    local sum is taken. Fields that are extremes rather than sums (the ``ratio_min`` and
    ``ratio_max`` of :class:`rlobjectives.RolloutCorrectionMetrics`, declared by its
    ``extremum_fields()``) are combined by min/max over the pieces that selected a token, with
    one more ``all_reduce(MAX)``; sums and counts (from which the metrics derive means,
    fractions and the effective sample size) add as above.

    .. math::

        d_{\text{full}} = \sum_{r, m} d^{(r, m)}, \qquad
        d^{(r, m)} = \frac{\sum_{(i,t) \in \text{piece}_{rm}} c_{it}}{N_{\text{global}}}

    Args:
        diagnostics: one NamedTuple of 0-d tensors (for example a ``PolicyLossDiagnostics``) or
            a list/tuple of them, one per micro-batch of this rank, all of the same type.
        group: the data-parallel process group (None: the default group).

    Returns:
        A NamedTuple of the same type whose fields are the 0-d sums, each in its original dtype,
        identical on every rank.

    Raises:
        ValueError: if the sequence is empty, mixes types, a field is not a 0-d floating
            tensor, or ``group`` is given without an initialised process group.

    Examples:
        >>> import torch
        >>> from rlobjectives import policy_loss
        >>> mask = torch.ones(1, 2, dtype=torch.bool)
        >>> halves = [policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), mask,
        ...                       diagnostics_normalizer=4).diagnostics for _ in range(2)]
        >>> float(sum_diagnostics(halves).ratio_mean)  # (2 + 2) / 4
        1.0

    .. versionadded:: 0.1.0
    """
    return sum_over_ranks(diagnostics, group=group)


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
