r"""M2PO's mask and the Clip-Cov / KL-Cov selections over every data-parallel rank.

The bodies of :func:`rlobjectives.distributed.global_m2po_mask` and
:func:`rlobjectives.distributed.global_cov_selection`. Each equals the single-process selection
(:func:`rlobjectives.m2po_mask`, :func:`rlobjectives.cov_selection`) on the concatenation of
the ranks' batches in rank order (rank 0's rows first), ties included (they are broken by that
order): every rank gathers the values that decide (one ``all_gather`` of the counts, one of the
padded values), runs the same stable sort on the same concatenation, and keeps its own slice.

- M2PO: the squared log-ratios of the selected tokens (in the computation dtype, so that the
  suffix sums are those of the single call).
- KL-Cov: one ``all_reduce`` of :math:`(\sum A, \sum \ell, N)` (float64) gives the global
  means and :math:`k`; then the covariances of the selected tokens (``-inf`` padding) and the
  global top-k.
- Clip-Cov: the same ``all_reduce``; one seed drawn on the group's rank 0 (from the object's
  generator there, or its default generator) and broadcast; each token's key is the hash of
  its *global* ordinal (the selected tokens of the earlier ranks, from the counts, plus its own
  ordinal); the candidates' keys are gathered (int64-max padding) and the global ``k`` smallest
  are selected.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._core.layout import token_matrix, token_output
from .._core.selection import (
    INT64_MAX,
    centered_covariance,
    draw_seed,
    hash_keys,
    m2po_kept,
    selection_count,
    stable_ranks,
)
from .._core.validation import (
    ArrayLike,
    Scalar,
    as_float_tensor,
    as_mask,
    check_same_device,
    check_shape,
    compute_dtype,
    validate_scalar,
)
from ..policy.call import as_surrogate
from ..policy.surrogates.cov import ClipCov, CovSelection, KLCov
from ..selection.batch import selection_inputs

__all__ = ["cov_selection_over_ranks", "m2po_mask_over_ranks"]


def _gather(
    values: torch.Tensor, padding: float | int, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, list[int], int]:
    """Every rank's 1-D ``values`` padded to the longest and concatenated in rank order.

    Returns the concatenation, each rank's length and the padded length (read on the host:
    the size of the gather).
    """
    world = dist.get_world_size(group)
    length = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in torch.cat(lengths).tolist()]  # host sync: the gather's sizes
    longest = max(sizes)
    padded = torch.full((longest,), padding, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat(gathered), sizes, longest


def m2po_mask_over_ranks(
    log_ratio: ArrayLike,
    mask: ArrayLike,
    *,
    threshold: Scalar,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """The mask of :func:`rlobjectives.distributed.global_m2po_mask` (a process group is active)."""
    values = as_float_tensor(log_ratio, "log_ratio")
    flat = values.ndim == 1
    values = token_matrix(values, "log_ratio", flat)
    mask_t = token_matrix(as_mask(mask, "mask", values.device), "mask", flat)
    check_same_device({"log_ratio": values, "mask": mask_t})
    check_shape(mask_t, "mask", tuple(values.shape), "log_ratio")
    tau = validate_scalar(threshold, "threshold", minimum=0.0, strict=True)
    with torch.no_grad():
        selected = values.detach().to(compute_dtype(values))[mask_t]  # (n,) a host sync
        gathered, sizes, longest = _gather(selected, 0.0, group)
        rank = dist.get_rank(group)
        valid = torch.cat(
            [torch.arange(longest, device=gathered.device) < size for size in sizes]
        )  # the real entries of the concatenation, in rank order
        kept_all = m2po_kept(gathered, valid, tau)  # (W * longest,)
        own = kept_all[rank * longest : rank * longest + sizes[rank]]
        kept = torch.zeros_like(mask_t)
        kept[mask_t] = own
    return token_output(kept, flat)


def cov_selection_over_ranks(
    log_probs: ArrayLike,
    old_log_probs: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    surrogate: ClipCov | KLCov,
    log_ratio_bound: Scalar | None,
    group: dist.ProcessGroup | None,
) -> CovSelection:
    """The selection of :func:`rlobjectives.distributed.global_cov_selection` (group active)."""
    objective = as_surrogate(surrogate)
    if not isinstance(objective, ClipCov | KLCov):
        raise TypeError(
            f"surrogate must be a ClipCov or KLCov object, got {type(surrogate).__name__}"
        )
    if objective.selection is not None:
        raise ValueError(
            f"surrogate.selection must be None for the global selection (it selects), got a "
            f"{type(objective).__name__} with a selection"
        )
    inputs = selection_inputs(
        log_probs, old_log_probs, advantages, mask, log_ratio_bound=log_ratio_bound, cu_seqlens=None
    )
    mask_t = inputs.mask
    with torch.no_grad():
        sums = torch.stack(
            [
                inputs.log_probs.sum().to(torch.float64),
                inputs.advantages.sum().to(torch.float64),
                mask_t.sum().to(torch.float64),
            ]
        )  # (3,) exact count up to 2**53
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        total = sums[2].to(torch.int64)
        count = sums[2].clamp(min=1)
        dtype = inputs.log_probs.dtype
        means = ((sums[0] / count).to(dtype), (sums[1] / count).to(dtype))
        k = selection_count(objective.ratio, total)
        rank = dist.get_rank(group)
        if isinstance(objective, KLCov):
            candidates = mask_t
            scores = centered_covariance(inputs.log_probs, inputs.advantages, mask_t, means)
            gathered, sizes, longest = _gather(scores[mask_t], -torch.inf, group)
            ranks = stable_ranks(gathered, descending=True)
        else:
            candidates = objective.candidates(inputs, objective.band(inputs), means)
            if rank == 0:  # one seed for the group, from rank 0's generator
                seed = draw_seed(objective.generator, mask_t.device)
            else:
                seed = torch.zeros((), dtype=torch.int64, device=mask_t.device)
            source = dist.get_global_rank(group, 0) if group is not None else 0
            dist.broadcast(seed, src=source, group=group)
            local = mask_t.sum().reshape(1)
            counts = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(counts, local, group=group)
            offset = int(torch.cat(counts)[:rank].sum())  # host sync: the global ordinal's offset
            keys = torch.where(candidates.reshape(-1), hash_keys(mask_t, seed, offset), INT64_MAX)
            gathered, sizes, longest = _gather(keys[mask_t.reshape(-1)], INT64_MAX, group)
            ranks = stable_ranks(gathered, descending=False)
        own = ranks[rank * longest : rank * longest + sizes[rank]] < k
        selected = torch.zeros_like(mask_t)
        selected[mask_t] = own
        selected = selected & candidates
    return CovSelection(selected, candidates, k)
