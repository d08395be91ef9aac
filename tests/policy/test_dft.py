"""``dft_loss`` (Dynamic Fine-Tuning, arXiv:2508.05629) and ``presets.trl_sft_loss``.

TRL 1.16's own ``SFTTrainer.compute_loss`` runs here on a stub trainer whose model returns the
given log-probabilities (TRL's fused LM-head outputs), so the comparison is with TRL's code.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
import rlobjectives as rlo
from rlobjectives import presets

D = torch.float64


def test_golden() -> None:
    # p = 0.5, 0.25 selected (row 0), nothing in row 1:
    # token_mean: (-0.5 ln 0.5 - 0.25 ln 0.25) / 2 = (0.5 ln 2 + 0.5 ln 2) / 2 = ln(2) / 2
    # gradient: -p / N = -0.25, -0.125 at the selected tokens, 0 elsewhere (p = 1: unselected)
    log_probs = torch.log(torch.tensor([[0.5, 0.25, 1.0], [0.1, 1.0, 1.0]], dtype=D))
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    leaf = log_probs.clone().requires_grad_(True)
    out = rlo.dft_loss(leaf, mask)
    assert math.isclose(float(out.detach()), math.log(2) / 2, rel_tol=1e-15)
    out.backward()
    expected = torch.tensor([[-0.25, -0.125, 0.0], [0.0, 0.0, 0.0]], dtype=D)
    torch.testing.assert_close(leaf.grad, expected, rtol=1e-15, atol=0)
    # sequence_mean over the one non-empty row: the same; "none": -p l at the selected tokens
    torch.testing.assert_close(rlo.dft_loss(log_probs, mask, reduction="sequence_mean"), out)
    per_token = rlo.dft_loss(log_probs, mask, reduction="none")
    assert per_token[1].abs().sum() == 0 and per_token[0, 2] == 0


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(0, 5),
    tokens=st.integers(0, 6),
    seed=st.integers(0, 2**16),
    reduction=st.sampled_from(
        ["token_mean", "sequence_mean", "sequence_sum_normalized", "length_weighted", "none"]
    ),
    normalizer=st.sampled_from([None, 0.75, 5.0]),
)
def test_matches_the_reference(
    batch: int, tokens: int, seed: int, reduction: str, normalizer: float | None
) -> None:
    generator = torch.Generator().manual_seed(seed)
    values = -3 * torch.rand(batch, tokens, generator=generator, dtype=D)
    mask = torch.rand(batch, tokens, generator=generator) < 0.6
    ours_leaf, ref_leaf = values.clone().requires_grad_(True), values.clone().requires_grad_(True)
    ours = rlo.dft_loss(ours_leaf, mask, reduction=reduction, normalizer=normalizer)
    expected = reference.dft_loss(ref_leaf, mask, reduction=reduction, normalizer=normalizer)
    torch.testing.assert_close(ours, expected, rtol=1e-13, atol=1e-15)
    weights = torch.linspace(0.5, 1.5, max(ours.numel(), 1), dtype=D)[: ours.numel()]
    if expected.requires_grad:
        (ours * weights.reshape(ours.shape)).sum().backward()
        (expected * weights.reshape(expected.shape)).sum().backward()
        torch.testing.assert_close(ours_leaf.grad, ref_leaf.grad, rtol=1e-13, atol=1e-15)


def test_gradcheck() -> None:
    log_probs = (-torch.rand(3, 4, dtype=D) - 0.05).requires_grad_(True)
    mask = torch.rand(3, 4) < 0.7
    # the weight sg(p) is a constant: the Jacobian is -p / N, checked against finite
    # differences of a function with the weight frozen at the same point
    weight = log_probs.detach().exp()

    def frozen(x: torch.Tensor) -> torch.Tensor:
        return rlo.aggregate(-(weight * x), mask)

    ours = torch.autograd.grad(rlo.dft_loss(log_probs, mask), log_probs)[0]
    assert torch.autograd.gradcheck(frozen, (log_probs,))
    expected = torch.autograd.grad(frozen(log_probs), log_probs)[0]
    torch.testing.assert_close(ours, expected, rtol=1e-15, atol=0)


def test_micro_batches_with_the_global_count_sum_to_the_full_batch() -> None:
    generator = torch.Generator().manual_seed(35010)
    values = -2 * torch.rand(8, 6, generator=generator, dtype=D)
    mask = torch.rand(8, 6, generator=generator) < 0.6
    full = rlo.dft_loss(values, mask)
    count = int(mask.sum())
    parts = sum(
        rlo.dft_loss(values[a : a + 3], mask[a : a + 3], normalizer=count) for a in (0, 3, 6)
    )
    torch.testing.assert_close(parts, full, rtol=1e-14, atol=0)


def test_half_precision_rounds_once() -> None:
    values = -torch.rand(4, 5, dtype=torch.bfloat16)
    mask = torch.rand(4, 5) < 0.7
    out = rlo.dft_loss(values, mask)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, rlo.dft_loss(values.float(), mask).to(torch.bfloat16))


# --- TRL 1.16 SFTTrainer.compute_loss, its own code on a stub ----------------------------------


trl = pytest.importorskip("trl")


class _Accelerator:
    num_processes = 1
    parallelism_config = None
    sync_gradients = True

    def gather_for_metrics(self, value: torch.Tensor) -> torch.Tensor:
        return value.reshape(-1)


def _trl_sft_loss(
    log_probs: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    num_items_in_batch: Any = None,
    num_processes: int = 1,
) -> torch.Tensor:
    """TRL's ``SFTTrainer.compute_loss`` on a stub trainer; the model returns ``log_probs``."""
    outputs = SimpleNamespace(
        log_probs=torch.where(mask, log_probs, 0.0),  # zero on ignored positions, as TRL's head
        label_mask=mask,
        entropy=torch.zeros_like(log_probs),
        is_top1=torch.zeros_like(mask),
    )
    accelerator = _Accelerator()
    accelerator.num_processes = num_processes
    stub = SimpleNamespace(
        model=SimpleNamespace(training=True),
        aux_loss_enabled=False,
        accelerator=accelerator,
        compute_loss_func=None,
        label_smoother=None,
        args=SimpleNamespace(loss_type=loss_type, average_tokens_across_devices=True),
        get_tp_size=lambda: 1,
        _metrics={"train": {"entropy": [], "mean_token_accuracy": [], "num_tokens": []}},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {"input_ids": torch.zeros_like(mask, dtype=torch.long), "attention_mask": mask}
    return trl.SFTTrainer.compute_loss(
        stub, lambda **kw: outputs, inputs, num_items_in_batch=num_items_in_batch
    )


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
@pytest.mark.parametrize("items", [None, 37])
@pytest.mark.parametrize("processes", [1, 4])
def test_equals_trl(loss_type: str, items: int | None, processes: int) -> None:
    generator = torch.Generator().manual_seed(35011)
    values = -3 * torch.rand(5, 9, generator=generator, dtype=D)
    mask = torch.rand(5, 9, generator=generator) < 0.7
    ours_leaf, trl_leaf = values.clone().requires_grad_(True), values.clone().requires_grad_(True)
    theirs = _trl_sft_loss(trl_leaf, mask, loss_type, items, processes)
    loss = presets.trl_sft_loss(
        loss_type=loss_type, num_items_in_batch=items, num_processes=processes
    )
    ours = loss(ours_leaf, mask)
    torch.testing.assert_close(ours, theirs, rtol=1e-15, atol=1e-16)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours_leaf.grad, trl_leaf.grad, rtol=1e-15, atol=1e-17)


def test_trl_sft_loss_options() -> None:
    with pytest.raises(ValueError, match=r"^loss_type must be one of"):
        presets.trl_sft_loss(loss_type="chunked_nll")
    with pytest.raises(ValueError, match=r"^num_processes must be"):
        presets.trl_sft_loss(num_processes=0)
    with pytest.raises(ValueError, match=r"^num_items_in_batch must be"):
        presets.trl_sft_loss(num_items_in_batch=-1)
