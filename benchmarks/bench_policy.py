"""Policy-loss benchmarks: ``policy_loss`` / ``grpo_clipped_surrogate`` vs the eager reference.

Shapes (full run): B=64 T=4096 and B=8 T=16384, float32 and bfloat16, prefix masks with about 70%
of the tokens selected, per-sequence advantages, log-ratios with a 0.3 standard deviation (so
that a sizeable fraction of tokens is clipped). Backward with respect to ``log_probs``.

Variants: the eager trainer-style reference (``tests/eager_reference.py``), the same compiled,
verl's eager ``compute_policy_loss_vanilla`` with its default config (dual clip on, three
metrics read on the host; ``eager_reference.verl_vanilla_policy_loss``) and ours with verl's
options (``Clip(low=0.2, dual=3.0)``),
``policy_loss`` (one formula per surrogate, autograd its gradient) and the seed
``grpo_clipped_surrogate``, eager and compiled; ``policy_loss`` with ``(B, T)`` importance weights
(which must add at most one ``(B, T)`` pass) and with the CISPO and SAPO surrogates.
``policy_loss-objectives``: the DPPO, DRO, M2PO, Clip-Cov and KL-Cov surrogates (the last three
with their batch-level selections) against ``Clip()`` in the same run.
Floor: one copy of the bytes a single pass must move: ``log_probs`` and ``old_log_probs`` (input
dtype), the mask (1 byte) read, the gradient (input dtype) written.
"""

from __future__ import annotations

import torch

import eager_reference as eager
import harness
import rlobjectives

Inputs = harness.Inputs
VERL_CLIP = rlobjectives.Clip(low=0.2, dual=3.0)  # verl's vanilla loss: the dual clip always on


def _make(batch: int, tokens: int, dtype: torch.dtype, valid: bool = False):  # type: ignore[no-untyped-def]
    """The inputs; ``valid``: log-probabilities at most 0 (probabilities, as DPPO reads them)."""

    def make_inputs(device: torch.device) -> Inputs:
        generator = torch.Generator().manual_seed(0)
        old_log_probs = -torch.rand(batch, tokens, generator=generator) * 3
        log_probs = old_log_probs + 0.3 * torch.randn(batch, tokens, generator=generator)
        if valid:
            log_probs = log_probs.clamp(max=0.0)
        lengths = torch.randint(int(0.4 * tokens), tokens + 1, (batch, 1), generator=generator)
        mask = torch.arange(tokens).unsqueeze(0) < lengths  # prefix masks, ~70% selected
        advantages = torch.randn(batch, 1, generator=generator)
        weights = 0.5 + torch.rand(batch, tokens, generator=generator)  # rollout-correction-like
        tensors = {
            "log_probs": log_probs.to(dtype),
            "old_log_probs": old_log_probs.to(dtype),
            "advantages": advantages,
            "mask": mask,
            "importance_weights": weights,
        }
        return {name: tensor.to(device) for name, tensor in tensors.items()}

    return make_inputs


def _reference(x: Inputs) -> torch.Tensor:
    return eager.policy_loss(x["log_probs"], x["old_log_probs"], x["advantages"], x["mask"])


def _verl(x: Inputs) -> torch.Tensor:
    return eager.verl_vanilla_policy_loss(
        x["log_probs"], x["old_log_probs"], x["advantages"], x["mask"]
    )[0]


def _ours_verl(x: Inputs) -> torch.Tensor:
    return rlobjectives.policy_loss(
        x["log_probs"], x["old_log_probs"], x["advantages"], x["mask"], surrogate=VERL_CLIP
    ).loss


def _ours(x: Inputs) -> torch.Tensor:
    return rlobjectives.policy_loss(
        x["log_probs"], x["old_log_probs"], x["advantages"], x["mask"]
    ).loss


def _ours_weighted(x: Inputs) -> torch.Tensor:
    return rlobjectives.policy_loss(
        x["log_probs"],
        x["old_log_probs"],
        x["advantages"],
        x["mask"],
        importance_weights=x["importance_weights"],
    ).loss


def _ours_surrogate(surrogate: object):  # type: ignore[no-untyped-def]
    def run(x: Inputs) -> torch.Tensor:
        return rlobjectives.policy_loss(
            x["log_probs"],
            x["old_log_probs"],
            x["advantages"],
            x["mask"],
            surrogate=surrogate,  # type: ignore[arg-type]
        ).loss

    return run


def _ours_seed(x: Inputs) -> torch.Tensor:
    return rlobjectives.grpo_clipped_surrogate(
        x["log_probs"], x["old_log_probs"], x["advantages"], x["mask"], 0.2
    )["loss"]


# The surrogates against Clip() in the same run (the token-local ones within 1.2x of it; the
# selection-based ones: their cost, stated).
OBJECTIVES24 = (
    ("DPPO(tv)", rlobjectives.DPPO("tv")),
    ("DPPO(kl)", rlobjectives.DPPO("kl")),
    ("DPPO(tv, ratio_cap=None)", rlobjectives.DPPO("tv", ratio_cap=None)),
    ("DRO(beta=0.1)", rlobjectives.DRO(beta=0.1)),
    ("M2PO(threshold=0.04)", rlobjectives.M2PO(threshold=0.04)),
    ("KLCov(ratio=0.002)", rlobjectives.KLCov(ratio=0.002, coef=1.0)),
    ("ClipCov(ratio=0.002)", rlobjectives.ClipCov(ratio=0.002)),
)


def _objective_cases(quick: bool) -> list[harness.Case]:
    """``policy_loss-objectives``: ``Clip()`` (the reference) and the selection-based surrogates."""
    shapes = [(16, 1024)] if quick else [(64, 4096), (8, 16384)]
    dtypes = [torch.float32] if quick else [torch.float32, torch.bfloat16]
    result: list[harness.Case] = []
    for batch, tokens in shapes:
        for dtype in dtypes:
            element = torch.finfo(dtype).bits // 8
            forward_bytes = batch * tokens * (2 * element + 1)
            variants = [
                harness.Variant("ours Clip()", _ours, role="reference"),
            ]
            variants += [
                harness.Variant(f"ours {name}", _ours_surrogate(surrogate))  # type: ignore[arg-type]
                for name, surrogate in OBJECTIVES24
            ]
            result.append(
                harness.Case(
                    operation="policy_loss-objectives",
                    shape=f"B={batch} T={tokens}",
                    dtype=dtype,
                    make_inputs=_make(batch, tokens, dtype, valid=True),
                    grad_inputs=("log_probs",),
                    variants=tuple(variants),
                    floor=harness.CopyFloor(
                        forward_bytes, forward_bytes + batch * tokens * element
                    ),
                )
            )
    return result


def cases(*, quick: bool, device: str) -> list[harness.Case]:
    shapes = [(16, 1024)] if quick else [(64, 4096), (8, 16384)]
    dtypes = [torch.float32] if quick else [torch.float32, torch.bfloat16]
    result: list[harness.Case] = []
    for batch, tokens in shapes:
        for dtype in dtypes:
            element = torch.finfo(dtype).bits // 8
            forward_bytes = batch * tokens * (2 * element + 1)
            variants = [
                harness.Variant("eager reference", _reference, role="reference"),
                harness.Variant("verl compute_policy_loss_vanilla (eager)", _verl),
                harness.Variant("ours", _ours),
                harness.Variant("ours, verl's options (Clip(dual=3.0))", _ours_verl),
                harness.Variant("ours grpo_clipped_surrogate", _ours_seed),
                harness.Variant("ours + importance_weights (B, T)", _ours_weighted),
                harness.Variant("ours surrogate=cispo", _ours_surrogate("cispo")),
                harness.Variant("ours surrogate=sapo", _ours_surrogate("sapo")),
                harness.Variant("eager reference", _reference, compile=True),
                harness.Variant("ours", _ours, compile=True),
            ]
            result.append(
                harness.Case(
                    operation="policy_loss",
                    shape=f"B={batch} T={tokens}",
                    dtype=dtype,
                    make_inputs=_make(batch, tokens, dtype),
                    grad_inputs=("log_probs",),
                    variants=tuple(variants),
                    floor=harness.CopyFloor(
                        forward_bytes, forward_bytes + batch * tokens * element
                    ),
                )
            )
    return result + _objective_cases(quick)
