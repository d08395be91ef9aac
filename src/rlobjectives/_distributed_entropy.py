r"""The high-entropy token mask with the quantile taken over every data-parallel rank.

Re-exported as :func:`rlobjectives.distributed.global_top_entropy_mask`. TRL gathers every
rank's selected entropies (``pad_across_processes`` + ``gather``) before ``torch.quantile``;
this is the same with ``torch.distributed``: one ``all_gather`` of the per-rank token counts,
one of the (padded) entropies, and the threshold of :func:`rlobjectives._entropy.entropy_threshold`
on the gathered values, identical on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._entropy import entropy_threshold, prepare_entropy_mask_args
from ._validation import ArrayLike

__all__ = ["global_top_entropy_mask"]


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
    them); each rank gets the mask of its own tokens. Without an initialised process group it is
    :func:`rlobjectives.top_entropy_mask`. It is a collective: every rank must call it (a rank
    with nothing selected too). TRL's ``top_entropy_quantile=ρ`` is ``quantile=1 - ρ``.

    Args:
        entropy: ``(B, T)`` this rank's per-token entropies (B and T may differ between ranks).
        mask: ``(B, T)`` bool/numeric; nonzero selects the token.
        quantile: the quantile level :math:`q`, ``0 <= q <= 1`` (a Python number).
        group: the data-parallel process group (None: the default group).

    Returns:
        ``(B, T)`` bool mask, a subset of ``mask``, identical threshold on every rank.

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
    from .distributed import _process_group_active  # the shared check (no import cycle)

    entropy_t, mask_t, level = prepare_entropy_mask_args(entropy, mask, quantile)
    active = _process_group_active(group)
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
