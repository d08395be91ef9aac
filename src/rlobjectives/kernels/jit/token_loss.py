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
(:func:`sapo_surrogate`), 3 none (``kl_loss``: only the KL term), 4 and 5 DPPO with the binary
TV and KL trust regions (:func:`dppo_surrogate`), 6 DRO (:func:`dro_surrogate`).
"""

import triton
import triton.language as tl

from .math import clamp_symmetric, expm1, expm1_minus_x, kl_estimate, load_indexed

# Columns of the (programs, SUMS) partial-sum tensor (the order of TokenLossSums); the last nine
# are the numerators of PolicyLossDiagnostics, in its field order.
SUM_NAMES = (
    "weighted_loss",  # sum w * L (the reduced loss)
    "weighted_policy",  # sum w * rho * (-s)
    "weighted_kl",  # sum w * k (before the KL coefficient)
    "weighted_entropy",  # sum w * H
    "policy_sum",  # sum rho * (-s), unweighted
    "kl_sum",  # sum k, unweighted
    "entropy_sum",  # sum H, unweighted
    "selected",  # selected tokens
    "out_of_band",  # r outside the variant's band (clipped_fraction)
    "binding_low",  # the low edge changes an A < 0 token (clip_fraction_low)
    "binding_high",  # the high edge changes an A > 0 token (clip_fraction_high)
    "dual_binding",  # an upper edge changes an A < 0 token (dual_clip_fraction)
    "bound_fired",  # |policy log-ratio| > b (a NaN log-ratio counts)
    "ratio_sum",  # sum r
    "k1_sum",  # sum -(l - l_old)
    "k3_sum",  # sum r' - 1 - log r', log r' = clip(l - l_old, +-b_diag)
    "weight_sum",  # sum of the factor w of s = w A (or sg(w) A l): weight_mean
)
SUMS = len(SUM_NAMES)
SURROGATES = {"clip": 0, "cispo": 1, "sapo": 2, "none": 3, "dppo_tv": 4, "dppo_kl": 5, "dro": 6}
BINARY_KL_EPSILON = tl.constexpr(1e-8)
LOWEST_FLOAT32 = tl.constexpr(
    -3.4028234663852886e38
)  # torch.finfo(torch.float32).min  # verl's (rlobjectives.policy.surrogates.dppo)
ESTIMATORS = {"k1": 1, "k2": 2, "k3": 3, "abs": 4}


@triton.jit
def above(x, bound):
    """``x > bound`` for ``x >= 0`` with NaN counted above (the fused path's bit comparison)."""
    return ~(x <= bound)


@triton.jit
def clip_surrogate(
    ratio, passes, advantages, weighted, low, high, upper_positive, upper_negative, dual_clip,
    HAS_BAND: tl.constexpr, HAS_UPPER_POSITIVE: tl.constexpr, HAS_UPPER_NEGATIVE: tl.constexpr,
    HAS_DUAL: tl.constexpr,
):  # fmt: skip
    r"""Clipped surrogate per sign of ``A``: ``w s``, its slope, the factor and the four sets.

    ``s = A clip(r, L, H)`` with ``(L, H) = (-inf, upper_positive)`` for ``A > 0`` and
    ``(low, upper_negative)`` for ``A < 0`` (``rlobjectives.policy.surrogates.clip.clip_bounds``);
    the slope ``r A~`` (``A~ = rho A``) where ``L <= r <= H`` and the log-ratio bound held, else 0,
    halved at ``r == c`` for ``A < 0`` (``torch.maximum``'s tie). Clipping is decided on the
    ratio, as the fused PyTorch path decides it. Returns ``(w s, d(w s)/dl, factor, out of
    band, low binds, high binds, dual binds)``.
    """
    positive = advantages > 0.0
    negative = advantages < 0.0
    keep = passes
    lower = tl.full(ratio.shape, float("-inf"), tl.float32)
    upper = tl.full(ratio.shape, float("inf"), tl.float32)
    out_of_band = ratio < float("-inf")  # all False
    low_binds = out_of_band
    high_binds = out_of_band
    dual_binds = out_of_band
    if HAS_BAND:
        below = ratio < low
        out_of_band = below | above(ratio, high)
        low_binds = below & negative
        lower = tl.where(negative, low, lower)
    if HAS_UPPER_POSITIVE:
        high_binds = above(ratio, upper_positive) & positive
        upper = tl.where(positive, upper_positive, upper)
    if HAS_UPPER_NEGATIVE:
        dual_binds = above(ratio, upper_negative) & negative
        upper = tl.where(negative, upper_negative, upper)
    keep = keep & ~low_binds & ~high_binds & ~dual_binds
    factor = tl.where(ratio < lower, lower, tl.where(ratio > upper, upper, ratio))  # keeps NaN
    slope = tl.where(keep, ratio * weighted, 0.0)
    if HAS_DUAL:
        slope = tl.where((ratio == dual_clip) & negative, 0.5 * slope, slope)
    return factor * weighted, slope, factor, out_of_band, low_binds, high_binds, dual_binds


@triton.jit
def cispo_surrogate(
    log_probs, ratio, advantages, weighted, low, high,
    HAS_LOW: tl.constexpr, HAS_HIGH: tl.constexpr,
):  # fmt: skip
    r"""CISPO: ``w s = l sg(c) A~`` with ``c = clamp(r, low, high)`` (cap or band).

    The slope ``c A~`` at every selected token (the bound changes ``c`` only). Sets: ``r``
    outside ``[low, high]``; low: below with ``A < 0``; high: above with ``A > 0``; dual: above
    with ``A < 0`` (strict float comparisons). Returns as :func:`clip_surrogate`.
    """
    factor = ratio
    below = ratio < float("-inf")  # all False
    upper = below
    if HAS_LOW:
        below = ratio < low
        factor = tl.where(below, low, factor)
    if HAS_HIGH:
        upper = ratio > high
        factor = tl.where(upper, high, factor)
    slope = factor * weighted
    negative = advantages < 0.0
    return (
        log_probs * slope, slope, factor, below | upper, below & negative,
        upper & (advantages > 0.0), upper & negative,
    )  # fmt: skip


@triton.jit
def sapo_surrogate(ratio, passes, advantages, weighted, tau_positive, tau_negative, half_peak):
    r"""SAPO: ``w s = (4 sigma / tau) A~``, ``sigma = sigmoid(tau (r - 1))``, tau by sign of A.

    The slope ``4 sigma(x) sigma(-x) r A~`` where the log-ratio bound held. Soft-clipped:
    ``|x| > half_peak`` (the gate's gradient weight below half its peak); low: with ``x < 0``
    and ``A < 0``; high: ``x > 0``, ``A > 0``; dual: ``x > 0``, ``A < 0``.
    """
    tau = tl.where(advantages > 0.0, tau_positive, tau_negative)
    x = (ratio - 1.0) * tau
    sigma = tl.sigmoid(x)
    slope = tl.where(passes, tl.sigmoid(-x) * sigma * ratio * 4.0 * weighted, 0.0)
    gate = sigma * 4.0 / tau
    soft = tl.abs(x) > half_peak
    negative = advantages < 0.0
    return (
        gate * weighted, slope, gate, soft, soft & (x < 0.0) & negative,
        soft & (x > 0.0) & (advantages > 0.0), soft & (x > 0.0) & negative,
    )  # fmt: skip


@triton.jit
def dppo_surrogate(
    log_probs, old, ratio, passes, advantages, weighted, low, high, ratio_cap,
    KL: tl.constexpr, HAS_CAP: tl.constexpr,
):  # fmt: skip
    r"""DPPO: ``w s = sg(w) A~ l`` with ``w = 1[kept] min(r, c)`` (``w A~`` without a cap).

    The trust region of ``rlobjectives.policy.surrogates.dppo.dppo_trust_region`` in float32:
    TV ``p - p_old <= high`` (A > 0) / ``>= -low`` (A <= 0); KL ``D <= high or l <= l_old``
    (A > 0) / ``D <= low or l >= l_old`` (A <= 0), ``D`` the binary KL with ``1 - p =
    -expm1(l)`` and the log of the complements' quotient (the ``binary_kl`` of the PyTorch
    path). The slope ``w A~`` (without a cap times
    the bound's ``passes``). Sets: outside (any sign), outside with ``A < 0`` / ``A > 0``, kept
    with ``r > c`` (any sign). Returns as :func:`clip_surrogate`.
    """
    positive = advantages > 0.0
    log_ratio = log_probs - old  # Delta and l - Delta: the numbers the PyTorch paths decide on
    old = log_probs - log_ratio
    if KL:
        gap = old - log_probs
        gap = tl.where(gap < LOWEST_FLOAT32, LOWEST_FLOAT32, gap)  # keeps NaN; 0 * gap at p_old = 0
        first = tl.exp(old) * gap
        old_complement = -expm1(old)
        complement = BINARY_KL_EPSILON - expm1(log_probs)
        divergence = first + old_complement * tl.log(
            (old_complement + BINARY_KL_EPSILON) / complement
        )
        kept = tl.where(
            positive, (divergence <= high) | (log_ratio <= 0.0),
            (divergence <= low) | (log_ratio >= 0.0),
        )  # fmt: skip
    else:
        moved = tl.exp(log_probs) - tl.exp(old)
        kept = tl.where(positive, moved <= high, moved >= -low)
    outside = ~kept
    capped = ratio < float("-inf")  # all False
    if HAS_CAP:
        capped = kept & (ratio > ratio_cap)
        factor = tl.where(kept, tl.where(ratio > ratio_cap, ratio_cap, ratio), 0.0)
        slope = factor * weighted
        value = log_probs * slope
    else:
        factor = tl.where(kept, ratio, 0.0)
        value = factor * weighted
        slope = tl.where(passes, value, 0.0)
    return (
        value, slope, factor, outside, outside & (advantages < 0.0), outside & positive, capped,
    )  # fmt: skip


@triton.jit
def dro_surrogate(log_probs, old, weighted, importance, beta, HAS_IMPORTANCE: tl.constexpr):
    r"""DRO: ``w s = rho (l A - beta Delta^2 / 2)``, slope ``rho (A - beta Delta)``, raw ``Delta``.

    No ratio and no clip: the sets are empty, the factor is 1.
    """
    log_ratio = log_probs - old
    penalty = beta * log_ratio
    if HAS_IMPORTANCE:
        penalty = penalty * importance
    none = log_probs < float("-inf")  # all False
    return (
        log_probs * weighted - 0.5 * penalty * log_ratio, weighted - penalty,
        tl.full(log_probs.shape, 1.0, tl.float32), none, none, none, none,
    )  # fmt: skip


@triton.jit
def policy_terms(
    log_probs, old, advantages, sequence, importance, selected,
    low, high, upper_positive, upper_negative, dual_clip, tau_positive, tau_negative, half_peak,
    ratio_cap, beta, bound, diagnostic_bound,
    SURROGATE: tl.constexpr, HAS_LOW: tl.constexpr, HAS_HIGH: tl.constexpr,
    HAS_UPPER_POSITIVE: tl.constexpr, HAS_UPPER_NEGATIVE: tl.constexpr, HAS_DUAL: tl.constexpr,
    HAS_CAP: tl.constexpr, HAS_BOUND: tl.constexpr, HAS_SEQUENCE: tl.constexpr,
    HAS_IMPORTANCE: tl.constexpr,
):  # fmt: skip
    """The policy part of one block: ``-w s``, its slope, and the nine diagnostic numerators.

    Every input is already selected (zeros at unselected tokens; ``sequence`` is the GSPO
    log-ratio when ``HAS_SEQUENCE``). Returns ``(policy, slope, counts...)`` with the counts and
    sums as float32 blocks, zeros at unselected tokens.
    """
    token_log_ratio = log_probs - old
    log_ratio = token_log_ratio
    if HAS_SEQUENCE:  # GSPO: the sequence's log-ratio at every token, slope 1
        log_ratio = sequence
    passes = selected
    fired = log_ratio < float("-inf")  # all False: without a bound nothing fires
    if HAS_BOUND:
        inside = tl.abs(log_ratio) <= bound
        passes = selected & inside
        fired = selected & ~inside  # a NaN log-ratio counts as fired
        log_ratio = clamp_symmetric(log_ratio, bound)
    ratio = tl.exp(log_ratio)
    weighted = advantages
    if HAS_IMPORTANCE:
        weighted = advantages * importance
    if SURROGATE == 0:
        value, slope, factor, band, low_set, high_set, dual_set = clip_surrogate(
            ratio, passes, advantages, weighted, low, high, upper_positive, upper_negative,
            dual_clip, HAS_LOW, HAS_UPPER_POSITIVE, HAS_UPPER_NEGATIVE, HAS_DUAL,
        )  # fmt: skip
    elif SURROGATE == 1:
        value, slope, factor, band, low_set, high_set, dual_set = cispo_surrogate(
            log_probs, ratio, advantages, weighted, low, high, HAS_LOW, HAS_HIGH
        )
    elif SURROGATE == 2:
        value, slope, factor, band, low_set, high_set, dual_set = sapo_surrogate(
            ratio, passes, advantages, weighted, tau_positive, tau_negative, half_peak
        )
    elif SURROGATE == 6:
        value, slope, factor, band, low_set, high_set, dual_set = dro_surrogate(
            log_probs, old, weighted, importance, beta, HAS_IMPORTANCE
        )
    else:  # 4, 5: DPPO (TV, KL)
        value, slope, factor, band, low_set, high_set, dual_set = dppo_surrogate(
            log_probs, old, ratio, passes, advantages, weighted, low, high, ratio_cap,
            SURROGATE == 5, HAS_CAP,
        )  # fmt: skip
    kl_log_ratio = clamp_symmetric(token_log_ratio, diagnostic_bound)
    return (
        tl.where(selected, -value, 0.0), tl.where(selected, -slope, 0.0),
        tl.where(selected & band, 1.0, 0.0), tl.where(selected & low_set, 1.0, 0.0),
        tl.where(selected & high_set, 1.0, 0.0), tl.where(selected & dual_set, 1.0, 0.0),
        tl.where(fired, 1.0, 0.0), tl.where(selected, ratio, 0.0), -token_log_ratio,
        tl.where(selected, expm1_minus_x(kl_log_ratio), 0.0), tl.where(selected, factor, 0.0),
    )  # fmt: skip


@triton.jit
def kl_terms(
    log_probs, ref_ptr, offsets, inside, selected, importance, bound, kl_coef,
    HAS_BOUND: tl.constexpr, KL_ESTIMATOR: tl.constexpr, KL_STRAIGHT_THROUGH: tl.constexpr,
    KL_IMPORTANCE: tl.constexpr,
):  # fmt: skip
    """``(k, beta dk/dl)`` of one block, zeros at unselected tokens.

    The slope is 0 where the bound fires (``torch.clamp``'s closed interval) and with
    ``beta = 0`` (the term is then reported, not added: never ``0 * inf``).
    """
    ref = tl.load(ref_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    log_ratio = log_probs - tl.where(selected, ref, 0.0)
    passes = selected
    if HAS_BOUND:
        passes = selected & (tl.abs(log_ratio) <= bound)
        log_ratio = clamp_symmetric(log_ratio, bound)
    kl, slope = kl_estimate(log_ratio, KL_ESTIMATOR, KL_STRAIGHT_THROUGH)
    if KL_IMPORTANCE:
        kl = kl * importance
        slope = slope * importance
    slope = tl.where(passes & (kl_coef != 0.0), kl_coef * slope, 0.0)
    return tl.where(selected, kl, 0.0), slope


@triton.jit
def token_loss_kernel(
    log_probs_ptr, old_ptr, advantages_ptr, mask_ptr, weights_ptr, sequence_ptr,
    importance_ptr, ref_ptr, entropy_ptr,
    coefficient_ptr, loss_ptr, partial_ptr,
    n, advantages_divisor, advantages_stride, weights_divisor, weights_stride,
    sequence_divisor, sequence_stride, importance_divisor, importance_stride,
    low, high, upper_positive, upper_negative, dual_clip, tau_positive, tau_negative,
    half_peak, ratio_cap, beta, bound, diagnostic_bound, kl_coef, entropy_coef,
    SURROGATE: tl.constexpr, HAS_LOW: tl.constexpr, HAS_HIGH: tl.constexpr,
    HAS_UPPER_POSITIVE: tl.constexpr, HAS_UPPER_NEGATIVE: tl.constexpr, HAS_DUAL: tl.constexpr,
    HAS_CAP: tl.constexpr, HAS_BOUND: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    HAS_SEQUENCE: tl.constexpr, HAS_IMPORTANCE: tl.constexpr, HAS_KL: tl.constexpr,
    KL_ESTIMATOR: tl.constexpr,
    KL_STRAIGHT_THROUGH: tl.constexpr, KL_IMPORTANCE: tl.constexpr, HAS_ENTROPY: tl.constexpr,
    STORE_LOSS: tl.constexpr, COLUMNS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Forward of one block of ``BLOCK`` tokens (see the module docstring).

    Reads every input once and writes every output (coefficient, optional per-token loss, one
    row of partial sums); the formulas live in :func:`policy_terms` and :func:`kl_terms`.
    Longer than the library's other functions on purpose: it is the one launch of the forward,
    so every optional input (importance weights, sequence log-ratio, KL, entropy, reduction
    weights) is loaded and combined here under its compile-time flag, in the order the outputs
    are written; each branch is a few lines and the math stays in the two helpers.
    """
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    selected = (tl.load(mask_ptr + offsets, mask=inside, other=0) != 0) & inside
    log_probs = tl.load(log_probs_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    log_probs = tl.where(selected, log_probs, 0.0)
    zeros = tl.zeros((BLOCK,), tl.float32)
    importance = zeros
    if HAS_IMPORTANCE:
        importance = load_indexed(
            importance_ptr, offsets, inside, importance_divisor, importance_stride
        )
        importance = tl.where(selected, importance, 0.0)
    total = zeros
    total_slope = zeros
    policy = zeros
    band = zeros  # the nine diagnostic numerators (zeros without a surrogate)
    low_set = zeros
    high_set = zeros
    dual_set = zeros
    fired = zeros
    ratio = zeros
    k1 = zeros
    k3 = zeros
    factor = zeros
    if SURROGATE != 3:
        old = tl.load(old_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        advantages = load_indexed(
            advantages_ptr, offsets, inside, advantages_divisor, advantages_stride
        )
        sequence = zeros
        if HAS_SEQUENCE:
            sequence = load_indexed(
                sequence_ptr, offsets, inside, sequence_divisor, sequence_stride
            )
        terms = policy_terms(
            log_probs, tl.where(selected, old, 0.0), tl.where(selected, advantages, 0.0),
            tl.where(selected, sequence, 0.0), importance, selected,
            low, high, upper_positive, upper_negative, dual_clip, tau_positive, tau_negative,
            half_peak, ratio_cap, beta, bound, diagnostic_bound,
            SURROGATE, HAS_LOW, HAS_HIGH, HAS_UPPER_POSITIVE, HAS_UPPER_NEGATIVE, HAS_DUAL,
            HAS_CAP, HAS_BOUND, HAS_SEQUENCE, HAS_IMPORTANCE,
        )  # fmt: skip
        policy, total_slope, band, low_set, high_set, dual_set, fired, ratio, k1, k3, factor = terms
        total = policy
    kl = zeros
    if HAS_KL:
        kl, kl_slope = kl_terms(
            log_probs, ref_ptr, offsets, inside, selected, importance, bound, kl_coef,
            HAS_BOUND, KL_ESTIMATOR, KL_STRAIGHT_THROUGH, KL_IMPORTANCE,
        )  # fmt: skip
        total = total + tl.where(kl_coef != 0.0, kl_coef * kl, 0.0)
        total_slope = total_slope + kl_slope
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
        tl.where(selected, 1.0, 0.0), band, low_set, high_set, dual_set, fired, ratio, k1, k3,
        factor,
    )  # fmt: skip
    for column in tl.static_range(COLUMNS):
        tl.store(partial_ptr + pid * COLUMNS + column, tl.sum(columns[column], axis=0))
