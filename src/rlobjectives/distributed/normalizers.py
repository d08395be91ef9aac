r"""The data-parallel step: global counts, the normaliser of a reduction, the loss scale.

:func:`global_normalizers` counts the selected tokens and sequences of every micro-batch of an
optimizer step on every rank (one ``all_reduce``), :func:`normalizer_for_reduction` picks the
``normalizer`` of a reduction from those counts, :func:`data_parallel_loss_scale` is the factor
that undoes the gradient average of DDP/FSDP, and :func:`sum_diagnostics` sums additive
diagnostics over the micro-batches and ranks. The recipe: ``docs/distributed/data-parallel.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypeVar

import torch
import torch.distributed as dist

from .._core.reduction import REDUCTIONS
from .._core.validation import ArrayLike, canonical_reduction, checks_environment, validate_choice
from .collectives import count_over_ranks, process_group_active, sum_over_ranks

__all__ = [
    "Normalizers",
    "data_parallel_loss_scale",
    "global_normalizers",
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

    Once per step, before the micro-batch loop, with the masks of *every* micro-batch of this
    rank; :math:`M^{(r, m)}` the mask of micro-batch :math:`m` on rank :math:`r`:

    .. math::

        N = \sum_{r, m} \sum_{it} M^{(r, m)}_{it}, \qquad
        S = \sum_{r, m} \#\{i : \textstyle\sum_t M^{(r, m)}_{it} > 0\}, \qquad
        B = \sum_{r, m} B^{(r, m)}.

    One ``all_reduce(SUM)`` of an ``int64`` 3-vector on ``group``; the local counts without an
    initialised process group. A collective: every rank calls it, one without micro-batches
    with ``[]``. Only the masks are read. With ``context_group`` a split sequence counts once.
    Details: ``docs/distributed/data-parallel.md`` ("global_normalizers in detail") and
    ``docs/distributed/context-parallel.md`` ("Data and context parallelism together").

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
