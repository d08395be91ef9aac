"""Every kernel compiles for an H100/H200 (sm_90) without a GPU: Triton's frontend + ptxas only.

The interpreter tests check the arithmetic; this catches what only the compiler rejects
(constexpr misuse, unsupported constructs, type errors) before a GPU run. Skipped when the
installed triton has no NVIDIA backend.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from backends import requires_triton

pytestmark = requires_triton

FLOATS = ("inv_temperature", "scale", "softcap")


def _compile(kernel: Any, pointers: dict[str, str], constexprs: dict[str, Any]) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm


@pytest.fixture(scope="module")
def kernels() -> Any:
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no NVIDIA backend")
    import torch
    import triton.language as tl

    from rlobjectives._core.backend import use_backend
    from rlobjectives.kernels.head_forward import lm_head_forward
    from rlobjectives.kernels.loading import kernels as load

    # An interpreted launch first: the interpreter patches triton.language while it runs, and
    # compilation in the same process must still work afterwards.
    before = (tl.program_id, tl.core.tensor.__add__, tl.sum)
    with use_backend("triton"):
        tokens = torch.zeros(3, dtype=torch.long)
        lm_head_forward(
            torch.zeros(3, 2), torch.zeros(4, 2), tokens, torch.ones(3, dtype=torch.bool)
        )
    assert (tl.program_id, tl.core.tensor.__add__, tl.sum) == before
    return load("cuda")  # the compiled-mode package (no GPU needed to compile)


@pytest.mark.parametrize("transform", [False, True], ids=["plain", "softcap+rows+round"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_lm_head_kernels_compile(kernels: Any, dtype: str, transform: bool) -> None:
    tiles = (128, 128, 64) if dtype == "bf16" else (64, 64, 32)
    common = {"PRECISION": "ieee", "UPCAST": False}
    logit = {"HAS_SOFTCAP": transform, "ROW_TEMPERATURE": transform,
             "ROUND": transform and dtype == "bf16"}  # fmt: skip
    head = {"hidden_ptr": f"*{dtype}", "weight_ptr": f"*{dtype}", "bias_ptr": f"*{dtype}",
            "tokens_ptr": "*i64", "mask_ptr": "*u8", "inverse_ptr": "*fp32"}  # fmt: skip
    module = kernels.lm_head
    _compile(
        module.lse_partial_kernel,
        dict(head, max_ptr="*fp32", sum_ptr="*fp32", moment_ptr="*fp32", target_ptr="*fp32"),
        dict(common, **logit, HAS_BIAS=True, WITH_ENTROPY=True, BLOCK_N=tiles[0],
             BLOCK_V=tiles[1], BLOCK_H=tiles[2]),
    )  # fmt: skip
    _compile(
        module.lse_combine_kernel,
        {name: "*fp32" for name in ("max_ptr", "sum_ptr", "moment_ptr", "target_ptr", "lse_ptr",
                                    "log_probs_ptr", "entropy_ptr")} | {"mask_ptr": "*u8"},
        {"WITH_ENTROPY": True, "BLOCK": 1024},
    )  # fmt: skip
    _compile(
        module.grad_logits_kernel,
        dict(head, lse_ptr="*fp32", entropy_ptr="*fp32", grad_log_probs_ptr="*fp32",
             grad_entropy_ptr="*fp32", out_ptr=f"*{dtype}", bias_partial_ptr="*fp32"),
        dict(common, **logit, HAS_BIAS=True, HAS_ENTROPY_GRAD=True, NEED_BIAS=True,
             BLOCK_N=tiles[0], BLOCK_V=tiles[1], BLOCK_H=tiles[2], GROUP=8),
    )  # fmt: skip
    _compile(
        module.matmul_kernel,
        {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
         "accumulator_ptr": "*fp32", "k_mask_ptr": "*u8"},
        dict(common, ACCUMULATE=True, HAS_K_MASK=True, BLOCK_M=tiles[0], BLOCK_N=tiles[1],
             BLOCK_K=tiles[2], GROUP=8),
    )  # fmt: skip
