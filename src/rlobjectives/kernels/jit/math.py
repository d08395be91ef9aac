r"""Elementwise ``@triton.jit`` helpers shared by the kernels (float32 arithmetic).

Only ``triton.language`` core operations are used (no ``libdevice``): Triton's interpreter does
not implement ``libdevice`` functions, and these helpers must run in both modes.
"""

import triton
import triton.language as tl


@triton.jit
def expm1_minus_x(x):
    r""":math:`g(x) = e^x - 1 - x` without cancellation (relative error about 1e-7 in float32).

    For :math:`|x| \le 1`: the Taylor series :math:`\sum_{k=2}^{12} x^k / k!` in Horner form
    (truncation below 1e-9 relative); elsewhere ``exp(x) - 1 - x``, whose cancellation loses at
    most a factor 4 (at :math:`|x| = 1`). :math:`g \ge 0` exactly on the series branch, so
    ``r - 1 - log r = g(log r)`` and ``k3(d) = g(-d)`` are never negative there.
    NaN propagates; ``g(+inf) = inf``, ``g(-inf) = inf``.
    """
    poly = 1.0 / 479001600.0
    poly = poly * x + 1.0 / 39916800.0
    poly = poly * x + 1.0 / 3628800.0
    poly = poly * x + 1.0 / 362880.0
    poly = poly * x + 1.0 / 40320.0
    poly = poly * x + 1.0 / 5040.0
    poly = poly * x + 1.0 / 720.0
    poly = poly * x + 1.0 / 120.0
    poly = poly * x + 1.0 / 24.0
    poly = poly * x + 1.0 / 6.0
    poly = poly * x + 0.5
    series = poly * x * x
    small = tl.abs(x) <= 1.0
    direct = (tl.exp(tl.where(small, 0.0, x)) - 1.0) - x
    return tl.where(small, series, direct)


@triton.jit
def clamp_symmetric(x, bound):
    """``clamp(x, -bound, bound)`` that keeps NaN (as ``torch.clamp``), unlike min/max."""
    return tl.where(x > bound, bound, tl.where(x < -bound, -bound, x))


@triton.jit
def sign(x):
    """``torch.sign``: -1, 0 or 1 (0 at +-0; NaN maps to 0, only reached at NaN inputs)."""
    return tl.where(x > 0.0, 1.0, tl.where(x < 0.0, -1.0, 0.0))


@triton.jit
def load_indexed(pointer, offsets, valid, divisor, stride):
    """Load ``pointer[(offsets // divisor) * stride]`` as float32 (0 where not ``valid``).

    One addressing rule for per-token (``divisor=1, stride=1``), per-row (``divisor=T,
    stride=1``) and broadcast scalar (``stride=0``) tensors of the flat token layout.
    """
    index = (offsets // divisor) * stride
    return tl.load(pointer + index, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def kl_k1(d):
    """k1 = d; dk1/dd = 1."""
    return d, tl.full(d.shape, 1.0, tl.float32)


@triton.jit
def kl_k2(d):
    """k2 = d^2 / 2; dk2/dd = d."""
    return 0.5 * d * d, d


@triton.jit
def kl_k3(d):
    """k3 = exp(-d) + d - 1 = g(-d) (no cancellation); dk3/dd = 1 - exp(-d) = d - g(-d)."""
    value = expm1_minus_x(-d)
    return value, d - value


@triton.jit
def kl_abs(d):
    """|d|; d|d|/dd = sign(d) (0 at 0, as torch.abs)."""
    return tl.abs(d), sign(d)


@triton.jit
def kl_estimate(d, ESTIMATOR: tl.constexpr, STRAIGHT_THROUGH: tl.constexpr):
    """(value, d value / d d) of estimator ``ESTIMATOR`` (1: k1, 2: k2, 3: k3, 4: abs).

    ``STRAIGHT_THROUGH``: the value of the estimator with the gradient of k2 (``d``).
    The selector is a compile-time constant: each launch compiles one formula.
    """
    if ESTIMATOR == 1:
        value, slope = kl_k1(d)
    elif ESTIMATOR == 2:
        value, slope = kl_k2(d)
    elif ESTIMATOR == 3:
        value, slope = kl_k3(d)
    else:
        value, slope = kl_abs(d)
    if STRAIGHT_THROUGH:
        slope = d
    return value, slope


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with float32 accumulation.

    ``UPCAST`` (set under the interpreter): widen the operands to float32 first. Triton 3.9's
    interpreter multiplies the raw uint16 bit patterns of bfloat16 operands in ``tl.dot``; a
    bf16 x bf16 product is exact in float32, so widening gives the tensor-core result up to the
    order of the float32 accumulation.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)
