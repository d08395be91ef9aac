r"""The high-entropy token mask with the quantile taken over every data-parallel rank.

The body of :func:`rlobjectives.distributed.global_top_entropy_mask`. TRL gathers every
rank's selected entropies (``pad_across_processes`` + ``gather``) before ``torch.quantile``;
this is the same with ``torch.distributed``: one ``all_gather`` of the per-rank token counts,
one of the (padded) entropies, and the threshold of
:func:`rlobjectives.policy.entropy.entropy_threshold`
on the gathered values, identical on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._core.validation import ArrayLike
from ..policy.entropy import entropy_threshold, prepare_entropy_mask_args

__all__ = ["top_entropy_mask_over_ranks"]


def _gather_padded(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's 1-D ``values`` (lengths may differ), padded with ``+inf`` and concatenated."""
    world = dist.get_world_size(group)
    length = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    longest = int(torch.stack(lengths).max())  # host sync: the padded size of the gather
    padded = torch.full((longest,), float("inf"), dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat(gathered)


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
    dtype = torch.promote_types(entropy_t.dtype, torch.float32)
    values = entropy_t.to(dtype)
    with torch.no_grad():
        selected = values[mask_t]  # (n,) this rank's selected entropies (a host sync)
        count = torch.tensor(selected.numel(), dtype=torch.int64, device=values.device)
        if active:
            gathered = _gather_padded(selected, group)
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
        else:
            gathered = selected
        # NaN only comes from a selected entropy: the padding is +inf
        threshold = entropy_threshold(gathered, count, level, torch.isnan(gathered).any())
    return (values >= threshold) & mask_t
