r"""Context parallelism: the sums, extremes and boundary states that cross the ranks of a sequence.

Under context parallelism (Megatron CP, ring attention, Ulysses sequence parallelism) each rank
of a *context group* holds, for the same :math:`S` sequences in the same order, some of their
tokens. Every per-sequence quantity of the library is a sum over a sequence's tokens (a row sum,
a count), so the unsplit value is the sum over the ranks of the per-rank partial sums:

.. math::

    \textstyle\sum_{t \in i} x_{it} = \sum_{r} \sum_{t \in i,\ t \text{ on } r} x_{it}.

This module is that sum and the few other collectives the library needs, on a group validated at
the public boundary (:func:`rlobjectives._core.validation.validate_context_group` returns the
:class:`ContextGroup`):

- :func:`context_sum`: one ``all_reduce(SUM)`` of any number of tensors (counts and values
  packed into one float64 buffer: integers are exact up to :math:`2^{53}`), as an autograd
  Function. Its backward is the **identity** by default: each rank computes the same
  (replicated) loss from the summed quantities, so the upstream gradient of a sum is the same
  on every rank and the gradient of the local partial sums is that gradient, not another
  all-reduce (Megatron CP's ``loss * cp_size`` convention: the trainer's gradient all-reduce
  over the context group then adds the ranks' parts). ``adjoint=True`` gives the backward of a
  sum whose results feed *sharded* outputs (each rank's per-token outputs, a loss that is the
  sum over the ranks of per-rank losses): the all-reduce of the gradients.
- :func:`context_max`: the ``all_reduce(MAX)`` of the extremes (no gradient).
- :func:`context_gather`: the ``all_gather`` of each rank's boundary state, ``(W, ...)`` in rank
  order, with the adjoint backward (the sum of the gathered gradients over the ranks, this
  rank's slice): the carries of the reverse-time scans (:func:`carry_from_later_ranks`).
- :func:`gather_padded`: every rank's 1-D values of any length (the entropies of a quantile).

Without a group (``None``) every function returns its inputs (the single-process case), so the
callers write one code path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "ContextGroup",
    "carry_from_later_ranks",
    "context_gather",
    "context_max",
    "context_sum",
    "gather_padded",
]


class ContextGroup(NamedTuple):
    r"""A validated context-parallel process group and this rank's place in it.

    Attributes:
        group: the ``torch.distributed`` process group of the ranks that hold parts of the same
            sequences.
        rank: this rank's index in ``group`` (the order of its chunk in a sequence, for scans).
        size: the number of ranks :math:`W \\ge 2` (a group of one is no group: ``None``).
        device: where the call's tensors (and so its collectives) live; set by the layout.
    """

    group: dist.ProcessGroup
    rank: int
    size: int
    device: torch.device | None = None


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors as one float64 buffer (counts exact up to 2^53, sums no less exact)."""
    return torch.cat([tensor.detach().reshape(-1).to(torch.float64) for tensor in tensors])


def _unflatten(flat: torch.Tensor, likes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Split ``flat`` into tensors of the shapes and dtypes of ``likes``."""
    out, offset = [], 0
    for like in likes:
        count = like.numel()
        out.append(flat[offset : offset + count].reshape(like.shape).to(like.dtype))
        offset += count
    return out


class _ContextSum(torch.autograd.Function):
    """``all_reduce(SUM)`` of several tensors in one buffer; identity or adjoint backward."""

    @staticmethod
    def forward(
        ctx: Any, context: ContextGroup, adjoint: bool, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        flat = _flatten(tensors)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=context.group)
        outputs = _unflatten(flat, tensors)
        ctx.context, ctx.adjoint = context, adjoint
        ctx.floating = [tensor.is_floating_point() for tensor in tensors]
        ctx.mark_non_differentiable(*(o for o in outputs if not o.is_floating_point()))
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # (unused outputs get zeros: autograd materialises them, so every rank sends the same)
        floating = ctx.floating
        kept = [g for g, f in zip(grads, floating, strict=True) if f]
        if ctx.adjoint and kept:
            summed = _flatten(kept)
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=ctx.context.group)
            reduced = iter(_unflatten(summed, kept))
            grads = tuple(next(reduced) if f else g for g, f in zip(grads, floating, strict=True))
        return (None, None, *(g if f else None for g, f in zip(grads, floating, strict=True)))


def context_sum(
    context: ContextGroup | None, *tensors: torch.Tensor, adjoint: bool = False
) -> tuple[torch.Tensor, ...]:
    """The sums of ``tensors`` over the ranks of ``context``: one ``all_reduce`` for all of them.

    Each result has the shape and dtype of its input (float32 values are summed in float64 and
    rounded once). Differentiable: identity backward (a replicated result, the default) or the
    all-reduce of the gradients (``adjoint=True``, a result that feeds sharded outputs).
    Without a group the inputs are returned unchanged.
    """
    if context is None or not tensors:
        return tensors
    result: tuple[torch.Tensor, ...] = _ContextSum.apply(context, adjoint, *tensors)  # type: ignore[no-untyped-call]
    return result


def context_max(context: ContextGroup | None, tensor: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum of ``tensor`` over the ranks of ``context`` (no gradient)."""
    if context is None:
        return tensor
    with torch.no_grad():
        flat = tensor.detach().to(torch.float64).clone()
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=context.group)
    return flat.to(tensor.dtype)


class _ContextGather(torch.autograd.Function):
    """``all_gather`` into ``(W, ...)``; backward: the gathered gradients summed, this slice."""

    @staticmethod
    def forward(ctx: Any, context: ContextGroup, tensor: torch.Tensor) -> torch.Tensor:
        local = tensor.detach().contiguous()
        pieces = [torch.empty_like(local) for _ in range(context.size)]
        dist.all_gather(pieces, local, group=context.group)
        ctx.context = context
        return torch.stack(pieces)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=ctx.context.group)
        return None, summed[ctx.context.rank]


def context_gather(context: ContextGroup, tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape and dtype on all ranks) as ``(W, ...)`` in rank order.

    Differentiable with the adjoint backward: the gradient of this rank's ``tensor`` is the sum
    over the ranks of the gradients of its slice (each rank uses the gathered states for its
    own, sharded, outputs).
    """
    result: torch.Tensor = _ContextGather.apply(context, tensor)  # type: ignore[no-untyped-call]
    return result


def gather_padded(
    values: torch.Tensor, group: dist.ProcessGroup | None, fill: float
) -> torch.Tensor:
    """Every rank's 1-D ``values`` (lengths may differ), padded with ``fill``, concatenated.

    One ``all_gather`` of the lengths (read on the host to size the next one) and one of the
    padded values. No gradient.
    """
    world = dist.get_world_size(group)
    length = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    longest = int(torch.stack(lengths).max())  # host sync: the padded size of the gather
    padded = torch.full((longest,), fill, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values.detach()
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat(gathered)


def carry_from_later_ranks(
    states: torch.Tensor,
    rank: int,
    start: torch.Tensor,
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    r"""The carry a rank's chunk receives from the chunks after it, composed in rank order.

    A reverse-time recursion :math:`G_t = x_t + a\,G_{n(t)}` over a sequence split into
    contiguous chunks (rank :math:`q` holds the :math:`q`-th chunk) is exact on each rank once
    it knows the value the recursion carries into its last token from the later chunks. Each
    rank summarises its chunk by a state (``states[q]``, gathered from every rank); the carry
    into rank ``rank`` is the fold, from the last rank down to ``rank + 1``, of ``step``:

    .. math:: c_{W} = \text{start}, \qquad c_{q} = \text{step}(\text{states}_q, c_{q+1}),

    where ``step`` returns the carry unchanged for a chunk without any token of the sequence.

    Args:
        states: ``(W, S, k)`` the gathered per-rank, per-sequence states.
        rank: this rank's index; only ranks ``> rank`` are composed.
        start: ``(S, m)`` the carry after the last chunk (zeros: the sequence ended).
        step: ``(state (S, k), carry (S, m)) -> carry (S, m)``.

    Returns:
        ``(S, m)`` the carry into this rank's chunk (differentiable in ``states``; the last
        rank's carry too, with a zero derivative, so that every rank's backward reaches the
        gather's collective).
    """
    # Every rank's graph holds the gathered states (a zero term for the last rank, which has no
    # later chunk), so that every rank runs the gather's backward collective.
    carry = start + 0.0 * states.sum()
    for later in range(states.shape[0] - 1, rank, -1):  # static: W is a Python int
        carry = step(states[later], carry)
    return carry
