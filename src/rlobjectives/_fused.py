r"""Fused forward/backward of the clipped policy surrogate (used by :func:`policy_loss`).

:class:`ClippedSurrogateFunction` computes, in one forward pass over the ``(B, T)`` inputs, the
surrogate :math:`s`, its reduction, the eight diagnostics and the gradient coefficient
:math:`\partial s_{it} / \partial \ell_{it}`; the backward is one multiplication by the
reduction's per-sequence weight. It saves one float ``(B, T)`` tensor (the coefficient, in the
computation dtype) plus the mask and a ``(B, 1)`` weight, where autograd keeps about six
``(B, T)`` tensors. It is only used when ``log_probs`` is the one input that requires grad.

The math is that of :func:`rlobjectives._policy._policy_loss_terms` (the autograd path, kept for
tests and for the other cases), written per sign of the advantage:

.. math::

    s = A \cdot \mathrm{clip}(r, L, H), \qquad
    (L, H) = \begin{cases} (-\infty,\ 1 + \epsilon_{high}) & A > 0 \\
                           (1 - \epsilon_{low},\ c) & A < 0 \end{cases}

(:math:`c = \infty` without dual clip, no bounds without clipping), which is
``max(min(rA, clip(r)A), cA)`` product for product, and
:math:`\partial s / \partial \ell = rA` where :math:`L \le r \le H` and the log-ratio is within
its bound, else 0. This reproduces autograd's conventions: ``torch.clamp`` passes the gradient on
the closed interval (ratio band and log-ratio bound); in the band ``torch.minimum`` sees a tie of
two equal products and its two halves add up to the full gradient; at an exact dual-clip tie
:math:`r = c` ``torch.maximum`` passes half, and so does the fused path. Unselected positions are
exact zeros before any arithmetic (log-ratio 0, ratio 1, advantage 0): NaN/inf there reaches no
value, diagnostic or gradient. NaN at a selected position propagates to the loss.

Documented deviations from the autograd path (all at measure-zero or non-finite inputs):

- clipping is decided on the ratio (:math:`r > H` or :math:`r < L`); autograd decides on the
  rounded products :math:`rA` vs :math:`\mathrm{clip}(r)A`, which can tie when :math:`r` is within
  an ulp of an edge or :math:`|A|` is tiny; autograd then passes half the gradient, the fused path
  none;
- a NaN ratio counts as above the band (and as out of the log-ratio bound) in the diagnostics, and
  without a log-ratio bound gets gradient 0 (autograd: NaN) where :math:`A > 0`;
- ``approx_kl_k3`` is :math:`\sum (r - 1) - \sum \log r` from the ratio already computed when
  the token-level bound is on (absolute error about 1e-7 per token in float32; autograd path:
  ``expm1``), and the final sums are ordered differently (rounding-level differences);
- double backward raises (first-order gradients only).

Implementation notes (CPU speed; the same code compiles under ``torch.compile(fullgraph=True)``):
masking is :func:`_select`, ``torch.where(mask, values, 0)`` computed as a bitwise AND of the
IEEE-754 bits with an all-ones/all-zeros integer mask (exact: a selected value keeps every bit, an
unselected one becomes +0.0 whatever it held), several times faster than ``torch.where`` on CPU;
comparisons of non-negative floats are integer subtractions of their bits (:class:`_Bits`), which
yield the select masks directly; temporaries are updated in place, because on CPU a fresh
``(B, T)`` buffer costs page faults that often exceed the arithmetic.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import torch

__all__ = ["ClippedSurrogateFunction", "SurrogateSpec", "mask_bits"]

_BITS_DTYPE = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


class SurrogateSpec(NamedTuple):
    """Validated options of one fused call (Python numbers or 0-d tensors)."""

    clip_low: float | torch.Tensor | None
    clip_high: float | torch.Tensor | None
    dual_clip: float | torch.Tensor | None
    ratio_level: str
    log_ratio_bound: float | torch.Tensor | None
    # Bound of the diagnostic k3 log-ratio (``log_ratio_bound`` or the diagnostic default).
    diagnostic_bound: float | torch.Tensor
    reduction: str
    normalizer: float | torch.Tensor | None
    max_response_length: float
    diagnostics_normalizer: float | torch.Tensor | None
    dtype: torch.dtype  # computation dtype: float32 or float64


def mask_bits(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Integer ``(B, T)`` mask of the width of ``dtype``: all ones where selected, else zero."""
    return mask.to(_BITS_DTYPE[dtype]).neg_()


def _select(values: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``torch.where(mask, values, 0)`` as a bitwise AND of the float bits (exact, NaN-proof)."""
    selected = values.expand_as(bits).view(bits.dtype) & bits  # (B, T)
    return selected.view(values.dtype)


def _as_tensor(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)


def _clamp(
    values: torch.Tensor, low: float | torch.Tensor, high: float | torch.Tensor
) -> torch.Tensor:
    """``values.clamp(low, high)`` for Python-number or 0-d-tensor bounds (inclusive)."""
    if isinstance(low, torch.Tensor) or isinstance(high, torch.Tensor):
        return torch.clamp(values, _as_tensor(low, values), _as_tensor(high, values))
    return values.clamp(low, high)


class _Bits:
    """Integer views of non-negative floats, which order like the floats they encode.

    For ``x, y`` in ``[+0, +inf]`` or NaN with the sign bit cleared, ``x < y`` iff
    ``bits(x) < bits(y)``, and ``(bits(x) - bits(y)) >> (width - 1)`` is all ones exactly where
    ``x < y``: a comparison that yields a select mask directly, in two integer operations.
    A NaN (sign cleared) compares above every number, +inf included.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.float_dtype = dtype
        self.int_dtype = _BITS_DTYPE[dtype]
        self.device = device
        self.shift = torch.finfo(dtype).bits - 1

    def of(self, value: float | torch.Tensor) -> int | torch.Tensor:
        """Bits of ``max(value, 0)``: a Python int for a number, a 0-d int tensor for a tensor."""
        if isinstance(value, torch.Tensor):
            number = value.to(dtype=self.float_dtype, device=self.device)
            return number.clamp(min=0.0).view(self.int_dtype)
        float_code, int_code = ("<f", "<i") if self.float_dtype == torch.float32 else ("<d", "<q")
        return int(struct.unpack(int_code, struct.pack(float_code, max(float(value), 0.0)))[0])

    def less(
        self,
        left: torch.Tensor | int,
        right: torch.Tensor | int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """All ones where ``left < right`` (magnitude bits; one of them a tensor), else zero."""
        if isinstance(left, torch.Tensor):
            difference = torch.sub(left, right, out=out)
        else:  # left - right as -(right - left)
            difference = torch.sub(right, left, out=out).neg_()
        return difference.bitwise_right_shift_(self.shift)


def _sign_bits(advantages: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Select masks of ``A > 0`` and ``A < 0`` (NaN: neither), in the shape of ``advantages``."""
    return mask_bits(advantages > 0, dtype), mask_bits(advantages < 0, dtype)


class _Forward(NamedTuple):
    loss: torch.Tensor  # () or (B, T) for reduction "none", computation dtype
    row_sums: torch.Tensor  # (B,) sum_t s_it over selected tokens
    diagnostics: torch.Tensor  # (8,) see PolicyLossDiagnostics (field order)
    coefficient: torch.Tensor  # (B, T) d s_it / d log_probs_it, zero at unselected tokens
    row_weights: torch.Tensor  # (B, 1) d loss / d s_it (the reduction's weight, negated)


def _fused_forward(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: SurrogateSpec,
) -> _Forward:
    r"""The whole forward: values, diagnostics and the gradient coefficient, no autograd graph.

    With :math:`A` per sequence or per token, the surrogate is written
    :math:`s = A \cdot \mathrm{clip}(r, L, H)`, where the bounds depend on the sign of
    :math:`A` only: :math:`A > 0`: :math:`(-\infty, 1 + \epsilon_{high}]`; :math:`A < 0`:
    :math:`[1 - \epsilon_{low}, c]` (:math:`c = \infty` without dual clip). This is
    ``max(min(rA, clip(r)A), cA)`` product for product (the clipped branch is the same
    product :math:`A \cdot \text{edge}`), and :math:`\partial s / \partial \log\pi = rA` where
    :math:`L \le r \le H` (and the log-ratio is inside its bound), else 0.

    Temporaries are updated in place where possible: on CPU a fresh ``(B, T)`` buffer costs
    page faults, often more than the arithmetic.
    """
    dtype = spec.dtype
    device = log_probs.device
    bits = _Bits(dtype, device)
    keep = mask_bits(mask, dtype)  # (B, T) all ones where selected; becomes the gradient gate
    counts = -keep.sum(dim=-1, dtype=keep.dtype)  # (B,) selected tokens per sequence
    count = counts.sum()  # ()
    # Select before any arithmetic: unselected positions are exact zeros (log-ratio 0, ratio 1,
    # advantage 0), so NaN/inf there reaches neither the values nor the coefficient.
    log_ratio = _select_(log_probs.to(dtype) - old_log_probs.to(dtype), keep)  # (B, T)
    # (B, 1) or (B, T); never selected itself: every product with it is selected afterwards.
    advantages = advantages.to(dtype)

    approx_kl_k1 = -log_ratio.sum()
    approx_kl_k3 = None
    if spec.ratio_level != "token" or spec.log_ratio_bound is None:
        kl_log_ratio = _clamp(log_ratio, -spec.diagnostic_bound, spec.diagnostic_bound)
        approx_kl_k3 = (torch.expm1(kl_log_ratio) - kl_log_ratio).sum()
        del kl_log_ratio

    if spec.ratio_level == "token":
        token_log_ratio = log_ratio  # (B, T)
    else:
        # GSPO: value log s_i (mean selected log-ratio of the row) at every selected token,
        # gradient 1 w.r.t. log_probs (the stop-gradient form); (x - x) keeps NaN/inf of x.
        per_row = counts.clamp(min=1).to(dtype).unsqueeze(-1)  # (B, 1)
        sequence_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / per_row  # (B, 1)
        selected = _select(log_probs.to(dtype), keep)  # (B, T)
        token_log_ratio = _select_(selected.sub_(selected).add_(sequence_log_ratio), keep)
    del log_ratio

    bound = spec.log_ratio_bound
    bound_fired = None
    if bound is None:
        ratio = token_log_ratio.exp()  # (B, T)
        bounded_sum = None
    else:
        ratio = _clamp(token_log_ratio, -bound, bound)  # (B, T) bounded log-ratio
        bounded_sum = ratio.sum()
        ratio.exp_()  # (B, T) ratio
        # |log-ratio| > bound (NaN included): torch.clamp passes no gradient there. The
        # log-ratio is not needed any more: its buffer becomes the mask.
        fired = _less_(bits.of(bound), _magnitude_(token_log_ratio))  # (B, T)
        bound_fired = _count_bits(fired)
        keep &= fired.bitwise_not_()
        del fired
    del token_log_ratio
    # The ratio is >= +0 or NaN, so its bits order like its values (a NaN with the sign bit
    # set, which exp does not produce from finite input, would count as below the band).
    ratio_bits = ratio.view(bits.int_dtype)  # (B, T), no copy

    positive, negative = _sign_bits(advantages, dtype)  # shape of A (at unselected positions
    # the ratio is 1, never clipped, so the signs need no mask)
    infinity = float("inf")
    low: float | torch.Tensor = -infinity
    high: float | torch.Tensor = infinity
    clip_counts = None
    if spec.clip_low is not None:
        clip_high = spec.clip_low if spec.clip_high is None else spec.clip_high
        low, high = 1.0 - spec.clip_low, 1.0 + clip_high
        flags = bits.less(ratio_bits, bits.of(low))  # (B, T) r < 1 - eps_low
        below = _count_bits(flags)
        binding_low = _count_bits(flags.bitwise_and_(negative))  # the low clip binds (A < 0)
        keep &= flags.bitwise_not_()
        flags = bits.less(bits.of(high), ratio_bits, out=flags)  # r > 1 + eps_high (NaN too)
        above = _count_bits(flags)
        binding_high = _count_bits(flags.bitwise_and_(positive))  # the high clip binds (A > 0)
        keep &= flags.bitwise_not_()
        clip_counts = (below + above, binding_low, binding_high)
        del flags
    dual_count = None
    if spec.dual_clip is not None:
        dual_binding = bits.less(bits.of(spec.dual_clip), ratio_bits).bitwise_and_(negative)
        dual_count = _count_bits(dual_binding)
        keep &= dual_binding.bitwise_not_()
        del dual_binding
    del ratio_bits, positive, negative

    # Gradient coefficient d s / d log_probs = r A where the unclipped branch is active.
    coefficient = _select_(ratio * advantages, keep)  # (B, T)
    # Sum of r - 1 over the selected tokens (r = 1 exactly elsewhere), in the mask's buffer;
    # then the buffer holds the selection again (no new (B, T) allocation).
    ratio_excess = torch.sub(ratio, 1.0, out=keep.view(dtype)).sum()
    selection = keep.copy_(mask).neg_()  # (B, T) all ones where selected
    del keep
    if spec.dual_clip is not None:
        # At r == c exactly torch.maximum(s, cA) ties and passes half of the gradient.
        tie = (ratio == _as_tensor(spec.dual_clip, ratio)) & (advantages < 0)
        coefficient = torch.where(tie, 0.5 * coefficient, coefficient)

    # Values: s = A * clip(r, L, H), L and H in the shape of A; +0 at unselected positions.
    upper_negative = infinity if spec.dual_clip is None else spec.dual_clip
    lower = torch.full_like(advantages, -infinity).masked_fill_(advantages < 0, low)
    upper = (
        torch.full_like(advantages, infinity)
        .masked_fill_(advantages > 0, high)
        .masked_fill_(advantages < 0, upper_negative)
    )
    surrogate = torch.maximum(ratio, lower, out=ratio)  # (B, T) overwrites the ratio
    surrogate = _select_(torch.minimum(surrogate, upper, out=surrogate).mul_(advantages), selection)
    del lower, upper

    # Reduction weights w_i (the loss is -sum_it w_i s_it) and the loss.
    row_sums = surrogate.sum(dim=-1)  # (B,)
    batch = log_probs.shape[0]
    ones = torch.ones((batch, 1), dtype=dtype, device=device)
    if spec.reduction == "token_mean":
        denominator = (
            count.to(dtype).clamp(min=1)
            if spec.normalizer is None
            else _as_tensor(spec.normalizer, ones)
        )
        row_weights = ones / denominator  # (B, 1)
        loss = -row_sums.sum() / denominator
    elif spec.reduction == "sequence_mean":
        sequences = (counts > 0).sum().to(dtype).clamp(min=1)
        denominator = sequences if spec.normalizer is None else _as_tensor(spec.normalizer, ones)
        per_token = counts.clamp(min=1).to(dtype).unsqueeze(-1)  # (B, 1)
        row_weights = ones / per_token / denominator  # (B, 1)
        loss = -(row_sums.unsqueeze(-1) / per_token).sum() / denominator
    elif spec.reduction == "sequence_sum_normalized":
        constant = max(spec.max_response_length, 1.0)
        if spec.normalizer is None:
            denominator = _as_tensor(max(batch, 1) * constant, ones)
        else:
            denominator = _as_tensor(spec.normalizer, ones) * constant
        row_weights = ones / denominator  # (B, 1)
        loss = -row_sums.sum() / denominator
    else:  # "none": -s, +0.0 at unselected positions (where s is +-0)
        row_weights = ones
        loss = _select_(surrogate.neg_(), selection)  # (B, T)

    diagnostics = _diagnostics(
        approx_kl_k1=approx_kl_k1,
        approx_kl_k3=approx_kl_k3,
        bounded_sum=bounded_sum,
        ratio_excess=ratio_excess,
        count=count,
        bound_fired=bound_fired,
        clip_counts=clip_counts,
        dual_count=dual_count,
        spec=spec,
    )
    return _Forward(loss, row_sums, diagnostics, coefficient, -row_weights)


def _select_(values: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """In-place :func:`_select` of a temporary ``values`` of the shape of ``bits``."""
    values.view(bits.dtype).bitwise_and_(bits)
    return values


def _magnitude_(values: torch.Tensor) -> torch.Tensor:
    """In place: the bits of ``|values|`` (NaN of either sign becomes a positive NaN)."""
    bits = values.view(_BITS_DTYPE[values.dtype])
    return bits.bitwise_and_(torch.iinfo(bits.dtype).max)


def _less_(left: torch.Tensor | int, right: torch.Tensor) -> torch.Tensor:
    """All ones where ``left < right`` (magnitude bits), computed in place into ``right``."""
    shift = torch.iinfo(right.dtype).bits - 1
    return right.neg_().add_(left).bitwise_right_shift_(shift)


def _count_bits(select: torch.Tensor) -> torch.Tensor:
    """Number of all-ones entries of an integer select mask (a 0-d integer tensor)."""
    return -select.sum(dtype=select.dtype)


def _diagnostics(
    *,
    approx_kl_k1: torch.Tensor,
    approx_kl_k3: torch.Tensor | None,
    bounded_sum: torch.Tensor | None,
    ratio_excess: torch.Tensor,
    count: torch.Tensor,
    bound_fired: torch.Tensor | None,
    clip_counts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    dual_count: torch.Tensor | None,
    spec: SurrogateSpec,
) -> torch.Tensor:
    """The eight diagnostics as one ``(8,)`` tensor (PolicyLossDiagnostics field order).

    At unselected positions the log-ratio is 0 and the ratio exactly 1 (inside the band and the
    bound), so none of the counts needs the mask. ``ratio_excess`` is the sum of ``r - 1``.
    """
    dtype = spec.dtype
    denominator = (
        count.to(dtype).clamp(min=1)
        if spec.diagnostics_normalizer is None
        else _as_tensor(spec.diagnostics_normalizer, approx_kl_k1)
    )
    zero = torch.zeros((), dtype=count.dtype, device=count.device)
    clipped, clip_low, clip_high = (zero, zero, zero) if clip_counts is None else clip_counts
    dual = zero if dual_count is None else dual_count
    fired = zero if bound_fired is None else bound_fired
    ratio_sum = ratio_excess + count.to(dtype)
    if approx_kl_k3 is None:
        # Token level with a bound: k3 = r - 1 - log r from the ratio already computed
        # (log r = the bounded log-ratio, the same clamp as the diagnostic's).
        assert bounded_sum is not None
        approx_kl_k3 = ratio_excess - bounded_sum
    counted = torch.stack([clipped, clip_low, clip_high, dual, fired]).to(dtype)
    numerators = torch.cat([counted, torch.stack([ratio_sum, approx_kl_k1, approx_kl_k3])])
    return numerators / denominator


class ClippedSurrogateFunction(torch.autograd.Function):
    """Fused clipped surrogate: ``(loss, row_sums, diagnostics)`` with a one-multiply backward.

    ``forward(log_probs, old_log_probs, advantages, mask, spec)``; only ``log_probs`` receives a
    gradient (callers route inputs that require grad elsewhere to the autograd path).
    """

    @staticmethod
    def forward(
        ctx: Any,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        spec: SurrogateSpec,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = _fused_forward(log_probs, old_log_probs, advantages, mask, spec)
        ctx.save_for_backward(out.coefficient, mask, out.row_weights)
        ctx.reduction = spec.reduction
        ctx.input_dtype = log_probs.dtype
        ctx.mark_non_differentiable(out.diagnostics)
        return out.loss, out.row_sums, out.diagnostics

    @staticmethod
    def backward(
        ctx: Any,
        grad_loss: torch.Tensor,
        grad_row_sums: torch.Tensor,
        grad_diagnostics: torch.Tensor,
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        coefficient, mask, row_weights = ctx.saved_tensors
        differentiable = torch.is_grad_enabled()  # backward(create_graph=True)
        with torch.no_grad():
            if ctx.reduction == "none":
                scale = grad_loss * row_weights + grad_row_sums.unsqueeze(-1)  # (B, T)
                grad = _select(coefficient * scale, mask_bits(mask, coefficient.dtype))
            else:
                scale = grad_loss * row_weights + grad_row_sums.unsqueeze(-1)  # (B, 1)
                grad = coefficient * scale  # (B, T)
            grad = grad.to(ctx.input_dtype)
        if differentiable and not torch.compiler.is_compiling():
            # The gradient is not differentiable: differentiating it raises this error (the
            # mechanism of torch.autograd.function.once_differentiable, made unconditional).
            grad = torch._C._functions.DelayedError(_DOUBLE_BACKWARD_ERROR, 1)(
                grad.detach().requires_grad_(True)
            )
        return grad, None, None, None, None


_DOUBLE_BACKWARD_ERROR = (
    b"rlobjectives: the fused policy loss (policy_loss / grpo_clipped_surrogate with only "
    b"log_probs requiring grad) supports first-order gradients only; for double backward make "
    b"old_log_probs or advantages require grad too, which selects the autograd path"
)
