r"""The chunk drivers of the distillation losses: from logits, and from hidden states.

Every distillation loss is a per-token divergence of the student's next-token distribution
:math:`q = \mathrm{softmax}(x)`, :math:`x = z / \tau`, from a teacher's. Each loss is a
:class:`ChunkRule`: given the ``(n, V)`` scaled student logits of a chunk of rows (a writable
buffer) and optionally the upstream gradient ``g`` of its per-row values, it returns the values
and, with ``g``, the gradient :math:`\partial(\sum_n g_n D_n)/\partial x` in closed form (in the
same buffer). The drivers run a rule over the rows:

- :class:`LogitsDivergence`: logits ``(B, T, V)`` / ``(N, V)`` read one block of rows at a time
  into one float32 (float64) buffer (a strided view such as ``logits[:, :-1]`` is read block by
  block, never copied whole); the backward recomputes each block.
- :class:`HiddenDivergence`: the logits recomputed from the hidden states chunk by chunk with
  the LM-head machinery of :mod:`rlobjectives.logprobs.chunks` (one ``(chunk, V)`` buffer);
  recompute in backward, for any upstream gradient (``reduction="none"``).
- :class:`FusedHiddenDivergence`: for a reduced loss, whose per-token weights
  :math:`\partial\mathcal{L}/\partial D_n` are known from the mask before the loop, the
  gradients ``grad_hidden``, ``grad_weight`` and ``grad_bias`` are formed in the forward chunk
  loop (the fused-linear technique of :mod:`rlobjectives.logprobs.fused_linear`) and returned
  through a zero-valued anchor: no recompute.

Rows outside the mask are loaded as zeros (logits) or from a zero hidden row, before any
arithmetic, and their upstream gradient is 0, so NaN/inf there reaches no value or gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from .._core.chunking import Block, block_rows, flat_rows
from .._core.reduction import masked_fill_zero
from ..logprobs.chunks import (
    ChunkBuffers,
    Grads,
    accumulate_grads,
    chain_softcap_,
    chunk_scores,
    finish_grads,
    new_buffers,
    new_grads,
)
from ..logprobs.head import Head

__all__ = [
    "ChunkOutput",
    "Inverse",
    "ChunkRule",
    "FusedHiddenDivergence",
    "HiddenDivergence",
    "LogitsDivergence",
    "TeacherHead",
    "hidden_rows",
    "logits_rows",
    "scale_rows",
    "softmax_rows_",
]


class ChunkOutput(NamedTuple):
    """A rule's result on one chunk: per-row values and, given an upstream, the gradient."""

    values: torch.Tensor  # (n,) or (n, *value_shape)
    grad: torch.Tensor | None  # (n, V) d(sum g * values) / d scores, in the scores buffer


class ChunkRule(Protocol):
    """A per-token divergence evaluated on one chunk of scaled student logits.

    ``scores`` ``(n, V)`` is a writable buffer (the rule may overwrite it); ``block`` indexes
    the rule's own per-row tensors (the teacher's), ``active`` ``(n,)`` says which rows count
    (the others must give finite values and a zero gradient whatever their teacher data hold)
    and ``upstream`` ``(n, *value_shape)`` is the gradient of the values (0 at inactive rows,
    already divided by the temperature), or None for the values alone.
    """

    @property
    def value_shape(self) -> tuple[int, ...]:
        """The trailing shape of the per-row values: ``()``, or ``(K,)``."""
        ...

    def __call__(
        self,
        scores: torch.Tensor,
        block: Block,
        active: torch.Tensor,
        upstream: torch.Tensor | None,
    ) -> ChunkOutput:
        """The values (and gradient) of the chunk (see the class docstring)."""
        ...


def softmax_rows_(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(probs, log_normaliser, empty)`` of each row of ``scores`` ``(n, V)``, in place.

    ``empty``: rows with no logit above ``-inf``; their log-normaliser is ``-inf`` and their
    "probabilities" are a one-hot at column 0 (finite: the row's column 0 is set to 0 before
    the softmax, one ``(n,)`` write instead of a pass over ``(n, V)``), which the caller weighs
    by 0. The log-normaliser is recovered from the largest probability (at least 1/V, never
    underflows): ``lse = max_v s_v - log max_v p_v``.
    """
    maximum = scores.amax(dim=1)  # (n,)
    empty = maximum == -torch.inf
    first = scores.select(1, 0)  # (n,) a view of column 0
    first.copy_(
        torch.where(empty, torch.zeros((), dtype=scores.dtype, device=scores.device), first)
    )
    if scores.device.type == "cpu":
        probs = torch.ops.aten._softmax.out(scores, 1, False, out=scores)  # (n, V)
    else:
        probs = torch.softmax(scores, dim=1)
    lse = maximum - probs.amax(dim=1).log()
    return probs, torch.where(empty, -torch.inf, lse), empty


# ---------------------------------------------------------------------------------------------
# From logits
# ---------------------------------------------------------------------------------------------


class LogitsRows(NamedTuple):
    """The rows of a logits tensor: a flat ``(N, V)`` view, or the strided ``(B, T, V)`` one."""

    rows: torch.Tensor
    blocks: list[Block]
    flat: bool


def logits_rows(logits: torch.Tensor, chunk_size: int) -> LogitsRows:
    """The logits as ``(N, V)`` when that is a view (blocks of rows), else ``(B, T, V)``."""
    flat = flat_rows(logits)
    if flat is None:
        return LogitsRows(logits, block_rows(logits.shape[:-1], chunk_size, flat=False), False)
    return LogitsRows(flat, block_rows((flat.shape[0],), chunk_size, flat=True), True)


#: :math:`1/\tau`: one number, or one per row (laid out like the rows of the chunk loop).
Inverse = float | torch.Tensor


def scale_rows(values: torch.Tensor, inverse: Inverse, block: Block) -> torch.Tensor:
    r"""``values`` ``(n, ...)`` times the rows' :math:`1/\tau` (a new tensor, or ``values``)."""
    if isinstance(inverse, torch.Tensor):
        factor = inverse[block].to(values.dtype)
        return values * factor.reshape(-1, *(1,) * (values.ndim - 1))
    return values * inverse if inverse != 1.0 else values


def load_scores(
    rows: torch.Tensor,
    block: Block,
    active: torch.Tensor,
    inverse: Inverse,
    buffer: torch.Tensor,
) -> torch.Tensor:
    r"""``rows[block] / tau`` in ``buffer`` (the computation dtype), zeros at inactive rows.

    The block is copied first and its inactive rows are overwritten (a selection, before any
    arithmetic), so NaN/inf there reaches nothing. ``inverse``: :math:`1/\tau`, one number or
    per row (laid out like ``rows``).
    """
    chunk = rows[block]  # (n, V)
    scores = buffer[: chunk.shape[0]]  # (n, V)
    scores.copy_(chunk)
    scores.masked_fill_(~active.unsqueeze(1), 0.0)
    if isinstance(inverse, torch.Tensor):
        scores.mul_(inverse[block].to(scores.dtype).reshape(-1, 1))
    elif inverse != 1.0:
        scores.mul_(inverse)
    return scores


def _rule_rows(tensor: torch.Tensor, flat: bool, leading: int) -> torch.Tensor:
    return tensor.reshape(-1, *tensor.shape[leading:]) if flat else tensor


def _rule_inverse(inverse: Inverse, flat: bool, leading: int) -> Inverse:
    r"""A per-row :math:`1/\tau` laid out like the loop's rows (flat or leading-shaped)."""
    return _rule_rows(inverse, flat, leading) if isinstance(inverse, torch.Tensor) else inverse


class LogitsDivergence(torch.autograd.Function):
    """A :class:`ChunkRule` over logits ``(B, T, V)`` / ``(N, V)``; recompute in backward.

    ``active`` has the leading shape of ``logits``; the rule's per-row tensors too (when the
    logits are flattened to ``(N, V)`` the driver's blocks are flat row ranges, and the rule
    must hold its tensors flattened alike: :func:`logits_rows` decides, the caller builds the
    rule with ``flat=rows.flat``). Returns the values ``(*leading, *value_shape)``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        rule: ChunkRule,
        active: torch.Tensor,
        inv_temperature: Inverse,
        chunk_size: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The forward pass (see the class docstring)."""
        layout = logits_rows(logits, chunk_size)
        selected = _rule_rows(active, layout.flat, active.ndim)
        inverse = _rule_inverse(inv_temperature, layout.flat, active.ndim)
        values = torch.zeros(
            (*selected.shape, *rule.value_shape), dtype=dtype, device=logits.device
        )
        buffer = _logits_buffer(layout, chunk_size, dtype)
        for block in layout.blocks:
            scores = load_scores(layout.rows, block, selected[block], inverse, buffer)
            values[block] = rule(scores, block, selected[block], None).values
        ctx.save_for_backward(logits, active)
        ctx.rule, ctx.options = rule, (inv_temperature, chunk_size, dtype)
        out_active = active.reshape(*active.shape, *(1,) * len(rule.value_shape))
        return masked_fill_zero(values.reshape(*active.shape, *rule.value_shape), out_active)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        logits, active = ctx.saved_tensors
        rule: ChunkRule = ctx.rule
        inv_temperature, chunk_size, dtype = ctx.options
        layout = logits_rows(logits, chunk_size)
        leading = active.ndim
        upstream = _upstream(grad, active, len(rule.value_shape), inv_temperature, dtype)
        selected = _rule_rows(_rows_with_gradient(active, upstream, leading), layout.flat, leading)
        upstream = _rule_rows(upstream, layout.flat, leading)
        inverse = _rule_inverse(inv_temperature, layout.flat, leading)
        grad_rows = torch.empty(layout.rows.shape, dtype=logits.dtype, device=logits.device)
        buffer = _logits_buffer(layout, chunk_size, dtype)
        for block in layout.blocks:
            scores = load_scores(layout.rows, block, selected[block], inverse, buffer)
            out = rule(scores, block, selected[block], upstream[block])
            assert out.grad is not None  # an upstream was given
            grad_rows[block] = out.grad
        return grad_rows.reshape(logits.shape), None, None, None, None, None


def _logits_buffer(layout: LogitsRows, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    rows = layout.rows
    width = rows.shape[0] if layout.flat else rows.shape[1]
    return torch.empty(min(chunk_size, max(width, 1)), rows.shape[-1], dtype=dtype,
                       device=rows.device)  # fmt: skip


def _upstream(
    grad: torch.Tensor, active: torch.Tensor, extra: int, factor: Inverse, dtype: torch.dtype
) -> torch.Tensor:
    r"""The upstream gradient in ``dtype``, 0 at inactive rows, times ``factor``.

    ``factor``: :math:`\partial x / \partial z` per row without the softcap's :math:`1 - t^2`
    (:math:`s/\tau`; one number, or ``active``'s shape).
    """
    selected = active.reshape(*active.shape, *(1,) * extra)
    upstream = masked_fill_zero(grad.to(dtype), selected)
    if isinstance(factor, torch.Tensor):
        return upstream * factor.to(dtype).reshape(*active.shape, *(1,) * extra)
    return upstream * factor


def _rows_with_gradient(active: torch.Tensor, upstream: torch.Tensor, leading: int) -> torch.Tensor:
    """Active rows with a nonzero upstream gradient (the others get an exact zero gradient)."""
    nonzero = upstream != 0
    while nonzero.ndim > leading:
        nonzero = nonzero.any(-1)
    return active & nonzero


# ---------------------------------------------------------------------------------------------
# From hidden states
# ---------------------------------------------------------------------------------------------


def hidden_rows(head: Head) -> list[Block]:
    """The flat row blocks of a head's ``(N, H)`` hidden states."""
    return block_rows((head.hidden.shape[0],), head.chunk_size, flat=True)


def _hidden_scores(
    head: Head, block: Block, active: torch.Tensor, buffers: ChunkBuffers
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(hidden_chunk, scores)``: inactive hidden rows zeroed, then the transformed logits.

    :math:`\mathrm{cap}_c(s(h W^T + b)) / \tau` (:func:`~rlobjectives.logprobs.chunks.chunk_scores`;
    with a softcap its :math:`1 - t^2` in ``buffers.derivative``).
    """
    hidden_chunk = masked_fill_zero(head.hidden[block], active.unsqueeze(-1))  # (n, H)
    return hidden_chunk, chunk_scores(hidden_chunk, head, buffers, block[0])


class TeacherHead:
    """The teacher's logits of a chunk from its own hidden states and LM head (no gradient).

    ``head`` is the teacher's validated head (its ``dtype`` the call's computation dtype); the
    scaled logits of each chunk go into one reused ``(chunk, V)`` buffer.
    """

    def __init__(self, head: Head, rows: int) -> None:
        self.head = head
        buffers = new_buffers(head, with_entropy=False, rows=rows)
        self.buffers = buffers._replace(derivative=None)  # the teacher gets no gradient

    def __call__(self, block: Block, active: torch.Tensor) -> torch.Tensor:
        """The ``(n, V)`` scaled teacher logits of ``block`` (zeros-hidden rows where inactive)."""
        with torch.no_grad():
            return _hidden_scores(self.head, block, active, self.buffers)[1]


def _hidden_pass(
    head: Head,
    rule: ChunkRule,
    active: torch.Tensor,
    upstream: torch.Tensor | None,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, Grads | None]:
    """One chunk loop: the values ``(N, *value_shape)`` and, with ``upstream``, the gradients.

    The gradients are raw :class:`Grads` (float32/64 accumulators for ``weight`` and ``bias``).
    """
    rows, device = head.hidden.shape[0], head.hidden.device
    values = torch.zeros((rows, *rule.value_shape), dtype=head.dtype, device=device)
    buffers = new_buffers(head, with_entropy=False)
    grads = new_grads(head, needs) if upstream is not None else None
    for block in hidden_rows(head):
        selected = active[block]
        hidden_chunk, scores = _hidden_scores(head, block, selected, buffers)
        out = rule(scores, block, selected, None if upstream is None else upstream[block])
        values[block] = out.values
        if grads is not None and out.grad is not None:
            grad = chain_softcap_(out.grad, buffers)
            accumulate_grads(grad, hidden_chunk, head, grads, buffers, block)
    values = masked_fill_zero(values, active.reshape(-1, *(1,) * len(rule.value_shape)))
    return values, grads


class HiddenDivergence(torch.autograd.Function):
    """A :class:`ChunkRule` over ``(h W^T + b) / tau``, chunked; recompute in backward.

    ``hidden``, ``weight`` and ``bias`` are passed both on their own (so autograd sees them)
    and inside ``head``. Returns the values ``(N, *value_shape)``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        head: Head,
        rule: ChunkRule,
        active: torch.Tensor,
    ) -> torch.Tensor:
        """The forward pass (see the class docstring)."""
        values, _ = _hidden_pass(head, rule, active, None, (False, False, False))
        ctx.save_for_backward(hidden, weight, bias, active)
        ctx.head, ctx.rule = head, rule
        return values

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        hidden, weight, bias, active = ctx.saved_tensors
        head: Head = ctx.head._replace(hidden=hidden, weight=weight, bias=bias)
        rule: ChunkRule = ctx.rule
        factor = head.transform.row_factor(slice(None))
        upstream = _upstream(grad, active, len(rule.value_shape), factor, head.dtype)
        selected = _rows_with_gradient(active, upstream, 1)
        needs = tuple(bool(ctx.needs_input_grad[i]) for i in range(3))
        _, grads = _hidden_pass(head, rule, selected, upstream, needs)  # type: ignore[arg-type]
        assert grads is not None  # an upstream was given
        return (*finish_grads(head, grads), None, None, None)


class FusedHiddenDivergence(torch.autograd.Function):
    r"""``(anchor, values)``: the gradients of ``sum_n w_n D_n`` formed in the forward pass.

    ``weights`` ``(N,)`` are the reduced loss's per-token derivatives
    :math:`\partial\mathcal{L}/\partial D_n` (0 at unselected tokens). ``values`` are the
    detached per-token divergences; ``anchor`` is a zero whose backward returns the saved
    gradients times its upstream (scaled in place: one backward per forward).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        head: Head,
        rule: ChunkRule,
        active: torch.Tensor,
        weights: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass (see the class docstring)."""
        needs = tuple(bool(ctx.needs_input_grad[i]) for i in range(3))
        upstream = _upstream(weights, active, 0, head.transform.row_factor(slice(None)), head.dtype)
        values, grads = _hidden_pass(head, rule, active, upstream, needs)  # type: ignore[arg-type]
        assert grads is not None  # an upstream was given
        ctx.save_for_backward(*grads)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.spent = False
        ctx.mark_non_differentiable(values)
        return torch.zeros((), dtype=head.dtype, device=hidden.device), values

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad_anchor: torch.Tensor, unused: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        """The backward pass (see the class docstring)."""
        if ctx.spent:
            raise RuntimeError(
                "the fused distillation losses from hidden states support one backward pass per "
                "forward (their gradients are formed in forward and scaled in place)"
            )
        ctx.spent = True
        grads = [
            None if grad is None or dtype is None else grad.mul_(grad_anchor.to(grad.dtype))
            for grad, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True)
        ]
        grads = [
            None if grad is None or dtype is None else grad.to(dtype)
            for grad, dtype in zip(grads, ctx.dtypes, strict=True)
        ]
        return (*grads, None, None, None, None)


#: A source of the teacher's scaled logits for a chunk: ``(block, active) -> (n, V)``.
TeacherLogits = Callable[[Block, torch.Tensor], torch.Tensor]
