"""KL benchmarks: ``kl_penalized_rewards`` and (when present) ``kl_estimate`` / ``kl_loss``.

Each against its eager reference from ``tests/eager_reference.py``; backward with respect to the
policy log-probabilities. Floor: one copy of the bytes a single pass moves (two ``(B, T)`` inputs
and the mask read, the ``(B, T)`` gradient written).
"""

from __future__ import annotations

import importlib

import torch

import eager_reference as eager
import harness
import rlobjectives

Inputs = harness.Inputs


def _make(batch: int, tokens: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    def make_inputs(device: torch.device) -> Inputs:
        generator = torch.Generator().manual_seed(0)
        log_probs = -torch.rand(batch, tokens, generator=generator) * 3
        ref_log_probs = log_probs + 0.1 * torch.randn(batch, tokens, generator=generator)
        lengths = torch.randint(int(0.4 * tokens), tokens + 1, (batch, 1), generator=generator)
        mask = torch.arange(tokens).unsqueeze(0) < lengths  # prefix masks, ~70% selected
        rewards = torch.randn(batch, generator=generator)
        tensors = {
            "log_probs": log_probs.to(dtype),
            "ref_log_probs": ref_log_probs.to(dtype),
            "rewards": rewards,
            "mask": mask,
        }
        return {name: tensor.to(device) for name, tensor in tensors.items()}

    return make_inputs


def _floor(batch: int, tokens: int, dtype: torch.dtype) -> harness.CopyFloor:
    element = torch.finfo(dtype).bits // 8
    forward = batch * tokens * (2 * element + 1)
    return harness.CopyFloor(forward, forward + batch * tokens * element)


def cases(*, quick: bool, device: str) -> list[harness.Case]:
    shapes = [(16, 1024)] if quick else [(64, 4096), (8, 16384)]
    dtypes = [torch.float32] if quick else [torch.float32, torch.bfloat16]
    kl_module = None
    try:
        kl_module = importlib.import_module("rlobjectives.kl.loss")
    except ImportError:  # pragma: no cover - the KL estimators are optional here
        pass
    result: list[harness.Case] = []
    for batch, tokens in shapes:
        for dtype in dtypes:
            shape = f"B={batch} T={tokens}"
            make, floor = _make(batch, tokens, dtype), _floor(batch, tokens, dtype)
            result.append(
                harness.Case(
                    operation="kl_penalized_rewards",
                    shape=shape,
                    dtype=dtype,
                    make_inputs=make,
                    grad_inputs=("log_probs",),
                    variants=(
                        harness.Variant(
                            "eager reference",
                            lambda x: eager.kl_penalized_rewards(
                                x["log_probs"], x["ref_log_probs"], x["rewards"], x["mask"], 0.1
                            ),
                            role="reference",
                        ),
                        harness.Variant(
                            "ours",
                            lambda x: rlobjectives.kl_penalized_rewards(
                                x["log_probs"], x["ref_log_probs"], x["rewards"], x["mask"], 0.1
                            )["objective"],
                        ),
                    ),
                    floor=floor,
                )
            )
            if kl_module is None or not hasattr(kl_module, "kl_loss"):
                continue
            kl_loss = kl_module.kl_loss
            for estimator in ("k1", "k3") if quick else ("k1", "k2", "k3"):
                result.append(
                    harness.Case(
                        operation=f"kl_loss {estimator}",
                        shape=shape,
                        dtype=dtype,
                        make_inputs=make,
                        grad_inputs=("log_probs",),
                        variants=(
                            harness.Variant(
                                "eager reference",
                                lambda x, e=estimator: eager.kl_loss(
                                    x["log_probs"], x["ref_log_probs"], x["mask"], estimator=e
                                ),
                                role="reference",
                            ),
                            harness.Variant(
                                "ours",
                                lambda x, e=estimator, f=kl_loss: _quiet(f)(
                                    x["log_probs"], x["ref_log_probs"], x["mask"], estimator=e
                                ),
                            ),
                        ),
                        floor=floor,
                    )
                )
    return result


def _quiet(fn):  # type: ignore[no-untyped-def]
    """Call ``fn`` with its (expected) BiasedGradientWarning silenced."""
    import warnings

    def call(*args, **kwargs):  # type: ignore[no-untyped-def]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)

    return call
