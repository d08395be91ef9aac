"""Rollout-correction benchmarks: ``rollout_correction`` vs a naive eager implementation.

Shapes (full run): B=64 T=4096 and B=8 T=16384, float32 and bfloat16, prefix masks with about 70%
of the tokens selected, trainer/sampler log-ratios with a 0.2 standard deviation. Forward only
(the weights carry no gradient). Each variant returns the weights, the mask and every metric, so
a compiled variant cannot drop the metric reductions.

Cases: token level / truncate (TIS, verl's default), sequence level / mask (TRL's default
``sequence_mask``), geometric level / reject (verl ``seq_mean_k1``).
Variants: the eager trainer-style baseline (``tests/eager_reference.py``: multiply by the mask,
one masked mean per metric), ours, and both compiled.
Floor: one copy of the bytes a single pass must move: both log-prob tensors (input dtype) and the
mask read, the float32 weights and the bool mask written.
"""

from __future__ import annotations

import torch

import eager_reference as eager
import harness
import rlobjectives

Inputs = harness.Inputs
# One code object per variant function serves every case (options x shapes x dtypes): each case
# is a new guard set, so the default limit of 8 compiled versions is too small here.
torch._dynamo.config.recompile_limit = 64
SETTINGS = {
    "token truncate": {"level": "token", "mode": "truncate", "upper": 2.0},
    "sequence mask": {"level": "sequence", "mode": "mask", "upper": 3.0},
    "geometric reject": {"level": "geometric", "mode": "reject", "lower": 0.8, "upper": 1.25},
}


def _make(batch: int, tokens: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    def make_inputs(device: torch.device) -> Inputs:
        generator = torch.Generator().manual_seed(0)
        log_probs = -torch.rand(batch, tokens, generator=generator) * 3
        rollout_log_probs = log_probs + 0.2 * torch.randn(batch, tokens, generator=generator)
        lengths = torch.randint(int(0.4 * tokens), tokens + 1, (batch, 1), generator=generator)
        mask = torch.arange(tokens).unsqueeze(0) < lengths  # prefix masks, ~70% selected
        tensors = {
            "log_probs": log_probs.to(dtype),
            "rollout_log_probs": rollout_log_probs.to(dtype),
            "mask": mask,
        }
        return {name: tensor.to(device) for name, tensor in tensors.items()}

    return make_inputs


def _reference(x: Inputs, options: dict[str, object]):  # type: ignore[no-untyped-def]
    return eager.rollout_correction(x["log_probs"], x["rollout_log_probs"], x["mask"], **options)


def _ours(x: Inputs, options: dict[str, object]):  # type: ignore[no-untyped-def]
    return rlobjectives.rollout_correction(
        x["log_probs"], x["rollout_log_probs"], x["mask"], **options
    )


def cases(*, quick: bool, device: str) -> list[harness.Case]:
    shapes = [(16, 1024)] if quick else [(64, 4096), (8, 16384)]
    dtypes = [torch.float32] if quick else [torch.float32, torch.bfloat16]
    settings = ["token truncate"] if quick else list(SETTINGS)
    result: list[harness.Case] = []
    for batch, tokens in shapes:
        for dtype in dtypes:
            element = torch.finfo(dtype).bits // 8
            forward_bytes = batch * tokens * (2 * element + 1 + 4 + 1)
            for name in settings:
                options = SETTINGS[name]

                def reference(x: Inputs, o: dict[str, object] = options):  # type: ignore[no-untyped-def]
                    return _reference(x, o)

                def ours(x: Inputs, o: dict[str, object] = options):  # type: ignore[no-untyped-def]
                    return _ours(x, o)

                variants = (
                    harness.Variant("eager reference", reference, role="reference", backward=False),
                    harness.Variant("ours", ours, backward=False),
                    harness.Variant("eager reference", reference, compile=True, backward=False),
                    harness.Variant("ours", ours, compile=True, backward=False),
                )
                result.append(
                    harness.Case(
                        operation=f"rollout_correction {name}",
                        shape=f"B={batch} T={tokens}",
                        dtype=dtype,
                        make_inputs=_make(batch, tokens, dtype),
                        grad_inputs=(),
                        variants=variants,
                        floor=harness.CopyFloor(forward_bytes, forward_bytes),
                    )
                )
    return result
