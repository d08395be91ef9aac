r"""One-pass forward kernel of the token-level policy loss (and of ``kl_loss``).

Per selected token (flat layout, ``N`` tokens) with :math:`\ell, \ell^{old}, A, \rho, w`:

.. math::

    \Delta = \mathrm{clip}(\ell - \ell^{old}, -b, b), \quad r = e^{\Delta}, \quad
    L = \rho\,(-s(r, A, \ell)) + \beta\, k(\mathrm{clip}(\ell - \ell^{ref}, -b, b))
        - c_H H,

and the kernel writes :math:`c = w\, \partial L / \partial \ell` per token plus one row of
partial sums per program (columns below). Unselected tokens are exact zeros before any
arithmetic (``tl.where``, never a product): NaN/inf there reaches nothing.

The surrogate ``s`` is chosen by the compile-time constant ``SURROGATE`` (one function per
formula): 0 clip/vanilla (:func:`clip_surrogate`), 1 CISPO (:func:`cispo_surrogate`), 2 SAPO
(:func:`sapo_surrogate`), 3 none (``kl_loss``: only the KL term).
"""

import triton
import triton.language as tl

from ._math import clamp_symmetric, expm1_minus_x, kl_estimate, load_indexed

# Columns of the (programs, SUMS) partial-sum tensor (the order of TokenLossSums).
SUM_NAMES = (
    "weighted_loss",  # sum w * L (the reduced loss)
    "weighted_policy",  # sum w * rho * (-s)
    "weighted_kl",  # sum w * k (before the KL coefficient)
    "weighted_entropy",  # sum w * H
    "policy_sum",  # sum rho * (-s), unweighted
    "kl_sum",  # sum k, unweighted
    "entropy_sum",  # sum H, unweighted
    "selected",  # selected tokens
    "out_of_band",  # r < 1 - eps_low or r > 1 + eps_high
    "binding_low",  # r < 1 - eps_low and A < 0
    "binding_high",  # r > 1 + eps_high and A > 0
    "dual_binding",  # A < 0 and min(rA, clip(r)A) < cA
    "bound_fired",  # |policy log-ratio| > b
    "ratio_sum",  # sum r
    "k1_sum",  # sum -(l - l_old)
    "k3_sum",  # sum r' - 1 - log r', log r' = clip(l - l_old, +-b_diag)
    "capped",  # CISPO: weight != r
    "gate_low",  # SAPO: 4 sigma (1 - sigma) < 1/2
)
SUMS = len(SUM_NAMES)
SURROGATES = {"clip": 0, "cispo": 1, "sapo": 2, "none": 3}
ESTIMATORS = {"k1": 1, "k2": 2, "k3": 3, "abs": 4}


@triton.jit
def clip_surrogate(
    ratio, ratio_slope, advantages, low, high, dual_clip, delta,
    HAS_CLIP: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_DELTA: tl.constexpr,
):  # fmt: skip
    r"""Clipped surrogate ``s``, ``ds/dl`` and the dual-clip binding flag, autograd's ties.

    ``u1 = min(r, delta) A`` (``r A`` without delta), ``u2 = clip(r, low, high) A``,
    ``s = min(u1, u2)``; with dual clip, ``s = max(s, c A)`` where ``A < 0``. Slopes follow
    autograd: ``torch.clamp`` passes the gradient on the closed interval, ``torch.minimum`` /
    ``torch.maximum`` pass half to each side of an exact tie (so in the band, where
    ``u1 == u2``, the two halves add up to ``r A``; at ``r == c`` the dual clip passes half).
    Comparisons are on the rounded products, as autograd's. NaN propagates (``where``).
    """
    product_slope = ratio_slope * advantages
    if HAS_DELTA:
        unclipped = tl.where(ratio > delta, delta, ratio) * advantages
        unclipped_slope = tl.where(ratio <= delta, product_slope, 0.0)
    else:
        unclipped = ratio * advantages
        unclipped_slope = product_slope
    if HAS_CLIP:
        clipped = tl.where(ratio < low, low, tl.where(ratio > high, high, ratio)) * advantages
        clipped_slope = tl.where((ratio >= low) & (ratio <= high), product_slope, 0.0)
        surrogate = tl.where(clipped < unclipped, clipped, unclipped)
        tie_slope = 0.5 * (unclipped_slope + clipped_slope)
        slope = tl.where(
            unclipped < clipped,
            unclipped_slope,
            tl.where(clipped < unclipped, clipped_slope, tie_slope),
        )
    else:
        surrogate = unclipped
        slope = unclipped_slope
    dual_binding = advantages < float("-inf")  # all False (NaN included)
    if HAS_DUAL:
        floor = dual_clip * advantages
        negative = advantages < 0.0
        dual_binding = negative & (surrogate < floor)
        raised = tl.where(surrogate < floor, floor, surrogate)
        raised_slope = tl.where(
            surrogate > floor, slope, tl.where(surrogate < floor, 0.0, 0.5 * slope)
        )
        surrogate = tl.where(negative, raised, surrogate)
        slope = tl.where(negative, raised_slope, slope)
    return surrogate, slope, dual_binding


@triton.jit
def cispo_surrogate(log_probs, ratio, advantages, low, high, cap, BAND: tl.constexpr):
    r"""CISPO: ``s = sg(w) A l`` with ``w = clip(r, low, high)`` (verl) or ``min(r, cap)`` (TRL).

    The value uses the log-probability itself; ``ds/dl = w A`` (the weight is a constant).
    Returns ``(s, ds/dl, w != r)``.
    """
    if BAND:
        weight = tl.where(ratio < low, low, tl.where(ratio > high, high, ratio))
    else:
        weight = tl.where(ratio > cap, cap, ratio)
    return weight * advantages * log_probs, weight * advantages, weight != ratio


@triton.jit
def sapo_surrogate(ratio, ratio_slope, advantages, tau_positive, tau_negative):
    r"""SAPO soft gate: ``s = (4 / tau) sigma(tau (r - 1)) A``, tau by the sign of ``A``.

    ``ds/dl = 4 sigma (1 - sigma) r A`` (times the bound's pass flag, in ``ratio_slope``);
    the flag returned marks tokens whose gate weight ``4 sigma (1 - sigma)`` (peak 1 at
    ``r = 1``) is below half its peak.
    """
    tau = tl.where(advantages > 0.0, tau_positive, tau_negative)
    argument = tau * (ratio - 1.0)
    gate = tl.sigmoid(argument)
    weight = 4.0 * gate * tl.sigmoid(-argument)  # 1 - sigma(x) = sigma(-x): no cancellation
    return (4.0 / tau) * gate * advantages, weight * ratio_slope * advantages, weight < 0.5


@triton.jit
def _store_sum(partial_ptr, pid, COLUMNS: tl.constexpr, COLUMN: tl.constexpr, values):
    """Write ``sum(values)`` to ``partial[pid, COLUMN]`` (row-major, ``COLUMNS`` wide)."""
    tl.store(partial_ptr + pid * COLUMNS + COLUMN, tl.sum(values, axis=0))


@triton.jit
def token_loss_kernel(
    log_probs_ptr, old_ptr, advantages_ptr, mask_ptr, weights_ptr, sequence_ptr,
    importance_ptr, ref_ptr, entropy_ptr,
    coefficient_ptr, loss_ptr, partial_ptr,
    n, advantages_divisor, advantages_stride, weights_divisor, weights_stride,
    sequence_divisor, sequence_stride,
    low, high, dual_clip, delta, cispo_cap, tau_positive, tau_negative,
    bound, diagnostic_bound, kl_coef, entropy_coef,
    SURROGATE: tl.constexpr, HAS_CLIP: tl.constexpr, HAS_DUAL: tl.constexpr,
    HAS_DELTA: tl.constexpr, CISPO_BAND: tl.constexpr, HAS_BOUND: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr, HAS_SEQUENCE: tl.constexpr, HAS_IMPORTANCE: tl.constexpr,
    HAS_KL: tl.constexpr, KL_ESTIMATOR: tl.constexpr, KL_STRAIGHT_THROUGH: tl.constexpr,
    KL_IMPORTANCE: tl.constexpr, HAS_ENTROPY: tl.constexpr, STORE_LOSS: tl.constexpr,
    COLUMNS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Forward of one block of ``BLOCK`` tokens (see the module docstring).

    Longer than 60 lines on purpose: one kernel reads every input once and writes every output
    (coefficient, optional per-token loss, one row of partial sums); splitting it would mean
    passing a dozen block tensors between helpers, which the formula helpers already isolate.
    """
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    selected = (tl.load(mask_ptr + offsets, mask=inside, other=0) != 0) & inside
    log_probs = tl.load(log_probs_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    log_probs = tl.where(selected, log_probs, 0.0)
    zeros = tl.zeros((BLOCK,), tl.float32)
    policy = zeros
    policy_slope = zeros
    bound_fired = zeros
    ratio_sum = zeros
    k1_sum = zeros
    k3_sum = zeros
    out_of_band = zeros
    binding_low = zeros
    binding_high = zeros
    dual_binding = zeros
    capped = zeros
    gate_low = zeros
    if HAS_IMPORTANCE:
        importance = tl.load(importance_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        importance = tl.where(selected, importance, 0.0)
    if SURROGATE != 3:
        old = tl.load(old_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        old = tl.where(selected, old, 0.0)
        advantages = load_indexed(
            advantages_ptr, offsets, inside, advantages_divisor, advantages_stride
        )
        advantages = tl.where(selected, advantages, 0.0)
        token_log_ratio = log_probs - old
        log_ratio = token_log_ratio
        if HAS_SEQUENCE:  # GSPO: the sequence's log-ratio at every token, slope 1
            log_ratio = load_indexed(
                sequence_ptr, offsets, inside, sequence_divisor, sequence_stride
            )
            log_ratio = tl.where(selected, log_ratio, 0.0)
        passes = selected | ~selected
        if HAS_BOUND:
            passes = tl.abs(log_ratio) <= bound
            bound_fired = tl.where(selected & (tl.abs(log_ratio) > bound), 1.0, 0.0)
            log_ratio = clamp_symmetric(log_ratio, bound)
        ratio = tl.exp(log_ratio)
        ratio_slope = tl.where(passes, ratio, 0.0)
        if SURROGATE == 0:
            surrogate, slope, flag = clip_surrogate(
                ratio, ratio_slope, advantages, low, high, dual_clip, delta,
                HAS_CLIP, HAS_DUAL, HAS_DELTA,
            )  # fmt: skip
            dual_binding = tl.where(selected & flag, 1.0, 0.0)
        elif SURROGATE == 1:
            surrogate, slope, flag = cispo_surrogate(
                log_probs, ratio, advantages, low, high, cispo_cap, CISPO_BAND
            )
            capped = tl.where(selected & flag, 1.0, 0.0)
        else:
            surrogate, slope, flag = sapo_surrogate(
                ratio, ratio_slope, advantages, tau_positive, tau_negative
            )
            gate_low = tl.where(selected & flag, 1.0, 0.0)
        policy = tl.where(selected, -surrogate, 0.0)
        policy_slope = tl.where(selected, -slope, 0.0)
        if HAS_IMPORTANCE:
            policy = policy * importance
            policy_slope = policy_slope * importance
        if HAS_CLIP:
            below = selected & (ratio < low)
            above = selected & (ratio > high)
            out_of_band = tl.where(below | above, 1.0, 0.0)
            binding_low = tl.where(below & (advantages < 0.0), 1.0, 0.0)
            binding_high = tl.where(above & (advantages > 0.0), 1.0, 0.0)
        ratio_sum = tl.where(selected, ratio, 0.0)
        k1_sum = -token_log_ratio
        k3_sum = expm1_minus_x(clamp_symmetric(token_log_ratio, diagnostic_bound))
    kl = zeros
    total = policy
    total_slope = policy_slope
    if HAS_KL:
        ref = tl.load(ref_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        kl_log_ratio = log_probs - tl.where(selected, ref, 0.0)
        kl_passes = selected | ~selected
        if HAS_BOUND:
            kl_passes = tl.abs(kl_log_ratio) <= bound
            kl_log_ratio = clamp_symmetric(kl_log_ratio, bound)
        kl, kl_slope = kl_estimate(kl_log_ratio, KL_ESTIMATOR, KL_STRAIGHT_THROUGH)
        kl_slope = tl.where(kl_passes, kl_slope, 0.0)
        if KL_IMPORTANCE:
            kl = kl * importance
            kl_slope = kl_slope * importance
        kl = tl.where(selected, kl, 0.0)
        total = total + kl_coef * kl
        total_slope = total_slope + kl_coef * tl.where(selected, kl_slope, 0.0)
    entropy = zeros
    if HAS_ENTROPY:
        entropy = tl.load(entropy_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        entropy = tl.where(selected, entropy, 0.0)
        total = total - entropy_coef * entropy
    weights = tl.where(selected, 1.0, 0.0)
    if HAS_WEIGHTS:
        weights = load_indexed(weights_ptr, offsets, inside, weights_divisor, weights_stride)
        weights = tl.where(selected, weights, 0.0)
    tl.store(coefficient_ptr + offsets, tl.where(selected, weights * total_slope, 0.0), mask=inside)
    if STORE_LOSS:
        tl.store(loss_ptr + offsets, tl.where(selected, total, 0.0), mask=inside)
    columns = (
        weights * total, weights * policy, weights * kl, weights * entropy, policy, kl, entropy,
        tl.where(selected, 1.0, 0.0), out_of_band, binding_low, binding_high, dual_binding,
        bound_fired, ratio_sum, k1_sum, k3_sum, capped, gate_low,
    )  # fmt: skip
    for column in tl.static_range(COLUMNS):
        _store_sum(partial_ptr, pid, COLUMNS, column, columns[column])
