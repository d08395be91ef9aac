"""Regression tests of issue 27 (hostile inputs on the new features), one per item.

Each test is named after its item and quotes it; each failed on main before the fixes (checked
at 2db2215). The class-wide rows the issue asks for live with their suites: packed == padded for
every per-sequence argument (``tests/packed_cases.py``), the mixed-dtype and environment rows of
the error contract (``tests/test_error_contract.py``), the diagnostics over magnitudes 1e-30 to
1e30 (``tests/test_diagnostics_range.py``) and the preset options (``tests/test_presets.py``).
"""

from __future__ import annotations

import math

import torch

import rlobjectives as rlo


def _policy_batch(seed: int = 27) -> dict[str, torch.Tensor]:
    """Four sequences (one empty) in the padded layout, float64, with a weight per sequence."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 0, 2, 4])
    attention = torch.arange(4)[None, :] < lengths[:, None]  # (S, T)
    log_probs = -torch.rand(4, 4, generator=generator, dtype=torch.float64) - 0.5
    old_log_probs = log_probs + 0.2 * torch.randn(4, 4, generator=generator, dtype=torch.float64)
    return {
        "attention": attention,
        "log_probs": log_probs,
        "old_log_probs": old_log_probs,
        "advantages": torch.tensor([0.7, -0.3, -1.2, 0.4], dtype=torch.float64),
        "weights": torch.tensor([0.6, 1.0, 1.7, 0.9], dtype=torch.float64),
    }


def test_item1_vespo_packed_sequence_weight_enters_once() -> None:
    # "VESPO, packed, one importance weight per sequence [...] the padded per-sequence weight
    # enters log W once per sequence, the packed one is broadcast to the tokens and enters n_i
    # times."
    batch = _policy_batch()
    attention = batch["attention"]
    padded = rlo.policy_loss(
        batch["log_probs"], batch["old_log_probs"], batch["advantages"], attention,
        surrogate="vespo", importance_weights=batch["weights"], return_per_token=True,
    )  # fmt: skip
    packed_lp = rlo.pack(batch["log_probs"], attention)
    packed = rlo.policy_loss(
        packed_lp.values, rlo.pack(batch["old_log_probs"], attention).values,
        batch["advantages"], rlo.pack(attention, attention).values, surrogate="vespo",
        importance_weights=batch["weights"], cu_seqlens=packed_lp.cu_seqlens,
        return_per_token=True,
    )  # fmt: skip
    torch.testing.assert_close(packed.loss, padded.loss, rtol=1e-12, atol=1e-12)
    assert padded.per_token_loss is not None and packed.per_token_loss is not None
    expected = rlo.pack(padded.per_token_loss, attention).values
    torch.testing.assert_close(packed.per_token_loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        packed.diagnostics.weight_mean, padded.diagnostics.weight_mean, rtol=1e-12, atol=1e-12
    )
    # log W_0 = sum_t log r_0t + log w_0 (once): phi of sequence 0 by hand, k = 2, lambda = 3.
    log_w = float((batch["log_probs"] - batch["old_log_probs"])[0, :3].sum()) + math.log(0.6)
    phi = math.exp(3.0 + 2.0 * log_w - 3.0 * math.exp(log_w))
    loss_0 = -phi * 0.7 * batch["log_probs"][0, :3]  # the per-token loss -phi A l
    torch.testing.assert_close(packed.per_token_loss[:3], loss_0, rtol=1e-12, atol=1e-12)
