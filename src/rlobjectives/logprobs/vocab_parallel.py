r"""Vocabulary parallelism: each rank holds a contiguous slice of the vocabulary.

With Megatron-style tensor parallelism the LM head ``(V, H)`` is split by rows over the ranks
of a group, in rank order: rank :math:`r` holds the vocabulary slice :math:`[s_r, s_r + V_r)`
(shards may be uneven) and computes the logits of its slice only. The log-probability functions
take ``vocab_group=`` (a :class:`torch.distributed.ProcessGroup`, or a :class:`VocabParallel`
for its options) and combine per-row statistics instead of gathering the ``(N, V)`` logits.

Each rank computes, for every row :math:`n`, over its own slice (after the temperature and any
kept set, with tokens outside the slice contributing nothing): the log-normaliser
:math:`\ell_r = \log\sum_{v \in r} e^{x_v}`, the entropy :math:`h_r` of the slice's own
softmax, and the target logit :math:`x_y` when :math:`y` is in its slice (0 otherwise). Then

.. math::

    M = \max_r \ell_r, \quad a_r = \ell_r - M, \quad S = \sum_r e^{a_r}, \quad
    \mathrm{lse} = M + \log S, \quad
    H = \frac{\sum_r e^{a_r} (h_r - a_r)}{S} + \log S = \sum_r \pi_r (h_r - \log \pi_r),

with :math:`\pi_r = e^{a_r} / S` the probability mass of slice :math:`r`: one all-reduce MAX of
``N`` floats, then one all-reduce SUM of ``(2, N)`` (``(3, N)`` with the entropy) floats:
:math:`e^{a_r}`, the target logit and the entropy moment. Every term is non-negative and
relative to :math:`M`, so nothing cancels. A slice with no finite logit in a row
(:math:`\ell_r = -\infty`: every token banned or outside the kept set) contributes 0.

The gradients with respect to the local logits need no communication: every rank computes the
same loss, so each rank's upstream gradient is the full one, and
:math:`\partial \log p_y / \partial x_v = \mathbb{1}[v = y] - e^{x_v - \mathrm{lse}}` only needs
the global ``lse`` saved by the forward pass (the collectives above run inside the chunked
autograd Functions, whose backward is closed-form: no double counting). The hidden states are
replicated over the group and the LM head is a column-parallel layer, so each rank's
``grad_hidden = dZ_r W_r`` is its part of the sum :math:`\sum_r dZ_r W_r`: by default
(``hidden_grad="partial"``, Megatron's convention) it is returned as is, for the caller's
``copy_to_tensor_model_parallel_region`` (whose backward all-reduces it) to sum;
``hidden_grad="reduced"`` all-reduces it here (:class:`ReduceHiddenGradient`, the copy region
itself: identity forward, all-reduce backward).

The collectives live here, next to the log-probability functions that are their only users
(``rlobjectives.distributed`` is the data-parallel public API; it does not build on the
log-probabilities, and they must not import it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Union

import torch
import torch.distributed as dist

from .._core.validation import describe, validate_choice
from .statistics import Wanted

__all__ = [
    "VocabGroup",
    "HiddenGrad",
    "ReduceHiddenGradient",
    "RowTotals",
    "Shard",
    "VocabParallel",
    "combine_rows",
    "combine_statistics",
    "first_argmax",
    "gather_columns",
    "max_over_ranks",
    "reduce_hidden_gradient",
    "resolve_shard",
    "sum_over_ranks",
]

#: ``"partial"``: each rank's ``grad_hidden`` is its part of the sum (Megatron's column-parallel
#: convention); ``"reduced"``: the sum, all-reduced here.
HiddenGrad = Literal["partial", "reduced"]
_HIDDEN_GRADS = ("partial", "reduced")


def _check_group(group: object, name: str) -> None:
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(
            f"{name} must be a torch.distributed ProcessGroup (the tensor-parallel group whose "
            f"ranks hold the vocabulary slices) or a VocabParallel, got {describe(group)}"
        )


@dataclass(frozen=True)
class VocabParallel:
    r"""The vocabulary-parallel options of the log-probability functions (``vocab_group=``).

    ``vocab_group=group`` means ``VocabParallel(group)``. Rank :math:`r` of ``group`` holds the
    contiguous vocabulary slice :math:`[s_r, s_r + V_r)`, in rank order, where :math:`V_r` is
    the last dimension of its logits (or the number of rows of its LM-head weight); token ids
    stay global.

    Attributes:
        group: the process group over which the vocabulary is split (Megatron's tensor-parallel
            group).
        vocab_sizes: the shard sizes :math:`(V_0, \dots, V_{R-1})`, or None to find them with
            one all-gather of one integer per rank at each call. Giving them saves that
            collective; they are checked against this rank's logits.
        hidden_grad: the gradient with respect to the (replicated) hidden states of
            :func:`~rlobjectives.token_log_probs_from_hidden` and
            :func:`~rlobjectives.fused_policy_loss_from_hidden`: ``"partial"`` (default,
            Megatron's column-parallel convention: this rank's part, for the caller's
            ``copy_to_tensor_model_parallel_region`` to all-reduce; Cut Cross-Entropy's
            ``reduce_e_grad=False``) or ``"reduced"`` (all-reduced here: every rank gets the
            full gradient; CCE's default ``reduce_e_grad=True``). Ignored by the functions of
            logits.

    Raises:
        TypeError: ``group`` is not a ProcessGroup, ``vocab_sizes`` not a sequence of ints.
        ValueError: a size below 1, an unknown ``hidden_grad``.

    References:
        Shoeybi et al. 2019, Megatron-LM, arXiv:1909.08053 Sec. 3 (the parallel output
        embedding and cross entropy); the peers' options: Megatron ``_VocabParallelCrossEntropy``
        (``tensor_model_parallel_group``), verl ``linear_cross_entropy(dist_process_group=)``,
        NeMo-RL ``DistributedLogprob(vocab_start_index, vocab_end_index, group)``, slime
        ``_VocabParallelLogProbEntropy(process_group)``, Cut Cross-Entropy
        ``VocabParallelOptions(start, stop, group, reduce_e_grad)``.

    Examples:
        >>> VocabParallel.__dataclass_fields__["hidden_grad"].default
        'partial'
    """

    group: Any
    vocab_sizes: Sequence[int] | None = None
    hidden_grad: HiddenGrad = "partial"

    def __post_init__(self) -> None:
        _check_group(self.group, "VocabParallel.group")
        validate_choice(self.hidden_grad, "VocabParallel.hidden_grad", _HIDDEN_GRADS)
        if self.vocab_sizes is not None:
            sizes = self.vocab_sizes
            if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
                raise TypeError(
                    "VocabParallel.vocab_sizes must be a sequence of ints (one per rank) or "
                    f"None, got {describe(sizes)}"
                )
            for size in sizes:
                if isinstance(size, bool) or not isinstance(size, int):
                    raise TypeError(
                        f"VocabParallel.vocab_sizes must hold ints, got {describe(size)}"
                    )
                if size < 1:
                    raise ValueError(
                        f"VocabParallel.vocab_sizes must be >= 1 each, got {list(sizes)}"
                    )
            object.__setattr__(self, "vocab_sizes", tuple(sizes))


#: The ``vocab_group=`` argument: a process group, a :class:`VocabParallel`, or None (no split).
VocabGroup = Union["dist.ProcessGroup", VocabParallel, None]


class Shard(NamedTuple):
    """This rank's vocabulary slice, resolved for one call.

    Attributes:
        group: the process group.
        start: 0-d int64 tensor on the data's device: :math:`s_r`, the first global id.
        size: :math:`V_r`, the local vocabulary size.
        sizes: ``(R,)`` int64 shard sizes (on the data's device), or the given Python tuple.
        hidden_grad: ``"partial"`` or ``"reduced"``.
    """

    group: Any
    start: torch.Tensor
    size: int
    sizes: torch.Tensor | tuple[int, ...]
    hidden_grad: str

    def local_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(local, owned)``: ``ids - start`` (0 where another slice holds the id), ownership.

        An id outside the whole vocabulary ``[0, V)`` keeps ``ids - start``, which is outside
        every slice, so the gather raises on every rank as the unsharded call's does (never a
        finite log-probability from the log-normaliser alone; no host synchronisation).
        """
        local = ids - self.start
        owned = (local >= 0) & (local < self.size)
        outside = (ids < 0) | (ids >= self.vocab_size())
        zero = torch.zeros((), dtype=local.dtype, device=ids.device)
        return torch.where(owned | outside, local, zero), owned

    def vocab_size(self) -> int | torch.Tensor:
        """``V``, the whole vocabulary: the sum of the slices' sizes (a tensor when gathered)."""
        return sum(self.sizes) if isinstance(self.sizes, tuple) else self.sizes.sum()

    def largest(self) -> int:
        """The largest shard size (a host read of the gathered sizes when they were not given).

        Used only where every rank must cut the rows into the same chunks (the top-k/top-p
        rule runs collectives per chunk), so the default chunk size must not depend on this
        rank's own slice.
        """
        if isinstance(self.sizes, tuple):
            return max(self.sizes)
        return int(self.sizes.max())


def resolve_shard(vocab_group: object, local_vocab: int, device: torch.device) -> Shard:
    """Validate ``vocab_group`` and locate this rank's slice of ``local_vocab`` entries.

    Without ``vocab_sizes`` the shard sizes are all-gathered (one int64 per rank) and the start
    is the sum of the sizes of the ranks before this one, as a device tensor (no host read).

    Raises:
        TypeError: ``vocab_group`` is neither a ProcessGroup nor a :class:`VocabParallel`.
        ValueError: ``torch.distributed`` is not initialised, this process is not in the group,
            or the given ``vocab_sizes`` do not match the group or this rank's logits.
    """
    options = vocab_group if isinstance(vocab_group, VocabParallel) else None
    group = options.group if options is not None else vocab_group
    _check_group(group, "vocab_group")
    if not dist.is_initialized():
        raise ValueError("vocab_group needs torch.distributed to be initialised")
    assert isinstance(group, dist.ProcessGroup)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("vocab_group: this process is not a member of the group")
    hidden_grad = "partial" if options is None else options.hidden_grad
    given = None if options is None else options.vocab_sizes
    if given is not None:
        sizes: torch.Tensor | tuple[int, ...] = tuple(given)
        if len(sizes) != world or sizes[rank] != local_vocab:
            raise ValueError(
                f"vocab_group: VocabParallel.vocab_sizes must list one size per rank of the "
                f"group ({world}) with this rank's ({rank}) equal to its local vocabulary "
                f"{local_vocab}, got {list(sizes)}"
            )
        start = torch.tensor(sum(sizes[:rank]), dtype=torch.int64, device=device)
    else:
        mine = torch.tensor([local_vocab], dtype=torch.int64, device=device)
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=group)
        sizes = torch.cat(parts)  # (R,)
        start = sizes[:rank].sum()
    return Shard(group, start, local_vocab, sizes, hidden_grad)


# ---------------------------------------------------------------------------------------------
# Collectives (inside autograd Functions' forward passes: no autograd here)
# ---------------------------------------------------------------------------------------------


def sum_over_ranks(values: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """``values`` summed over the group (in place on a contiguous copy); as is without a shard."""
    if shard is None:
        return values
    values = values.contiguous()
    dist.all_reduce(values, op=dist.ReduceOp.SUM, group=shard.group)
    return values


def max_over_ranks(values: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """``values`` maximised over the group (a contiguous copy); as is without a shard."""
    if shard is None:
        return values
    values = values.contiguous().clone()
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=shard.group)
    return values


def first_argmax(maximum: torch.Tensor, argmax: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """The global id of each row's first maximal logit from the slices' ``(max, first argmax)``.

    ``maximum`` ``(N,)`` and ``argmax`` ``(N,)`` int64 (local ids) of this rank's slice. One
    all-reduce MAX of ``N`` values, then one all-reduce MIN of ``N`` int64: the smallest global
    id among the slices holding the global maximum (the slices are in rank order, so it is the
    first maximal logit of the whole row).
    """
    if shard is None:
        return argmax
    overall = max_over_ranks(maximum, shard)
    largest = torch.iinfo(torch.int64).max
    candidate = torch.where(maximum == overall, argmax + shard.start, largest).contiguous()
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=shard.group)
    return candidate


def gather_columns(values: torch.Tensor, shard: Shard) -> torch.Tensor:
    """``(C, k)`` of every rank concatenated along the last dimension: ``(C, R k)``."""
    values = values.contiguous()
    parts = [torch.empty_like(values) for _ in range(dist.get_world_size(shard.group))]
    dist.all_gather(parts, values, group=shard.group)
    return torch.cat(parts, dim=-1)


class RowTotals(NamedTuple):
    """Per-row statistics over the whole vocabulary, combined over the ranks."""

    log_normalizer: torch.Tensor  # (N,) lse
    entropy: torch.Tensor | None  # (N,) H, or None when not requested
    sums: list[torch.Tensor]  # the extra per-row values, summed over the ranks
    log_sum_sq: torch.Tensor | None = None  # (N,) log sum_v p_v^2, or None


def combine_rows(
    log_normalizer: torch.Tensor,
    entropy: torch.Tensor | None,
    sums: Sequence[torch.Tensor],
    shard: Shard | None,
    log_sum_sq: torch.Tensor | None = None,
) -> RowTotals:
    r"""Combine the slices' ``(lse_r, h_r)`` (module docstring) and sum ``sums`` over the ranks.

    With ``log_sum_sq`` (:math:`\log\sigma_r`, :math:`\sigma_r = \sum_{v \in r} p_{r,v}^2`
    of the slice's own softmax): :math:`\sum_v p_v^2 = \sum_r e^{2 a_r}\sigma_r / S^2`, one
    more row of the same all-reduce SUM.

    Args:
        log_normalizer: ``(N,)`` :math:`\ell_r` of this rank's slice (``-inf`` for an empty
            one).
        entropy: ``(N,)`` :math:`h_r` (0 where :math:`\ell_r = -\infty`), or None.
        sums: ``(N,)`` values to add over the ranks (e.g. the target logit, 0 off the slice),
            sent in the same all-reduce.
        shard: the slice; None returns the inputs (one process holds the whole vocabulary).
        log_sum_sq: ``(N,)`` :math:`\log\sigma_r` (``-inf`` for an empty slice), or None.

    Returns:
        :class:`RowTotals`, in the dtype of ``log_normalizer``.
    """
    if shard is None:
        return RowTotals(log_normalizer, entropy, list(sums), log_sum_sq)
    maximum = log_normalizer.contiguous().clone()
    dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=shard.group)  # (N,) M
    zero = torch.zeros((), dtype=maximum.dtype, device=maximum.device)
    shift = torch.where(torch.isfinite(maximum), maximum, zero)  # (N,)
    offset = log_normalizer - shift  # (N,) a_r, -inf for an empty slice
    weight = torch.exp(offset)  # (N,) e^{a_r}
    parts = [weight]
    if entropy is not None:
        parts.append(torch.where(weight > 0, weight * (entropy - offset), zero))
    if log_sum_sq is not None:
        parts.append(torch.exp(2 * offset + log_sum_sq))  # e^{2 a_r} sigma_r, 0 when empty
    parts.extend(part.to(maximum.dtype) for part in sums)
    totals = sum_over_ranks(torch.stack(parts), shard)  # (k, N)
    log_total = torch.log(totals[0])  # (N,) log S
    combined = None
    index = 1
    if entropy is not None:
        combined = totals[1] / totals[0] + log_total
        index += 1
    squares = None
    if log_sum_sq is not None:
        squares = torch.log(totals[index]) - 2 * log_total
        index += 1
    return RowTotals(shift + log_total, combined, list(totals[index:].unbind(0)), squares)


def combine_statistics(
    outputs: Iterable[torch.Tensor],
    wanted: Wanted,
    shard: Shard | None,
    vocabulary: int,
    tokens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """A chunk loop's per-row results combined over the slices, ``(N,)`` each.

    Args:
        outputs: ``[target, lse, (entropy), (log_sum_sq), (logit sum), (max, argmax)]`` of this
            rank's slice, those ``wanted`` asks for, in that order.
        wanted: the statistics of the call.
        shard: the slice; None: one process holds the whole vocabulary.
        vocabulary: this rank's number of columns (the whole ``V`` without a shard).
        tokens: ``(N,)`` the global ids of the targets (``is_top1``).

    Returns:
        ``(log_normalizer, target, statistics)``: the normaliser and the target logit over the
        whole vocabulary, and the statistics asked for by name.
    """
    values = iter(outputs)
    target, log_normalizer = next(values), next(values)
    entropy = next(values) if wanted.entropy else None
    log_sum_sq = next(values) if wanted.log_sum_sq_probs else None
    logit_sum = next(values) if wanted.mean_logits else None
    sums = [target] if logit_sum is None else [target, logit_sum]
    totals = combine_rows(log_normalizer, entropy, sums, shard, log_sum_sq)
    statistics: dict[str, torch.Tensor] = {}
    if totals.entropy is not None:
        statistics["entropy"] = totals.entropy
    if totals.log_sum_sq is not None:
        statistics["log_sum_sq_probs"] = totals.log_sum_sq
    if logit_sum is not None:
        whole = vocabulary if shard is None else shard.vocab_size()
        statistics["mean_logits"] = totals.sums[1] / whole
    if wanted.is_top1:
        maximum, argmax = next(values), next(values)
        statistics["is_top1"] = first_argmax(maximum, argmax, shard) == tokens
    return totals.log_normalizer, totals.sums[0], statistics


# ---------------------------------------------------------------------------------------------
# The hidden states' gradient: Megatron's copy to the tensor-parallel region
# ---------------------------------------------------------------------------------------------


class ReduceHiddenGradient(torch.autograd.Function):
    """Identity forward; the gradient all-reduced (SUM) over the group in backward.

    Megatron's ``copy_to_tensor_model_parallel_region``: placed on the replicated hidden states
    before a column-parallel LM head, it turns each rank's partial ``grad_hidden`` into the sum.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        """The forward pass (see the class docstring)."""
        ctx.group = group
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        """The backward pass (see the class docstring)."""
        reduced = grad.contiguous().clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=ctx.group)
        return reduced, None


def reduce_hidden_gradient(hidden: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """``hidden`` through :class:`ReduceHiddenGradient` when the shard asks for it."""
    if shard is None or shard.hidden_grad != "reduced" or not hidden.requires_grad:
        return hidden
    out: torch.Tensor = ReduceHiddenGradient.apply(hidden, shard.group)  # type: ignore[no-untyped-call]
    return out
