"""Backward kernel shared by the token losses: a masked product of two indexed factors.

``out[i] = where(mask[i], a[(i // a_div) * a_stride] * b[(i // b_div) * b_stride], 0)``, stored
in ``out``'s dtype: the saved per-token coefficient times the incoming gradient (a scalar with
stride 0, or per token), or a per-row factor (``kl_penalized_rewards``) times one.
"""

import triton
import triton.language as tl

from .math import load_indexed


@triton.jit
def scale_kernel(
    a_ptr, b_ptr, mask_ptr, out_ptr,
    n, a_divisor, a_stride, b_divisor, b_stride,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One block of ``BLOCK`` outputs (see the module docstring)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    selected = (tl.load(mask_ptr + offsets, mask=inside, other=0) != 0) & inside
    a = load_indexed(a_ptr, offsets, inside, a_divisor, a_stride)
    b = load_indexed(b_ptr, offsets, inside, b_divisor, b_stride)
    product = tl.where(selected, a * b, 0.0)
    tl.store(out_ptr + offsets, product.to(out_ptr.dtype.element_ty), mask=inside)
