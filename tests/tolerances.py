"""The one per-dtype tolerance table used by every test.

``(rtol, atol)`` equal ``torch.testing.assert_close``'s defaults, except where a reason is given.
Low-precision rows apply to results that were computed in float32 and rounded once to the output
dtype; comparisons are always against the float64 reference evaluated on the same (rounded) inputs.
"""

from __future__ import annotations

from typing import Any

import torch

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    # bf16/fp16: assert_close's rtol, but atol raised from 1e-5 to one output ulp near 1 because
    # a loss that is a sum of cancelling terms can be close to 0, where a single rounding of the
    # float32 result to 8 (bf16) or 11 (fp16) mantissa bits is an absolute, not relative, error.
    torch.bfloat16: (1.6e-2, 8e-3),
    torch.float16: (1e-3, 1e-3),
}


# Layout equivalence (a function on packed sequences vs the same function on their padded layout,
# float64): the math is the same, only the order of a few summations differs, so the results
# agree to float64 rounding; tighter than the float64 row above, which also covers differences
# between formulas (fused closed forms vs autograd vs the loop references).
LAYOUT_TOLERANCE: dict[str, float] = {"rtol": 1e-12, "atol": 1e-12}

# Context parallelism (a call on each rank's share of the tokens, with context_group, vs the
# unsplit call, float64): the per-sequence partial sums are added in another order (and in
# float64 buffers), so the results agree to float64 rounding, as the layouts do.
CONTEXT_TOLERANCE: dict[str, float] = {"rtol": 1e-12, "atol": 1e-12}


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    rtol, atol = TOLERANCES[dtype]
    return {"rtol": rtol, "atol": atol}


def assert_close(actual: torch.Tensor, expected: Any, dtype: torch.dtype | None = None) -> None:
    """Compare ``actual`` with a float64 reference at the tolerance of ``dtype`` (default: its own).

    The reference is cast to ``actual``'s dtype first for low-precision outputs, so the comparison
    measures the library's error, not the rounding of the reference.
    """
    dtype = actual.dtype if dtype is None else dtype
    expected_t = torch.as_tensor(expected, dtype=torch.float64, device=actual.device)
    torch.testing.assert_close(
        actual.detach().to(torch.float64),
        expected_t,
        equal_nan=True,
        check_dtype=False,
        **tolerance(dtype),
    )
