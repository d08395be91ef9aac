r"""Sequence-level losses from hidden states in three matrix products: the unit driver.

A preference (or KTO) loss is a function of per-sequence sums of the token log-probabilities,
:math:`\mathcal{L} = F(S, U)` with :math:`S_s = \sum_{t \in s} a_t \ell_t` and
:math:`U_s = \sum_{t \in s} b_t \ell_t` (the NLL tokens). Its gradient with respect to a
token's logits is

.. math::

    \frac{\partial \mathcal{L}}{\partial z_{tv}} = \frac{c_t}{\tau}\big(\mathbb{1}[v = y_t]
    - p_{tv}\big), \qquad c_t = g^S_{s(t)} a_t + g^U_{s(t)} b_t, \quad
    g^S_s = \frac{\partial F}{\partial S_s},\ g^U_s = \frac{\partial F}{\partial U_s},

where only the derivative of the log-softmax is the library's (:mod:`rlobjectives.logprobs`,
the same as every LM-head pass) and :math:`g` comes from **autograd** on the objective's formula
(:data:`UnitLoss`), never from a hand-derived derivative. :math:`g` of a sequence depends on
its unit's sums (a pair: chosen and rejected; KTO: the sequence), so the driver processes the
batch one **unit** at a time, never forming the ``(N, V)`` logits:

- **whole units** (:func:`_group_step`): units whose rows fit in one chunk are grouped (a
  unit larger than a chunk is also taken whole when its ``(rows, V)`` buffer is no larger than
  the partials below would be, :func:`plan_units`); the chunk's logits, softmax and
  log-probabilities give the units' sums, autograd their :math:`g`, and the same buffer becomes
  :math:`\partial\mathcal{L}/\partial z`: three matrix products per token (logits,
  ``grad_hidden``, ``grad_weight``);
- **split units** (:func:`_split_unit`), a unit larger than a chunk: its tokens are processed
  in chunks with the coefficient :math:`a_t` alone (the unit's :math:`g` unknown yet), the
  ``grad_hidden`` rows written unscaled and the ``grad_weight`` / ``grad_bias`` contributions
  accumulated per sequence (one ``(V, H)`` float32 partial per sequence of the unit); once the
  unit is done, :math:`\gamma_s = g^S_s + g^U_s` scales them. Linear in :math:`\gamma` per
  sequence, so still three matrix products; it needs :math:`b_t \in \{0, a_t\}` per sequence
  (no LD-DPO weights with a separate NLL mask), which the caller checks.

:class:`UnitsFromHidden` wires it to autograd through a zero-valued anchor (the gradients are
formed in forward, scaled by the upstream gradient in backward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ...logprobs.chunks import (
    ChunkBuffers,
    Grads,
    accumulate_grads,
    chain_softcap_,
    chunk_scores,
    new_buffers,
    new_grads,
    select_rows,
    softmax_,
)
from ...logprobs.head import Head

__all__ = [
    "Sums",
    "TokenWeights",
    "UnitLoss",
    "UnitPlan",
    "UnitsFromHidden",
    "plan_units",
    "run_units",
]


class Sums(NamedTuple):
    """Per-sequence sums of one group of sequences, ``(k,)`` each (computation dtype).

    ``sums`` and ``nll`` are leaves with gradient inside :data:`UnitLoss`; ``plain`` and
    ``wpo`` are constants.
    """

    sums: torch.Tensor  # S = sum_t a_t l_t
    nll: torch.Tensor  # U = sum_t b_t l_t (zeros without NLL weights)
    plain: torch.Tensor  # sum_t M_t l_t
    wpo: torch.Tensor  # sum_t M_t (l_t - log sum pi^2) (zeros without them)


#: The loss of the units whose sequences are ``ids`` (global sequence indices, ``(k,)`` int64
#: on the device, in the driver's order), from their :class:`Sums`: a 0-d tensor.
UnitLoss = Callable[[torch.Tensor, Sums], torch.Tensor]


class TokenWeights(NamedTuple):
    """Per-row weights of the flat ``(N,)`` tokens."""

    mask: torch.Tensor  # (N,) bool, the selected (response) tokens
    active: torch.Tensor  # (N,) bool, the rows whose log-probability enters a sum (mask | NLL)
    sums: torch.Tensor  # (N,) a_t, 0 where unselected
    nll: torch.Tensor | None  # (N,) b_t, or None (no NLL term)
    log_sum_sq: torch.Tensor | None  # (N,) WPO's log sum pi^2, or None


class UnitPlan(NamedTuple):
    """Which rows form which sequence and which sequences form which unit (host integers)."""

    starts: list[int]  # per global sequence: its first flat row
    ends: list[int]  # one past its last row
    units: list[list[int]]  # each unit's global sequence ids (a pair: [chosen, rejected])
    whole_rows: int  # units of at most this many rows are processed whole (grouped), else split


def _unit_rows(starts: Sequence[int], ends: Sequence[int], unit: Sequence[int]) -> int:
    return sum(ends[s] - starts[s] for s in unit)


def plan_units(
    head: Head,
    starts: Sequence[int],
    ends: Sequence[int],
    units: Sequence[Sequence[int]],
    *,
    share: float,
    single: bool,
    whole_units: bool = True,
) -> UnitPlan | None:
    r"""The plan of the three-product passes, or None where they would not pay.

    A unit is processed whole when its rows fit the chunk, or (``weight`` with gradient) when
    its ``(rows, V)`` buffer is no larger than the per-sequence ``(V, H)`` partials it would
    otherwise need and at most ``share`` of the ``(N, V)`` logits; a larger unit is split with
    partials, which needs ``single`` (one weight per token: :math:`b_t \in \{0, a_t\}`) and
    partials of at most ``share`` of the logits. None: the caller composes instead (recompute).
    ``whole_units=False`` splits every unit larger than a chunk (the tests' way to reach the
    split path on small shapes).
    """
    chunk, width = head.chunk_size, head.weight.shape[1]
    limit = int(share * head.hidden.shape[0])  # rows' worth of the logits
    members = max([len(unit) for unit in units] + [1])
    weight_grad = head.weight.requires_grad
    whole = chunk
    if weight_grad and whole_units:
        whole = max(chunk, min(members * width, limit))
    plan = UnitPlan(list(starts), list(ends), [list(unit) for unit in units], whole)
    largest = max([_unit_rows(starts, ends, unit) for unit in units] + [0])
    if largest <= whole:
        return plan
    partials_fit = not weight_grad or members * width <= limit
    return plan if single and partials_fit else None


class _State(NamedTuple):
    """Buffers of one pass."""

    grads: Grads  # the final gradients (grad_hidden in hidden's dtype; accumulators)
    buffers: ChunkBuffers
    outputs: list[torch.Tensor]  # (S,) sums, nll, plain, wpo of every sequence
    partials: list[Grads]  # split units: per-member (hidden rows scratch, (V, H), (V,)) partials


def _rows_of(plan: UnitPlan, sequences: Sequence[int], device: torch.device) -> torch.Tensor:
    ranges = [torch.arange(plan.starts[s], plan.ends[s], device=device) for s in sequences]
    if not ranges:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.cat(ranges)


def _chunk_log_probs(
    head: Head, rows: torch.Tensor | slice, weights: TokenWeights, buffers: ChunkBuffers
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden rows, token ids, probs, log_probs, active)`` of one chunk of rows.

    ``probs`` is the chunk's softmax in the scores buffer, ``log_probs`` 0 at unselected rows.
    """
    active = weights.active[rows]
    hidden_chunk, tokens_chunk = select_rows(head.hidden[rows], head.tokens[rows], active)
    scores = chunk_scores(hidden_chunk, head, buffers, rows)  # (n, V)
    target = scores.gather(1, tokens_chunk.unsqueeze(1)).squeeze(1)  # (n,)
    probs, lse = softmax_(scores)  # (n, V) in place, (n,)
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    log_probs = torch.where(active, target - lse, zero)  # (n,)
    return hidden_chunk, tokens_chunk, probs, log_probs, active


def _sums(
    log_probs: torch.Tensor,
    local: torch.Tensor,
    count: int,
    rows: torch.Tensor | slice,
    weights: TokenWeights,
) -> Sums:
    """The per-sequence sums of one chunk's log-probabilities (``local``: sequence of a row)."""
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)

    def segment(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(count, dtype=values.dtype, device=values.device).index_add_(
            0, local, values
        )

    sums = segment(log_probs * weights.sums[rows])
    if weights.nll is not None:
        nll = segment(log_probs * weights.nll[rows])
    else:
        nll = torch.zeros(count, dtype=log_probs.dtype, device=log_probs.device)
    plain = segment(torch.where(weights.mask[rows], log_probs, zero))
    if weights.log_sum_sq is not None:
        aligned = torch.where(weights.mask[rows], log_probs - weights.log_sum_sq[rows], zero)
        wpo = segment(aligned)
    else:
        wpo = torch.zeros(count, dtype=log_probs.dtype, device=log_probs.device)
    return Sums(sums, nll, plain, wpo)


def _gradients(
    loss_fn: UnitLoss, ids: torch.Tensor, sums: Sums
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g^S, g^U)`` of the units' loss by autograd on their formula."""
    with torch.enable_grad():
        s = sums.sums.detach().requires_grad_(True)
        u = sums.nll.detach().requires_grad_(True)
        loss = loss_fn(ids, sums._replace(sums=s, nll=u))
        g_s, g_u = torch.autograd.grad(loss, [s, u], allow_unused=True)
    g_s = torch.zeros_like(s) if g_s is None else g_s
    g_u = torch.zeros_like(u) if g_u is None else g_u
    return g_s.detach(), g_u.detach()


def _record(state: _State, ids: torch.Tensor, sums: Sums) -> None:
    for output, values in zip(state.outputs, sums, strict=True):
        output.index_copy_(0, ids, values.detach())


def _logit_gradient(
    probs: torch.Tensor, tokens: torch.Tensor, coefficient: torch.Tensor, buffers: ChunkBuffers
) -> torch.Tensor:
    r""":math:`c_t(\mathbb{1}[v = y_t] - p_{tv})` in place of ``probs``, softcap chained.

    The gradient with respect to the product's logits (:func:`chain_softcap_`).
    """
    grad = probs.mul_((-coefficient).unsqueeze(1))
    grad = grad.scatter_add_(1, tokens.unsqueeze(1), coefficient.unsqueeze(1))
    return chain_softcap_(grad, buffers)


def _group_step(
    head: Head,
    plan: UnitPlan,
    weights: TokenWeights,
    loss_fn: UnitLoss,
    state: _State,
    sequences: list[int],
) -> None:
    """Whole units in one chunk: logits, sums, :math:`g` by autograd, then the gradient."""
    device = head.hidden.device
    rows = _rows_of(plan, sequences, device)  # (n,)
    lengths = torch.tensor([plan.ends[s] - plan.starts[s] for s in sequences], device=device)
    local = torch.repeat_interleave(torch.arange(len(sequences), device=device), lengths)
    ids = torch.tensor(sequences, dtype=torch.int64, device=device)
    hidden_chunk, tokens, probs, log_probs, _ = _chunk_log_probs(head, rows, weights, state.buffers)
    sums = _sums(log_probs, local, len(sequences), rows, weights)
    _record(state, ids, sums)
    g_s, g_u = _gradients(loss_fn, ids, sums)
    coefficient = g_s[local] * weights.sums[rows]
    if weights.nll is not None:
        coefficient = coefficient + g_u[local] * weights.nll[rows]
    factor = head.transform.row_factor(rows)
    grad_scores = _logit_gradient(probs, tokens, coefficient * factor, state.buffers)
    scratch = state.partials[0]
    n = rows.shape[0]
    grads = Grads(
        None if state.grads.hidden is None else scratch.hidden,
        state.grads.weight,
        state.grads.bias,
    )
    accumulate_grads(grad_scores, hidden_chunk, head, grads, state.buffers, (slice(0, n),))
    if state.grads.hidden is not None and scratch.hidden is not None:
        state.grads.hidden.index_copy_(0, rows, scratch.hidden[:n])


def _split_unit(
    head: Head,
    plan: UnitPlan,
    weights: TokenWeights,
    loss_fn: UnitLoss,
    state: _State,
    unit: list[int],
) -> None:
    """A unit larger than a chunk: per-sequence partials, scaled once the unit's g is known."""
    device, chunk = head.hidden.device, head.chunk_size
    collected: list[Sums] = []
    for member, sequence in enumerate(unit):
        partial = state.partials[member]
        totals = None
        start, end = plan.starts[sequence], plan.ends[sequence]
        first = True
        for low in range(start, end, chunk):
            block = slice(low, min(low + chunk, end))
            n = block.stop - block.start
            hidden_chunk, tokens, probs, log_probs, _ = _chunk_log_probs(
                head, block, weights, state.buffers
            )
            local = torch.zeros(n, dtype=torch.int64, device=device)
            part = _sums(log_probs, local, 1, block, weights)
            totals = (
                part
                if totals is None
                else Sums(*(a + b for a, b in zip(totals, part, strict=True)))
            )
            coefficient = weights.sums[block] * head.transform.row_factor(block)  # gamma after
            grad_scores = _logit_gradient(probs, tokens, coefficient, state.buffers)
            _accumulate_partial(grad_scores, hidden_chunk, head, state, partial, block, first)
            first = False
        if totals is None:  # an empty sequence: no rows
            zeros = torch.zeros(1, dtype=head.dtype, device=device)
            totals = Sums(zeros, zeros, zeros, zeros)
            _clear_partial(partial)
        collected.append(totals)
    sums = Sums(*(torch.cat(parts) for parts in zip(*collected, strict=True)))
    ids = torch.tensor(unit, dtype=torch.int64, device=device)
    _record(state, ids, sums)
    g_s, g_u = _gradients(loss_fn, ids, sums)
    gamma = g_s + g_u  # (k,): b_t is 0 or a_t on each sequence (checked by the caller)
    for member, sequence in enumerate(unit):
        _apply_partial(state, state.partials[member], plan, sequence, gamma[member])


def _accumulate_partial(
    grad_scores: torch.Tensor,
    hidden_chunk: torch.Tensor,
    head: Head,
    state: _State,
    partial: Grads,
    block: slice,
    first: bool,
) -> None:
    """Unscaled ``grad_hidden`` rows into the result, ``(V, H)`` / ``(V,)`` into the partials."""
    if state.grads.hidden is not None:
        grads = Grads(state.grads.hidden, None, None)
        accumulate_grads(grad_scores, hidden_chunk, head, grads, state.buffers, (block,))
    if partial.weight is not None:
        beta = 0.0 if first else 1.0  # the first chunk overwrites the previous unit's partial
        hidden_cast = hidden_chunk.to(partial.weight.dtype)
        partial.weight.addmm_(grad_scores.T, hidden_cast, beta=beta)
    if partial.bias is not None:
        if first:
            partial.bias.copy_(grad_scores.sum(dim=0))
        else:
            partial.bias.add_(grad_scores.sum(dim=0))


def _clear_partial(partial: Grads) -> None:
    if partial.weight is not None:
        partial.weight.zero_()
    if partial.bias is not None:
        partial.bias.zero_()


def _apply_partial(
    state: _State, partial: Grads, plan: UnitPlan, sequence: int, gamma: torch.Tensor
) -> None:
    """Scale the sequence's ``grad_hidden`` rows by gamma; add gamma times its partials."""
    rows = slice(plan.starts[sequence], plan.ends[sequence])
    if state.grads.hidden is not None:
        state.grads.hidden[rows] *= gamma.to(state.grads.hidden.dtype)
    if state.grads.weight is not None and partial.weight is not None:
        state.grads.weight.addcmul_(partial.weight, gamma.to(partial.weight.dtype))
    if state.grads.bias is not None and partial.bias is not None:
        state.grads.bias.addcmul_(partial.bias, gamma.to(partial.bias.dtype))


def _groups(plan: UnitPlan, chunk: int) -> list[tuple[str, list[int]]]:
    """``("group", sequences)`` of whole units within ``chunk`` rows, ``("split", unit)`` else."""
    out: list[tuple[str, list[int]]] = []
    current: list[int] = []
    rows = 0
    for unit in plan.units:
        size = _unit_rows(plan.starts, plan.ends, unit)
        if size > chunk:
            if current:
                out.append(("group", current))
                current, rows = [], 0
            out.append(("split", unit))
            continue
        if rows + size > chunk and current:
            out.append(("group", current))
            current, rows = [], 0
        current = current + unit
        rows += size
    if current:
        out.append(("group", current))
    return out


def run_units(
    head: Head,
    plan: UnitPlan,
    weights: TokenWeights,
    loss_fn: UnitLoss,
    needs: tuple[bool, bool, bool],
) -> tuple[list[torch.Tensor], Grads]:
    """One pass: the per-sequence sums ``[sums, nll, plain, wpo]`` ``(S,)`` and the gradients."""
    device, dtype = head.hidden.device, head.dtype
    sequences = len(plan.starts)
    outputs = [torch.zeros(sequences, dtype=dtype, device=device) for _ in range(4)]
    steps = _groups(plan, plan.whole_rows)
    largest = max([len(unit) for unit in plan.units] + [1])
    split = any(kind == "split" for kind, _ in steps)
    grouped = [_unit_rows(plan.starts, plan.ends, members) for kind, members in steps
               if kind == "group"]  # fmt: skip
    rows = min(max([head.chunk_size, *grouped]), max(head.hidden.shape[0], 1))
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    vocab, width = head.weight.shape
    scratch = Grads(
        torch.empty(rows, width, dtype=head.hidden.dtype, device=device) if needs[0] else None,
        None,
        None,
    )
    partials = [scratch]
    if split:
        partials = [
            Grads(
                scratch.hidden,
                # overwritten by each unit's first chunk (beta = 0), never read before
                torch.empty(vocab, width, dtype=accumulate, device=device) if needs[1] else None,
                torch.empty(vocab, dtype=accumulate, device=device)
                if needs[2] and head.bias is not None
                else None,
            )
            for _ in range(largest)
        ]
    grads = new_grads(head, needs)  # every row of grad_hidden belongs to one sequence: written
    state = _State(grads, new_buffers(head, with_entropy=False, rows=rows), outputs, partials)
    for kind, members in steps:
        if kind == "group":
            _group_step(head, plan, weights, loss_fn, state, members)
        else:
            _split_unit(head, plan, weights, loss_fn, state, members)
    return outputs, grads


class UnitsFromHidden(torch.autograd.Function):
    """``(anchor, sums, nll, plain, wpo)``: the gradients formed in forward on a zero anchor."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        head: Head,
        plan: UnitPlan,
        weights: TokenWeights,
        loss_fn: UnitLoss,
    ) -> tuple[torch.Tensor, ...]:
        """The forward pass (see the module docstring)."""
        needs = (
            bool(ctx.needs_input_grad[0]),
            bool(ctx.needs_input_grad[1]),
            bool(ctx.needs_input_grad[2]),
        )
        outputs, grads = run_units(head, plan, weights, loss_fn, needs)
        ctx.save_for_backward(*grads)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.spent = False
        ctx.mark_non_differentiable(*outputs)
        anchor = torch.zeros((), dtype=head.dtype, device=hidden.device)
        return (anchor, *outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_anchor: torch.Tensor, *unused: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        """The backward pass: the gradients formed in forward times the upstream gradient."""
        if ctx.spent:
            raise RuntimeError(
                "preference_loss_from_hidden supports one backward pass per forward (its "
                "gradients are formed in forward and scaled in place in backward)"
            )
        ctx.spent = True
        results: list[torch.Tensor | None] = []
        for grad, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True):
            if grad is None or dtype is None:
                results.append(None)
            else:
                results.append(grad.mul_(grad_anchor.to(grad.dtype)).to(dtype))
        return (*results, None, None, None, None)
