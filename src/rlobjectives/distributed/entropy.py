r"""The high-entropy token mask with the quantile taken over every data-parallel rank.

The body of :func:`rlobjectives.distributed.global_top_entropy_mask`. TRL gathers every
rank's selected entropies (``pad_across_processes`` + ``gather``) before ``torch.quantile``;
this is the same with ``torch.distributed``: one ``all_gather`` of the per-rank token counts,
one of the (padded) entropies, and the threshold of
:func:`rlobjectives.selection.entropy.entropy_threshold`
on the gathered values, identical on every rank
(:func:`rlobjectives.selection.entropy.entropy_mask_over_group`, which
``top_entropy_mask(context_group=...)`` runs too).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._core.validation import ArrayLike
from ..selection.entropy import entropy_mask_over_group, prepare_entropy_mask_args

__all__ = ["top_entropy_mask_over_ranks"]


def top_entropy_mask_over_ranks(
    entropy: ArrayLike,
    mask: ArrayLike,
    *,
    quantile: float,
    group: dist.ProcessGroup | None,
    active: bool,
) -> torch.Tensor:
    """The mask of :func:`rlobjectives.distributed.global_top_entropy_mask`.

    ``active``: whether a process group is initialised (the caller checked ``group``); without
    one it is :func:`rlobjectives.top_entropy_mask`.
    """
    entropy_t, mask_t, level = prepare_entropy_mask_args(entropy, mask, quantile)
    return entropy_mask_over_group(entropy_t, mask_t, level, group, active)
