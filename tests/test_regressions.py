"""Regression tests of issue 10 (reliability), one per item, through the public API.

Each test is named after its item and quotes it; each failed on main before the fixes (checked
at 44ee47e); none is marked xfail any more. The CI-stability item (the flaky ``torchrun``
test) is checked by ``tests/test_demo.py::test_torchrun_two_ranks`` itself, the test the issue
names.
"""

from __future__ import annotations

import inspect
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import reference
import rlobjectives as rlo
from rlobjectives import Clip
from rlobjectives.cli import main as cli_main
from tolerances import assert_close

CONTRADICTION = re.compile(r"0-d real tensor, got Tensor\(shape=\(\)")


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    # These tests use tiny tensors; on a loaded 2-core machine intra-op threads only add
    # synchronisation (a 2-thread log_softmax of a (24, 7) tensor measured 20 ms, 1 thread 8 us).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _policy_batch(
    dtype: torch.dtype = torch.float64, batch: int = 3, tokens: int = 5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10)
    log_probs = -torch.rand(batch, tokens, generator=generator, dtype=dtype)
    old_log_probs = log_probs + 0.3 * torch.randn(batch, tokens, generator=generator, dtype=dtype)
    advantages = torch.randn(batch, generator=generator, dtype=dtype)
    mask = torch.rand(batch, tokens, generator=generator) < 0.7
    mask[:, 0] = True
    return log_probs, old_log_probs, advantages, mask


def _hidden_batch(
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(2, 3, 4, generator=generator, dtype=dtype)
    weight = torch.randn(6, 4, generator=generator, dtype=dtype)
    tokens = torch.randint(0, 6, (2, 3), generator=generator)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    return hidden, weight, tokens, mask


# --- wrong numbers or NaN ---------------------------------------------------------------------


def test_entropy_from_hidden_with_a_banned_token_is_finite() -> None:
    """``token_log_probs_from_hidden(..., return_entropy=True)`` with a ``-inf`` in the bias (a
    banned token) returns NaN entropy and NaN gradients; ``token_entropy`` on the same logits is
    finite. Same contract, same result."""
    hidden, weight, tokens, _ = _hidden_batch()
    bias = torch.zeros(6, dtype=torch.float64)
    bias[2] = -math.inf
    tokens = torch.where(tokens == 2, 0, tokens)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    out = rlo.token_log_probs_from_hidden(hidden, weight, tokens, bias=bias, return_entropy=True)
    assert torch.isfinite(out.entropy).all() and torch.isfinite(out.log_probs).all()
    (out.entropy.sum() + out.log_probs.sum()).backward()
    grads = (hidden.grad, weight.grad)
    assert all(g is not None and torch.isfinite(g).all() for g in grads)

    hidden_2 = hidden.detach().clone().requires_grad_(True)
    weight_2 = weight.detach().clone().requires_grad_(True)
    logits = hidden_2 @ weight_2.T + bias  # (B, T, V), -inf in column 2
    entropy = rlo.token_entropy(logits)
    assert_close(out.entropy, entropy.detach())
    (entropy.sum() + rlo.token_log_probs(logits, tokens).sum()).backward()
    assert_close(hidden.grad, hidden_2.grad)  # type: ignore[arg-type]
    assert_close(weight.grad, weight_2.grad)  # type: ignore[arg-type]


def test_masked_mean_of_float16_accumulates_in_float32() -> None:
    """``masked_mean`` on float16 values accumulates in float16 (1000 values of 100 → inf),
    against the documented rule that nothing is accumulated in half precision."""
    values = torch.full((2, 1000), 100.0, dtype=torch.float16)
    mask = torch.ones(2, 1000, dtype=torch.bool)
    total = rlo.masked_mean(values, mask)
    assert total.dtype == torch.float16 and float(total) == 100.0
    rows = rlo.masked_mean(values, mask, dim=-1)
    assert rows.dtype == torch.float16 and rows.tolist() == [100.0, 100.0]


def test_fused_approx_kl_k3_is_computed_without_cancellation() -> None:
    """The ``approx_kl_k3`` diagnostic of the fused policy path is computed as Σ(r − 1) − Σ log r,
    which loses most of its digits near on-policy (log-ratios around 1e-4 give about 80%
    relative error in float32): compute it without cancellation."""
    generator = torch.Generator().manual_seed(12)
    log_probs = -torch.rand(64, 50, generator=generator)  # float32
    old_log_probs = log_probs + 1e-4 * torch.randn(64, 50, generator=generator)
    advantages = torch.randn(64, generator=generator)
    mask = torch.rand(64, 50, generator=generator) < 0.8
    log_ratio = (log_probs.double() - old_log_probs.double())[mask]
    expected = float((torch.expm1(log_ratio) - log_ratio).mean())  # float64, same float32 inputs

    fused = rlo.policy_loss(log_probs.clone().requires_grad_(True), old_log_probs, advantages, mask)
    other_path = rlo.policy_loss(
        log_probs, old_log_probs.clone().requires_grad_(True), advantages, mask
    )
    for value in (fused.diagnostics.approx_kl_k3, other_path.diagnostics.approx_kl_k3):
        assert abs(float(value) - expected) < 1e-3 * expected, (float(value), expected)
    torch.testing.assert_close(
        fused.diagnostics.approx_kl_k3, other_path.diagnostics.approx_kl_k3, rtol=1e-4, atol=0
    )


def test_advantages_with_extreme_reward_magnitudes() -> None:
    """``group_relative_advantages`` and ``reinforce_plus_plus_advantages`` return zeros for
    rewards around 1e20 (the float32 variance overflows): scale before squaring, or compute in
    float64 where the input is large, and test with extreme magnitudes."""
    base = torch.tensor([1.0, 2.0, 4.0, -3.0, 0.5, 7.0])
    mask = torch.tensor([[True, True, False]] * 6)
    for scale in (1e20, 1e-20, 3e37):
        rewards = base * scale  # float32
        pairs = [
            (
                rlo.group_relative_advantages(rewards, 3),
                reference.group_relative_advantages(rewards.double(), 3),
            ),
            (
                rlo.reinforce_plus_plus_advantages(rewards, mask),
                reference.reinforce_plus_plus_advantages(rewards.double(), mask),
            ),
        ]
        for actual, expected in pairs:
            assert actual.dtype == torch.float32
            assert torch.isfinite(actual).all(), (scale, actual)
            assert (actual[expected != 0] != 0).all(), (scale, actual)
            torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=0)


def _max_length_calls(length: Any) -> list[tuple[str, Any]]:
    """Every path that reads ``max_response_length`` (``sequence_sum_normalized``)."""
    log_probs, old_log_probs, advantages, mask = _policy_batch()
    hidden, weight, tokens, hidden_mask = _hidden_batch()
    logits = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    common = {"reduction": "sequence_sum_normalized", "max_response_length": length}
    return [
        (
            "policy_loss (fused)",
            lambda: (
                rlo.policy_loss(
                    log_probs.clone().requires_grad_(True),
                    old_log_probs,
                    advantages,
                    mask,
                    **common,
                ).loss
            ),
        ),
        (
            "policy_loss (autograd)",
            lambda: (
                rlo.policy_loss(
                    log_probs,
                    old_log_probs.clone().requires_grad_(True),
                    advantages,
                    mask,
                    **common,
                ).loss
            ),
        ),
        ("aggregate", lambda: rlo.aggregate(log_probs, mask, **common)),
        ("kl_loss", lambda: rlo.kl_loss(log_probs, old_log_probs, mask, estimator="k2", **common)),
        (
            "full_vocab_kl_loss",
            lambda: rlo.full_vocab_kl_loss(logits, logits * 0.5, mask, **common),
        ),
        (
            "fused_policy_loss_from_hidden",
            lambda: (
                rlo.fused_policy_loss_from_hidden(
                    hidden, weight, tokens, torch.zeros(2, 3), torch.ones(2), hidden_mask, **common
                ).loss
            ),
        ),
    ]


def test_fractional_max_response_length_is_rejected_on_every_path() -> None:
    """``max_response_length`` between 0 and 1 is silently replaced by 1; (...) Either honour
    fractional values on every path or reject them, consistently. (Decided: a positive integer;
    a fractional value raises ``ValueError`` naming ``max_response_length`` on every path.)"""
    for length in (0.5, 2.5):
        for path, call in _max_length_calls(length):
            with pytest.raises(ValueError, match=r"^max_response_length\b"):
                call()
                pytest.fail(f"{path} accepted max_response_length={length}")


def test_fractional_normalizers_are_honoured_on_every_path() -> None:
    """(...) ``diagnostics_normalizer=0.5`` gives different diagnostics on the fused and autograd
    paths. Either honour fractional values on every path or reject them, consistently.
    (Decided: any positive finite normaliser is honoured exactly, never clamped to 1.)"""
    log_probs, old_log_probs, advantages, mask = _policy_batch()
    ratio = torch.exp(log_probs - old_log_probs)[mask]  # no clipping of values involved below
    surrogate = reference.policy_loss(
        log_probs, old_log_probs, advantages, mask, reduction="token_mean"
    ) * int(mask.sum())  # the token-mean loss times the count: -(sum of surrogates)
    paths = {
        "fused": (log_probs.clone().requires_grad_(True), old_log_probs),
        "autograd": (log_probs, old_log_probs.clone().requires_grad_(True)),
    }
    for lp, old in paths.values():
        out = rlo.policy_loss(lp, old, advantages, mask, normalizer=0.5, diagnostics_normalizer=0.5)
        assert_close(out.diagnostics.ratio_mean, float(ratio.sum()) / 0.5)
        assert_close(out.loss, float(surrogate) / 0.5)
    hidden, weight, tokens, hidden_mask = _hidden_batch()
    new = rlo.token_log_probs_from_hidden(hidden, weight, tokens)
    out = rlo.fused_policy_loss_from_hidden(
        hidden, weight, tokens, new, torch.ones(2), hidden_mask, diagnostics_normalizer=0.5
    )
    assert_close(out.diagnostics.ratio_mean, int(hidden_mask.sum()) / 0.5)  # every ratio is 1


class _Allocations(TorchDispatchMode):
    """Records the element count of every tensor an op allocates (not views of its inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.sizes.append((t.numel(), str(func)))
        return out


def test_strided_logits_are_processed_chunk_by_chunk() -> None:
    """The common ``logits[:, :-1]`` slice given to ``token_log_probs``, ``token_entropy`` or
    ``full_vocab_kl`` is copied whole to float32 and kept for backward, against the documented
    O(chunk·V) extra memory: handle strided views chunk by chunk."""
    generator = torch.Generator().manual_seed(13)
    base = torch.randn(2, 33, 128, generator=generator, requires_grad=True)  # float32 logits
    ref_base = torch.randn(2, 33, 128, generator=generator)
    tokens = torch.randint(0, 128, (2, 32), generator=generator)
    calls = {
        "token_log_probs": lambda x, r: rlo.token_log_probs(x, tokens, chunk_size=8),
        "token_entropy": lambda x, r: rlo.token_entropy(x, chunk_size=8),
        "full_vocab_kl": lambda x, r: rlo.full_vocab_kl(x, r, chunk_size=8),
    }
    for name, call in calls.items():
        view, ref_view = base[:, :-1], ref_base[:, :-1]  # strided, not contiguous
        with _Allocations() as allocations:
            strided = call(view, ref_view)  # the forward, with grad enabled (saves for backward)
        whole = [size for size in allocations.sizes if size[0] >= view.numel()]
        assert not whole, f"{name} allocated a copy of the whole logits: {whole}"
        (grad_strided,) = torch.autograd.grad(strided.sum(), base)
        contiguous_base = base.detach().clone().requires_grad_(True)
        contiguous = call(contiguous_base[:, :-1].contiguous(), ref_view.contiguous())
        (grad_contiguous,) = torch.autograd.grad(contiguous.sum(), contiguous_base)
        torch.testing.assert_close(strided, contiguous, rtol=0, atol=0)
        torch.testing.assert_close(grad_strided, grad_contiguous, rtol=0, atol=0)


# --- silent misuse ----------------------------------------------------------------------------


def test_policy_loss_treats_advantages_and_old_log_probs_as_constants() -> None:
    """``policy_loss`` lets gradient flow into ``advantages`` and ``old_log_probs`` while the
    fused path treats them as constants: make the two paths agree (constants, documented) so an
    undetached critic never receives policy gradient."""
    log_probs, old_log_probs, advantages, mask = _policy_batch()
    for options in (
        {},
        {"ratio_level": "sequence"},
        {"surrogate": Clip(low=None)},
        {"surrogate": Clip(dual=3.0)},
    ):
        lp = log_probs.clone().requires_grad_(True)
        old = old_log_probs.clone().requires_grad_(True)
        adv = advantages.clone().requires_grad_(True)
        rlo.policy_loss(lp, old, adv, mask, **options).loss.backward()
        assert lp.grad is not None
        assert adv.grad is None and old.grad is None, options
    hidden, weight, tokens, hidden_mask = _hidden_batch()
    hidden.requires_grad_(True)
    old = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    adv = torch.ones(2, dtype=torch.float64, requires_grad=True)
    rlo.fused_policy_loss_from_hidden(hidden, weight, tokens, old, adv, hidden_mask).loss.backward()
    assert hidden.grad is not None and adv.grad is None and old.grad is None
    doc = inspect.getdoc(rlo.policy_loss) or ""
    assert re.search(r"constant", doc, re.IGNORECASE), "the docstring says they are constants"


def test_response_alignment_with_the_padded_prompt_width() -> None:
    """``response_alignment`` with a left-padded prompt and ``prompt_lengths`` set to the padded
    width silently drops response tokens: validate against the layout or offer an explicit
    response-start argument."""
    # verl/TRL layout: prompts left-padded to width 3, responses right-padded to width 3; row 0
    # is padded on both sides, which only this layout does (rows padded on one side alone are
    # ambiguous: each row may be left- or right-padded on its own, a supported layout).
    input_ids = torch.tensor([[0, 11, 12, 21, 22, 0], [13, 14, 15, 24, 25, 26]])
    attention_mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"^prompt_lengths\b.*response_start"):
        rlo.response_alignment(input_ids, [3, 3], attention_mask, response_length=3)
    # The explicit response start (the padded prompt width) gives every response token.
    alignment = rlo.response_alignment(
        input_ids, None, attention_mask, response_start=3, response_length=3
    )
    assert alignment.tokens.tolist() == [[21, 22, 0], [24, 25, 26]]
    assert alignment.mask.tolist() == [[True, True, False], [True, True, True]]


def test_clip_low_of_one_or_more_is_rejected() -> None:
    """``clip_low >= 1`` is accepted (the lower band goes to 0 or below)."""
    log_probs, old_log_probs, advantages, mask = _policy_batch()
    hidden, weight, tokens, hidden_mask = _hidden_batch()
    for clip_low in (1.0, 1.5, torch.tensor(1.0)):
        with pytest.raises(ValueError, match=r"^Clip.low\b"):
            rlo.policy_loss(
                log_probs, old_log_probs, advantages, mask, surrogate=Clip(low=clip_low)
            )
        with pytest.raises(ValueError, match=r"^Clip.low\b"):
            rlo.fused_policy_loss_from_hidden(
                hidden, weight, tokens, torch.zeros(2, 3), torch.ones(2), hidden_mask,
                surrogate=Clip(low=clip_low),
            )  # fmt: skip
    rlo.policy_loss(
        log_probs, old_log_probs, advantages, mask, surrogate=Clip(low=0.999)
    )  # still valid


def test_masked_sum_and_mean_validate_the_mask() -> None:
    """``masked_sum`` / ``masked_mean`` do not validate the mask: a mask of the wrong shape
    broadcasts silently; numeric masks and list inputs give raw torch errors."""
    values = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]])
    for function in (rlo.masked_sum, rlo.masked_mean):
        for wrong in (torch.ones(3, dtype=torch.bool), torch.ones(2, 1, dtype=torch.bool)):
            with pytest.raises(ValueError, match=r"^mask\b"):
                function(values, wrong)
    # Numeric masks select where nonzero: entries 1, 4, 32.
    for mask in (torch.tensor([[1, 0, 2], [0, 0, -1]]), torch.tensor([[0.5, 0.0, 1.0], [0, 0, 3]])):
        assert float(rlo.masked_sum(values, mask)) == 37.0
        assert float(rlo.masked_mean(values, mask)) == pytest.approx(37.0 / 3, rel=1e-6)
        assert rlo.masked_sum(values, mask, dim=-1).tolist() == [5.0, 32.0]
    # Nested lists for both arguments.
    assert float(rlo.masked_sum([[1.0, 2.0], [3.0, 4.0]], [[1, 0], [0, 1]])) == 5.0
    assert float(rlo.masked_mean([[1.0, 2.0], [3.0, 4.0]], [[True, False], [False, True]])) == 2.5


# --- crashes instead of clear errors ----------------------------------------------------------


def test_fused_policy_loss_from_hidden_under_inference_mode() -> None:
    """``fused_policy_loss_from_hidden`` fails under ``torch.inference_mode()`` (every other loss
    evaluates there) (...)."""
    hidden, weight, tokens, mask = _hidden_batch()
    old, advantages = torch.zeros(2, 3, dtype=torch.float64), torch.tensor([1.0, -1.0])
    expected = rlo.fused_policy_loss_from_hidden(hidden, weight, tokens, old, advantages, mask)
    with torch.inference_mode():
        actual = rlo.fused_policy_loss_from_hidden(hidden, weight, tokens, old, advantages, mask)
    torch.testing.assert_close(actual.loss, expected.loss)
    torch.testing.assert_close(actual.log_probs, expected.log_probs)


@pytest.mark.compile
def test_fused_policy_loss_from_hidden_traces_with_fullgraph() -> None:
    """(...) and cannot be traced with ``torch.compile(fullgraph=True)``, which the README
    promises for the functions."""
    hidden, weight, tokens, mask = _hidden_batch(torch.float32)
    old, advantages = torch.zeros(2, 3), torch.tensor([1.0, -1.0])

    def loss(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return rlo.fused_policy_loss_from_hidden(h, w, tokens, old, advantages, mask).loss

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    results = []
    for function in (loss, compiled):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        value = function(h, w)
        value.backward()
        results.append((value.detach(), h.grad, w.grad))
    for actual, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(actual, expected)


@pytest.mark.compile
def test_a_surrogate_name_traces_with_fullgraph_on_the_first_call() -> None:
    """``policy_loss(surrogate="sapo")`` built the name's object on first use with
    ``dataclasses.fields``, which ``torch.compile(fullgraph=True)`` cannot trace: a process whose
    first call was compiled failed (the suite passed only because an eager call came first)."""
    program = (
        "import torch, rlobjectives as rlo\n"
        "x, old, a, m = torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3) > 0\n"
        "step = lambda s: rlo.policy_loss(x, old, a, m, surrogate=s).loss\n"
        "for name in ('sapo', 'gmpo', 'probability_band'):\n"
        "    compiled = torch.compile(step, fullgraph=True, backend='eager')\n"
        "    assert torch.equal(compiled(name), step(name)), name\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_errors_blame_the_right_argument() -> None:
    """Errors that blame the wrong argument (``old_log_probs`` wrong → message about ``mask``;
    wrong device → message about ``advantages``) (...)."""
    hidden, weight, tokens, mask = _hidden_batch()
    old, advantages = torch.zeros(2, 3, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    log_probs, old_log_probs, advantages_p, mask_p = _policy_batch()
    wrong_shape = torch.zeros(2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^old_log_probs\b"):
        rlo.fused_policy_loss_from_hidden(hidden, weight, tokens, wrong_shape, advantages, mask)
    with pytest.raises(ValueError, match=r"^old_log_probs\b"):
        rlo.fused_policy_loss_from_hidden(hidden, weight, tokens, old.to("meta"), advantages, mask)
    with pytest.raises(ValueError, match=r"^old_log_probs\b"):
        rlo.policy_loss(log_probs, old_log_probs[:, :-1], advantages_p, mask_p)
    with pytest.raises(ValueError, match=r"^old_log_probs\b"):
        rlo.policy_loss(log_probs, old_log_probs.to("meta"), advantages_p, mask_p)


def test_zero_vocabulary_or_hidden_size_is_a_named_error() -> None:
    """(...) raw torch errors for ``V = 0`` or ``H = 0`` in the hidden-state functions (...)."""
    hidden, weight, tokens, mask = _hidden_batch()
    old, advantages = torch.zeros(2, 3, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    cases = {
        r"^weight\b": (hidden, torch.zeros(0, 4, dtype=torch.float64)),  # V = 0
        r"^hidden\b": (hidden[..., :0], weight[:, :0]),  # H = 0
    }
    for pattern, (h, w) in cases.items():
        with pytest.raises(ValueError, match=pattern):
            rlo.token_log_probs_from_hidden(h, w, torch.zeros_like(tokens))
        with pytest.raises(ValueError, match=pattern):
            rlo.fused_policy_loss_from_hidden(h, w, torch.zeros_like(tokens), old, advantages, mask)


def test_max_response_length_accepts_a_0d_tensor() -> None:
    """(...) ``max_response_length`` as a 0-d tensor rejected although the conventions allow it
    (...)."""
    for length in (torch.tensor(7), torch.tensor(7.0)):
        for (path, with_tensor), (_, with_int) in zip(
            _max_length_calls(length), _max_length_calls(7), strict=True
        ):
            torch.testing.assert_close(with_tensor(), with_int(), msg=path)


def test_messages_do_not_contradict_themselves() -> None:
    """(...) and messages that contradict themselves ("must be a 0-d real tensor, got
    Tensor(shape=())")."""
    log_probs, old_log_probs, advantages, mask = _policy_batch()
    logits = torch.randn(3, 5, 7, dtype=torch.float64)
    calls = [
        lambda v: rlo.token_entropy(logits, temperature=v),
        lambda v: rlo.policy_loss(
            log_probs, old_log_probs, advantages, mask, surrogate=Clip(low=v)
        ),
        lambda v: rlo.gae(log_probs, old_log_probs, mask, gamma=v, lam=0.9),
        lambda v: rlo.aggregate(log_probs, mask, normalizer=v),
    ]
    for call in calls:
        for value in (torch.tensor(0.5), torch.tensor(True), torch.tensor(0.5 + 0j)):
            try:
                call(value)
            except (TypeError, ValueError) as error:
                assert not CONTRADICTION.search(str(error)), str(error)


# --- the command line and hostile inputs ------------------------------------------------------

_GRPO = {
    "new_log_probs": [[0.4, -0.6], [0.0, 0.0]],
    "old_log_probs": [[0.0, 0.0], [0.0, 0.0]],
    "advantages": [2, -1],
    "token_mask": [[True, True], [True, False]],
    "clip_epsilon": 0.2,
}
_HUGE = "1" + "0" * 400  # 401 digits: beyond int64 and float64


def _grpo_json(**raw: str) -> str:
    text = json.dumps({**_GRPO, **dict.fromkeys(raw, "@")})
    for key, literal in raw.items():
        text = text.replace(f'"{key}": "@"', f'"{key}": {literal}')
    return text


HOSTILE = [
    pytest.param(_grpo_json(advantages=f"[{_HUGE}, -1]"), r"advantages\[0\] is an integer",
                 id="huge-int-in-a-tensor"),
    pytest.param(_grpo_json(clip_epsilon=_HUGE), r"clip_epsilon must be a finite real number",
                 id="huge-int-hyperparameter"),
    pytest.param(_grpo_json(token_mask=f"[[{_HUGE}, 1], [1, 0]]"), r"token_mask\[0\]\[0\]",
                 id="huge-int-in-the-mask"),
    pytest.param('{"new_log_probs": ' + "[" * 1000 + "]" * 1000 + "}",
                 "malformed JSON input: nested too deeply", id="json-1000-levels"),
    pytest.param(_grpo_json(old_log_probs="[" * 300 + "0" + "]" * 300),
                 "old_log_probs is a nested list more than 64 levels deep", id="list-300-levels"),
    pytest.param('{"clip_epsilon": ' + "9" * 5000 + "}", "malformed JSON input: Exceeds the limit",
                 id="int-literal-5000-digits"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "message"), HOSTILE)
def test_cli_hostile_inputs_exit_2_with_one_line(
    text: str, message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """CLI: integers with hundreds of digits, JSON nested a thousand levels deep (...) all end
    in a Python traceback; each must exit 2 with one line on standard error."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert cli_main(["grpo-surrogate"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert re.search(message, captured.err), captured.err


def test_cli_non_utf8_file_and_closed_stdin_exit_2_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """CLI: (...) a non-UTF-8 input file and a closed standard input all end in a Python
    traceback; each must exit 2 with one line on standard error."""
    path = tmp_path / "latin1.json"
    path.write_bytes('{"beta": 0.1, "note": "caf\u00e9"}'.encode("latin-1"))
    assert cli_main(["kl-rewards", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not valid UTF-8: byte 0xe9" in err, err
    for closed in (None, io.StringIO()):
        if closed is not None:
            closed.close()
        monkeypatch.setattr(sys, "stdin", closed)
        assert cli_main(["kl-rewards"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "cannot read standard input" in err, err
    # The real thing: file descriptor 0 closed by the parent shell (``<&-``).
    result = subprocess.run(
        [sys.executable, "-m", "rlobjectives", "kl-rewards"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        stdin=None,
        preexec_fn=lambda: os.close(0),  # the child starts with fd 0 closed
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == "rlobjectives: error: cannot read standard input: it is closed\n"


def _deep(depth: int) -> Any:
    value: Any = 0.0
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("arguments", "pattern"),
    [
        ({"log_probs": [[10**400]]}, r"^log_probs\[0\]\[0\] is an integer of 1329 bits"),
        ({"advantages": [-(10**30), 1.0, 2.0]}, r"^advantages\[0\] is an integer"),
        ({"mask": [[2**63, 1, 1, 1, 1]] * 3}, r"^mask\[0\]\[0\] is an integer"),
        ({"log_probs": _deep(5000)}, r"^log_probs is a nested list more than 64 levels deep"),
        ({"mask": _deep(200)}, r"^mask is a nested list more than 64 levels deep"),
    ],
    ids=["huge-int", "int-beyond-int64", "int-2**63", "5000-levels", "200-levels"],
)
def test_library_overflow_and_recursion_become_named_value_errors(
    arguments: dict[str, Any], pattern: str
) -> None:
    """The library itself raises OverflowError or RecursionError for such inputs: make those
    ValueErrors naming the argument."""
    log_probs, old_log_probs, advantages, mask = _policy_batch()
    valid = {
        "log_probs": log_probs,
        "old_log_probs": old_log_probs,
        "advantages": advantages,
        "mask": mask,
    }
    with pytest.raises(ValueError, match=pattern):
        rlo.policy_loss(**{**valid, **arguments})


def test_huge_integer_hyperparameters_are_named_value_errors() -> None:
    """The library itself raises OverflowError (...) for such inputs: make those ValueErrors
    naming the argument. (Hyperparameters: ``validate_scalar``.)"""
    log_probs, old_log_probs, advantages, mask = _policy_batch()
    with pytest.raises(ValueError, match=r"^Clip.low\b"):
        rlo.policy_loss(log_probs, old_log_probs, advantages, mask, surrogate=Clip(low=10**400))
    with pytest.raises(ValueError, match=r"^beta\b"):
        rlo.kl_penalized_rewards(log_probs, old_log_probs, advantages, mask, 10**400)
