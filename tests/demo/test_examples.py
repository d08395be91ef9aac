"""Tests of examples/grpo_transformers.py (skipped when transformers is not installed)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")

from rlobjectives.demo import DigitTask, response_log_probs  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_transformers.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grpo_transformers", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_left_padding_does_not_change_the_logits(example: ModuleType) -> None:
    # A prompt padded on the left must get exactly the logits of the unpadded prompt.
    task = DigitTask("sort", length=3)
    torch.manual_seed(0)
    model = example.tiny_gpt2(task, hidden_size=32, num_layers=1).double().eval()
    tokens = torch.cat([task.prompts(torch.tensor([[4, 1, 7]])), torch.tensor([[1, 4]])], dim=1)
    padded = torch.cat([torch.full((1, 2), task.pad), tokens], dim=1)  # 8 = n_positions
    with torch.no_grad():
        plain = example.hf_forward(model, tokens, tokens != task.pad)  # (1, 6, V)
        shifted = example.hf_forward(model, padded, padded != task.pad)[:, 2:]  # same 6 tokens
        # Without the attention mask and position ids the padded logits differ (the test can fail).
        naive = model(input_ids=padded).logits[:, 2:]
    torch.testing.assert_close(shifted, plain, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(naive, plain, atol=1e-6)


def test_response_log_probs_one_token_shift(example: ModuleType) -> None:
    # Reference: feed each prefix alone and read the distribution at its last position.
    task = DigitTask("sort-unique", length=3)
    torch.manual_seed(1)
    model = example.tiny_gpt2(task, hidden_size=32, num_layers=1).double().eval()
    prompts = task.prompts(torch.tensor([[2, 2, 0], [5, 3, 9]]))
    responses = torch.tensor([[0, 2, task.end, task.pad], [3, 5, 9, task.end]])
    with torch.no_grad():
        mask = responses != task.pad
        actual = response_log_probs(model, prompts, responses, mask, forward=example.hf_forward)
        # Left-padding the prompts changes nothing.
        padded_prompts = torch.cat([torch.full((2, 1), task.pad), prompts], dim=1)
        prompt_mask = padded_prompts != task.pad
        padded = response_log_probs(
            model,
            padded_prompts,
            responses,
            mask,
            prompt_mask=prompt_mask,
            forward=example.hf_forward,
        )
        torch.testing.assert_close(padded, actual, rtol=1e-10, atol=1e-10)
        for i in range(2):
            for j in range(4):
                prefix = torch.cat([prompts[i], responses[i, :j]]).unsqueeze(0)
                logits = model(input_ids=prefix).logits[0, -1]
                expected = torch.log_softmax(logits, -1)[responses[i, j]]
                if responses[i, j] == task.pad:  # padding after the end token: 0, masked
                    expected = torch.zeros((), dtype=torch.float64)
                assert math.isclose(float(actual[i, j]), float(expected), abs_tol=1e-6)


@pytest.mark.slow  # a whole run of the example
def test_example_short_run(example: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    arguments = ["--steps", "2", "--warmup-steps", "3", "--prompts-per-step", "2"]
    arguments += ["--group-size", "4", "--eval-every", "1", "--eval-size", "20", "--no-progress"]
    assert example.main([*arguments, "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["loss"]) and 0 <= row["reward"] <= 1 for row in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_completed"] == 2 and summary["interrupted"] is False
    assert (out / "metrics.png").read_bytes()[:4] == b"\x89PNG"


def test_packed_log_probs_equal_padded(example: ModuleType) -> None:
    # The packed row (block-diagonal mask, positions restarting per sequence) scores every
    # response token exactly as the padded batch does, with the one-token shift inside each
    # sequence (float64 model: equal to rounding).
    import rlobjectives as rlo

    task = DigitTask("sort", length=3)
    torch.manual_seed(2)
    model = example.tiny_gpt2(task, hidden_size=32, num_layers=2).double().eval()
    prompts = task.prompts(torch.tensor([[4, 1, 7], [2, 2, 0], [5, 3, 9]]))
    responses = torch.tensor(
        [[1, 4, 7, task.end], [0, 2, task.end, task.pad], [task.end, task.pad, task.pad, task.pad]]
    )
    mask = responses != task.pad
    attention = torch.cat([torch.ones_like(prompts, dtype=torch.bool), mask], dim=1)
    batch = example.PackedBatch(torch.cat([prompts, responses], 1), attention, prompts.shape[1])
    with torch.no_grad():
        padded = response_log_probs(model, prompts, responses, mask, forward=example.hf_forward)
        packed = example.packed_log_probs(model, batch)
    assert packed.log_probs.shape == (int(attention.sum()),)
    assert int(packed.mask.sum()) == int(mask.sum())
    torch.testing.assert_close(packed.log_probs[packed.mask], padded[mask], rtol=0, atol=1e-12)
    # Selecting rows of the packed values (unpack, then pack the rows) keeps them aligned.
    rows = torch.tensor([2, 0])
    selected = batch.select(packed.log_probs, rows)
    assert torch.equal(selected, rlo.pack(rlo.unpack(packed.log_probs, batch.packed.cu_seqlens,
                                                     length=attention.shape[1]).values[rows],
                                          attention[rows]).values)  # fmt: skip


def test_first_step_loss_packed_equals_padded(example: ModuleType) -> None:
    task = DigitTask("sort-unique", length=4)
    torch.manual_seed(3)
    model = example.tiny_gpt2(task, hidden_size=32, num_layers=2).double()
    # On-policy (ratio 1) the loss is -sum_i A_i w_i with group-centred A: token_mean and Dr.
    # GRPO weight sequences by their lengths, so the loss is not 0 when lengths differ.
    for reduction in ("token_mean", "sequence_sum_normalized"):
        config = example.DemoConfig(prompts_per_step=4, group_size=8, reduction=reduction)
        padded, packed = example.first_step_losses(model, task, config, seed=1)
        assert abs(padded) > 1e-3, (reduction, padded)
        assert math.isclose(packed, padded, rel_tol=1e-12, abs_tol=1e-12), reduction


@pytest.mark.slow  # a whole run of the example
def test_example_short_run_packed(example: ModuleType, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "hf-packed"
    arguments = ["--steps", "2", "--warmup-steps", "3", "--prompts-per-step", "2", "--packed"]
    arguments += ["--group-size", "4", "--eval-every", "1", "--eval-size", "20", "--no-progress"]
    assert example.main([*arguments, "--out", str(out)]) == 0
    assert "first-step loss: padded" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["loss"]) and 0 <= row["reward"] <= 1 for row in rows)
