r"""Per-block math of the chunked logits functions, on ``(C, V)`` logits already divided by tau.

Forward functions (``chunk_*``) and their closed-form gradients (``chunk_*_grad``): plain
functions that the chunked autograd Functions of :mod:`rlobjectives.logprobs.functions` (and the
tests) call on one block of rows at a time. The gradient functions work in place on their own
intermediates: call them where autograd is off.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._core.chunking import scratch_rows

__all__ = [
    "Moments",
    "chunk_entropy",
    "chunk_entropy_grad",
    "chunk_kl",
    "chunk_kl_grads",
    "chunk_token_log_probs",
    "chunk_token_log_probs_grad",
    "entropy_logit_grads_",
    "entropy_stats_",
    "finite_log_probs_",
    "row_dots",
    "slice_entropy_grad",
    "slice_grads_",
    "slice_kl",
    "slice_kl_grads",
    "slice_log_probs_grad",
    "slice_moments_",
    "slice_stats",
    "xlogy_terms",
]


def xlogy_terms(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``probs * values`` with 0 wherever ``probs == 0`` (so 0 * -inf = 0 for -inf logits).

    NaN probabilities (NaN logits in a selected row) still propagate.
    """
    return torch.where(
        probs == 0, torch.zeros((), dtype=probs.dtype, device=probs.device), probs * values
    )


#: Rows per product of :func:`row_dots`.
ROW_DOT_BLOCK = 8


def row_dots(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    r"""The dot product of each row of ``left`` with the same row of ``right`` ``(C, V)``: ``(C,)``.

    :math:`\sum_v a_{iv} b_{iv}`, on CPU as the diagonals of the products of blocks of
    :data:`ROW_DOT_BLOCK` rows (:math:`A_k B_k^\top`, one BLAS call each): on one thread
    ``torch.linalg.vecdot`` and a batched ``torch.bmm`` of ``(1, V)`` by ``(V, 1)`` took 8x and
    10x as long (float32, 4 rows, V = 32000). Elsewhere ``torch.linalg.vecdot``.
    """
    if left.device.type != "cpu":
        dots: torch.Tensor = torch.linalg.vecdot(left, right)
        return dots
    step = ROW_DOT_BLOCK
    blocks = [slice(start, start + step) for start in range(0, left.shape[0], step)]
    return torch.cat([torch.mm(left[rows], right[rows].T).diagonal() for rows in blocks])


def finite_log_probs_(log_probs: torch.Tensor) -> torch.Tensor:
    """Clamp ``-inf`` log-probabilities to the most negative finite value, in place.

    Then ``p * log p = 0 * finite = 0`` for ``-inf`` logits; NaN still propagates.
    """
    return log_probs.clamp_(min=torch.finfo(log_probs.dtype).min)


def chunk_token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    r"""Log-softmax at the sampled tokens of one chunk: :math:`x_{n,y_n} - \log\sum_v e^{x_{nv}}`.

    Args:
        logits: ``(C, V)`` logits of the chunk, already divided by the temperature.
        tokens: ``(C,)`` int64 token ids in ``[0, V)``.
        dtype: computation and result dtype (float32, or float64).

    Returns:
        ``(C,)`` log-probabilities in ``dtype`` (differentiable).
    """
    log_probs = torch.log_softmax(logits, dim=-1, dtype=dtype)  # (C, V)
    return log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def chunk_token_log_probs_grad(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    grad: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    r"""Gradient of :func:`chunk_token_log_probs` w.r.t. its logits: ``(onehot - p) g``.

    .. math::

        \frac{\partial}{\partial x_{nv}} \sum_n g_n \log p_{n y_n}
        = g_n (\mathbb{1}[v = y_n] - p_{nv}).

    Args:
        logits: ``(C, V)`` as passed to :func:`chunk_token_log_probs` (not modified).
        tokens: ``(C,)`` int64.
        grad: ``(C,)`` upstream gradient of the log-probs, in ``dtype``.
        dtype: computation and result dtype.

    Returns:
        ``(C, V)`` gradient in ``dtype`` (a new tensor; not differentiable).
    """
    grad_logits = torch.softmax(logits, dim=-1, dtype=dtype)  # (C, V) p
    grad_logits.mul_((-grad).unsqueeze(-1))  # (C, V) -g p
    return grad_logits.scatter_add_(-1, tokens.unsqueeze(-1), grad.unsqueeze(-1))


def chunk_entropy(logits: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    r"""Entropy of the softmax of one chunk: :math:`-\sum_v p_v \log p_v` (0 log 0 = 0).

    Args:
        logits: ``(C, V)`` logits already divided by the temperature.
        dtype: computation and result dtype.

    Returns:
        ``(C,)`` entropies in ``dtype`` (not differentiable: in-place ops).
    """
    log_probs = torch.log_softmax(logits, dim=-1, dtype=dtype)  # (C, V)
    probs = torch.exp(log_probs)  # (C, V)
    entropy: torch.Tensor = -row_dots(probs, finite_log_probs_(log_probs))  # (C,)
    return entropy


def chunk_entropy_grad(
    logits: torch.Tensor,
    entropy: torch.Tensor,
    grad: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    r"""Gradient of :func:`chunk_entropy` w.r.t. its logits (not differentiable).

    .. math::

        \frac{\partial H_n}{\partial x_{nv}} = -p_{nv} (\log p_{nv} + H_n).

    Args:
        logits: ``(C, V)`` (not modified).
        entropy: ``(C,)`` from :func:`chunk_entropy`.
        grad: ``(C,)`` upstream gradient of the entropy, in ``dtype``.
        dtype: computation and result dtype.

    Returns:
        ``(C, V)`` gradient in ``dtype`` (a new tensor).
    """
    log_probs = torch.log_softmax(logits, dim=-1, dtype=dtype)  # (C, V)
    probs = torch.exp(log_probs)  # (C, V)
    finite_log_probs_(log_probs).add_(entropy.unsqueeze(-1))  # (C, V) log p + H
    return probs.mul_(log_probs).mul_((-grad).unsqueeze(-1))


def chunk_kl(chunk: torch.Tensor, ref_chunk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """KL(p || q) per row of one chunk, ``(C,)``."""
    log_p = torch.log_softmax(chunk, dim=-1, dtype=dtype)  # (C, V)
    log_q = torch.log_softmax(ref_chunk, dim=-1, dtype=dtype)  # (C, V)
    probs = torch.exp(log_p)  # (C, V)
    return xlogy_terms(probs, log_p.sub_(log_q)).sum(-1)  # (C,)


def chunk_kl_grads(
    chunk: torch.Tensor,
    ref_chunk: torch.Tensor,
    kl: torch.Tensor,
    grad: torch.Tensor,
    *,
    dtype: torch.dtype,
    need_logits: bool,
    need_ref: bool,
) -> list[torch.Tensor]:
    r"""Gradients of :func:`chunk_kl`: :math:`p_v(\log p_v - \log q_v - KL)` and :math:`q_v - p_v`.

    Returns the ``(C, V)`` gradients that are needed, logits first, each scaled by ``grad``.
    """
    log_p = torch.log_softmax(chunk, dim=-1, dtype=dtype)  # (C, V)
    log_q = torch.log_softmax(ref_chunk, dim=-1, dtype=dtype)  # (C, V)
    probs = torch.exp(log_p)  # (C, V)
    upstream = grad.unsqueeze(-1)  # (C, 1)
    grads = []
    if need_logits:
        # dKL/dx_v = p_v (log p_v - log q_v - KL)
        difference = log_p.sub(log_q).sub_(kl.unsqueeze(-1))  # (C, V)
        grads.append(xlogy_terms(probs, difference).mul_(upstream))
    if need_ref:
        grads.append(log_q.exp_().sub_(probs).mul_(upstream))  # dKL/dy_v = q_v - p_v
    return grads


class Moments(NamedTuple):
    """What :func:`slice_moments_` returns, ``(C,)`` per row unless said otherwise."""

    log_normalizer: torch.Tensor
    entropy: torch.Tensor | None
    log_sum_sq: torch.Tensor | None
    log_total: torch.Tensor  # (C, 1), log Z
    maximum: torch.Tensor | None  # max_v s_v as given (-inf for a row without a finite value)
    argmax: torch.Tensor | None  # its first index
    logit_sum: torch.Tensor | None  # sum_v s_v as given


def slice_moments_(
    scores: torch.Tensor,
    scratch: torch.Tensor,
    *,
    entropy: bool = True,
    squares: bool = False,
    top: bool = False,
    sums: bool = False,
    shifted: torch.Tensor | None = None,
) -> Moments:
    r"""Log-normaliser, entropy and :math:`\log\sum_v p_v^2` of each row of ``scores`` ``(C, V)``.

    With :math:`m = \max_v s_v`, :math:`Z = \sum_v e^{s_v - m}`:
    :math:`\log\sum_v e^{s_v} = m + \log Z`,
    :math:`H = -\sum_v p_v \log p_v = \log Z - \sum_v e^{s_v - m}(s_v - m) / Z` and
    :math:`\log\sum_v p_v^2 = \log\sum_v e^{2(s_v - m)} - 2\log Z` (TRL's
    ``log_sum_sq_probs``). ``scores`` is consumed: it becomes :math:`s - m`, with ``-inf``
    (banned tokens) made the most negative finite value (so that ``0 * log 0 = 0``), unless
    ``shifted`` ``(c, V)`` is given: then :math:`s - m` is formed there ``c`` rows at a time and
    ``scores`` is left as it is. Every row block of ``scratch.shape[0]`` rows (a block that stays
    in cache) is read once from memory: its maximum (with ``top``, its first index too), with
    ``sums`` its row sums, then its exponentials in ``scratch`` ``(c, V)``; no second ``(C, V)``
    buffer. A row with no finite value (:math:`m` taken as 0) gives :math:`-\infty`, entropy 0
    and :math:`\log\sum p^2 = -\infty`.
    """
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    totals, dots, squared, maxima, shifts, indices, row_sums = [], [], [], [], [], [], []
    step = scratch.shape[0]
    for start in range(0, scores.shape[0], step):
        rows = slice(start, start + step)
        block = scores[rows]  # (c, V)
        if sums:
            row_sums.append(block.sum(dim=1))  # (c,)
        if top:
            maximum, index = block.max(dim=1, keepdim=True)  # the first maximal value
            indices.append(index.squeeze(1))
        else:
            maximum = block.amax(dim=1, keepdim=True)  # (c, 1)
        # 0 for a row without a finite value (a vocabulary slice or kept set with none)
        shift = torch.where(torch.isfinite(maximum), maximum, zero)  # (c, 1)
        maxima.append(maximum.squeeze(1))
        shifts.append(shift.squeeze(1))
        into = block if shifted is None else shifted[: block.shape[0]]
        part = torch.sub(block, shift, out=into)  # (c, V), s - m
        # exp(-inf) before the clamp: the same 0, and a CPU exp of the most negative finite
        # value took about three times as long (a kept set's rows are mostly -inf)
        exps = torch.exp(part, out=scratch[: part.shape[0]])  # (c, V)
        finite_log_probs_(part)
        totals.append(exps.sum(dim=1))  # (c,)
        if entropy:  # no (c, V) product buffer
            dots.append(row_dots(exps, part))  # (c,)
        if squares:
            squared.append(row_dots(exps, exps))  # (c,)

    def joined(parts: list[torch.Tensor], dtype: torch.dtype = scores.dtype) -> torch.Tensor:
        """The blocks' ``(c,)`` pieces as one ``(C,)`` tensor (empty for ``C = 0``)."""
        return torch.cat(parts) if parts else scores.new_zeros(0, dtype=dtype)

    total = joined(totals)  # (C,)
    log_total = total.log()  # (C,), -inf for an empty row
    entropy_value = None
    if entropy:
        entropy_value = torch.where(total > 0, log_total - joined(dots) / total, zero)
    log_sum_sq = None
    if squares:
        empty = torch.full((), -torch.inf, dtype=total.dtype, device=total.device)
        log_sum_sq = torch.where(total > 0, joined(squared).log() - 2 * log_total, empty)
    return Moments(
        joined(shifts) + log_total,
        entropy_value,
        log_sum_sq,
        log_total.unsqueeze(1),
        joined(maxima) if top else None,
        joined(indices, torch.int64) if top else None,
        joined(row_sums) if sums else None,
    )


def entropy_stats_(
    scores: torch.Tensor, scratch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Log-normaliser and entropy of each row of ``scores`` ``(C, V)``; ``scores`` is consumed.

    :func:`slice_moments_` without :math:`\sum p^2`.

    Returns:
        ``(log_normalizer, entropy, log_total)``: ``(C,)``, ``(C,)`` and ``log Z`` ``(C, 1)``.
    """
    log_normalizer, entropy, _, log_total, *_ = slice_moments_(scores, scratch, entropy=True)
    assert entropy is not None
    return log_normalizer, entropy, log_total


def entropy_logit_grads_(
    log_probs: torch.Tensor,
    entropy: torch.Tensor,
    coefficients: tuple[torch.Tensor, torch.Tensor],
    scratch: torch.Tensor,
) -> torch.Tensor:
    r"""``-p (c + g (log p + H))`` in place of ``log_probs`` ``(C, V)`` (``-inf``: banned tokens).

    The gradient with respect to the logits of :math:`\sum_n c_n \log p_{n y_n} + g_n H_n`,
    without its :math:`c_n \mathbb{1}[v = y_n]` term (the caller scatters it):
    :math:`\partial H/\partial s_v = -p_v(\log p_v + H)` and
    :math:`\partial \log p_y / \partial s_v = \mathbb{1}[v = y] - p_v`.

    Args:
        log_probs: ``(C, V)`` log-probabilities, ``-inf`` allowed (overwritten with the result).
        entropy: ``(C,)`` the rows' entropies.
        coefficients: ``(c, g)``, each ``(C,)``: the upstream gradients of the log-probabilities
            of the tokens and of the entropies.
        scratch: ``(c, V)``: the probabilities of ``c`` rows at a time.

    Returns:
        ``log_probs``, holding the gradient.
    """
    # Negated coefficients: -p (c + g (log p + H)) = p (log p + H) (-g) + p (-c).
    row_coefficient, entropy_weight = (-t.unsqueeze(1) for t in coefficients)  # (C, 1) each
    entropies = entropy.unsqueeze(1)  # (C, 1)
    step = scratch.shape[0]
    for start in range(0, log_probs.shape[0], step):
        rows = slice(start, start + step)
        part = log_probs[rows]  # (c, V)
        probs = torch.exp(part, out=scratch[: part.shape[0]])  # (c, V)
        # Then a banned token's log p made the most negative finite number (exp(-inf) = 0 came
        # first: a CPU exp of that number took three times as long), and p first: that number
        # times |g| > 1 (an upstream gradient, a temperature below 1) would overflow to -inf and
        # give 0 * inf = NaN; p (log p + H) is 0 there and bounded (|p log p| <= 1/e) elsewhere.
        finite_log_probs_(part).add_(entropies[rows]).mul_(probs).mul_(entropy_weight[rows])
        part.addcmul_(probs, row_coefficient[rows])
    return log_probs


# ---------------------------------------------------------------------------------------------
# A slice of the vocabulary (vocabulary parallelism) or a kept set: the row normalisers are given
# ---------------------------------------------------------------------------------------------


def slice_stats(
    scores: torch.Tensor, *, with_entropy: bool, with_squares: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    r"""Log-normaliser, entropy and :math:`\log\sum p^2` of the softmax of each row of ``scores``.

    :func:`slice_moments_` (its formulas, a row block in cache at a time) on ``scores`` ``(C,
    V)`` left as it is; ``torch.logsumexp`` when only the normaliser is asked for. A row whose
    values are all ``-inf`` (a vocabulary slice with no kept token) gives :math:`\ell = -\infty`,
    :math:`h = 0` and :math:`\log\sum p^2 = -\infty`, never NaN.

    Returns:
        ``(log_normalizer, entropy, log_sum_sq)``, ``(C,)`` each (None where not asked for).
    """
    if not (with_entropy or with_squares):
        return torch.logsumexp(scores, dim=1), None, None  # -inf for a row of -inf
    rows, width = scores.shape
    scratch = scores.new_empty(scratch_rows(width, rows), width)  # (c, V)
    shifted = torch.empty_like(scratch)  # s - m, c rows at a time
    moments = slice_moments_(
        scores, scratch, entropy=with_entropy, squares=with_squares, shifted=shifted
    )
    return moments.log_normalizer, moments.entropy, moments.log_sum_sq


def slice_log_probs_grad(
    scores: torch.Tensor,
    tokens: torch.Tensor,
    grad: torch.Tensor,
    target_grad: torch.Tensor,
    log_normalizer: torch.Tensor,
) -> torch.Tensor:
    r"""``g (1[v = y] - p)`` with :math:`p = e^{s - \ell}` for the given (global) normaliser.

    Args:
        scores: ``(C, V)`` the chunk's logits after the temperature and the kept set (consumed:
            the result is written into it).
        tokens: ``(C,)`` int64 local ids of the targets (any valid index where not owned).
        grad: ``(C,)`` upstream gradient of the log-probabilities.
        target_grad: ``(C,)`` the gradient scattered at the target: ``grad`` where this slice
            holds the target, 0 elsewhere.
        log_normalizer: ``(C,)`` :math:`\ell` over the whole (kept) vocabulary.

    Returns:
        ``scores``, holding the ``(C, V)`` gradient.
    """
    probs = scores.sub_(log_normalizer.unsqueeze(1)).exp_()  # (C, V) p, 0 at -inf
    grad_scores = probs.mul_((-grad).unsqueeze(1))  # -g p
    return grad_scores.scatter_add_(1, tokens.unsqueeze(1), target_grad.unsqueeze(1))


def slice_grads_(
    scores: torch.Tensor,
    tokens: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor],
    target_grad: torch.Tensor,
    stats: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    r"""``g_l (1[v = y] - p) - g_H p (log p + H)`` with :math:`\log p = s - \ell` given.

    The gradient of :math:`\sum_n g_{\ell,n} \log p_{n y_n} + g_{H,n} H_n` with respect to the
    logits (:func:`slice_log_probs_grad` and :func:`slice_entropy_grad` in one pass).

    Args:
        scores: ``(C, V)`` logits after the transform and the kept set (consumed).
        tokens: ``(C,)`` int64 local ids of the targets.
        weights: ``(g_l, g_H)``, ``(C,)`` each.
        target_grad: ``(C,)``: ``g_l`` where this slice holds the target, 0 elsewhere.
        stats: ``(log_normalizer, entropy)``, ``(C,)`` each, over the whole (kept) vocabulary.

    Returns:
        ``scores``, holding the ``(C, V)`` gradient.
    """
    log_normalizer, entropy = stats
    log_probs = scores.sub_(log_normalizer.unsqueeze(1))  # (C, V)
    rows, width = scores.shape
    scratch = scores.new_empty(scratch_rows(width, rows), width)  # (c, V)
    grad = entropy_logit_grads_(log_probs, entropy, weights, scratch)
    return grad.scatter_add_(1, tokens.unsqueeze(1), target_grad.unsqueeze(1))


def slice_entropy_grad(
    scores: torch.Tensor, entropy: torch.Tensor, grad: torch.Tensor, log_normalizer: torch.Tensor
) -> torch.Tensor:
    r"""``-g p (log p + H)`` with :math:`\log p = s - \ell` for the given normaliser and entropy.

    ``scores`` ``(C, V)`` is consumed (the result is written into it); ``-inf`` entries give 0.
    """
    log_probs = scores.sub_(log_normalizer.unsqueeze(1))  # (C, V)
    probs = torch.exp(log_probs)  # (C, V), before the clamp (a faster exp of -inf)
    finite_log_probs_(log_probs).add_(entropy.unsqueeze(1))  # log p + H
    return probs.mul_(log_probs).mul_((-grad).unsqueeze(1))


def slice_kl(
    chunk: torch.Tensor,
    ref_chunk: torch.Tensor,
    log_normalizer: torch.Tensor,
    ref_log_normalizer: torch.Tensor,
) -> torch.Tensor:
    r"""This slice's part :math:`\sum_{v \in r} p_v (\log p_v - \log q_v)` of the KL, ``(C,)``.

    :math:`\log p = x - \ell_x` and :math:`\log q = y - \ell_y` with the normalisers over the
    whole vocabulary, so the terms are those of the unsharded call.
    """
    log_p = chunk - log_normalizer.unsqueeze(1)  # (C, V)
    log_q = ref_chunk - ref_log_normalizer.unsqueeze(1)  # (C, V)
    return xlogy_terms(torch.exp(log_p), log_p - log_q).sum(dim=1)


def slice_kl_grads(
    chunk: torch.Tensor,
    ref_chunk: torch.Tensor,
    normalizers: tuple[torch.Tensor, torch.Tensor],
    kl: torch.Tensor,
    grad: torch.Tensor,
    *,
    need_logits: bool,
    need_ref: bool,
) -> list[torch.Tensor]:
    r"""Gradients of :func:`slice_kl`: :math:`g p_v(\log p_v - \log q_v - KL)`, :math:`g(q_v-p_v)`.

    ``normalizers`` are :math:`(\ell_x, \ell_y)` ``(C,)`` over the whole vocabulary.
    """
    log_p = chunk - normalizers[0].unsqueeze(1)  # (C, V)
    log_q = ref_chunk - normalizers[1].unsqueeze(1)  # (C, V)
    probs = torch.exp(log_p)  # (C, V)
    upstream = grad.unsqueeze(1)  # (C, 1)
    grads = []
    if need_logits:
        difference = log_p.sub(log_q).sub_(kl.unsqueeze(1))  # (C, V)
        grads.append(xlogy_terms(probs, difference).mul_(upstream))
    if need_ref:
        grads.append(log_q.exp_().sub_(probs).mul_(upstream))
    return grads
