"""``RLOBJECTIVES_COMPILE=1``: the elementwise part of the policy loss under ``torch.compile``.

A cold compile costs 10-25 s on CPU: one shape family, few tests (marked ``compile``). The
compiled call equals the eager one (values, gradients, diagnostics), for the library's clip and
for a user's own surrogate; a compiler that fails is replaced by eager for good, with a warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import rlobjectives as rlo
import rlobjectives._core.compiled as compiled_module
from custom_surrogate import TanhSurrogate
from tolerances import assert_close

pytestmark = pytest.mark.compile


def _batch() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 11, generator=g) * 2
    log_probs = old + 0.4 * torch.randn(6, 11, generator=g)
    mask = torch.rand(6, 11, generator=g) < 0.7
    log_probs = torch.where(mask, log_probs, torch.nan)  # NaN where unselected
    return log_probs, old, torch.randn(6, generator=g), mask


@pytest.mark.parametrize(
    "surrogate", [rlo.Clip(low=0.2, high=0.28, dual=3.0), TanhSurrogate()], ids=["clip", "tanh"]
)
def test_compiled_equals_eager(surrogate: rlo.Surrogate, monkeypatch: pytest.MonkeyPatch) -> None:
    log_probs, old, advantages, mask = _batch()
    results = []
    for setting in ("0", "1"):
        monkeypatch.setenv("RLOBJECTIVES_COMPILE", setting)
        leaf = log_probs.clone().requires_grad_(True)
        out = rlo.policy_loss(leaf, old, advantages, mask, surrogate=surrogate,
                              reduction="sequence_mean")  # fmt: skip
        (grad,) = torch.autograd.grad(out.loss, [leaf])
        results.append((out, grad))
    (eager, eager_grad), (compiled, compiled_grad) = results
    assert_close(compiled.loss, eager.loss)
    assert_close(compiled_grad, eager_grad)
    assert torch.isfinite(compiled_grad).all()
    for value, expected in zip(compiled.diagnostics, eager.diagnostics, strict=True):
        assert_close(value, expected)
    assert "policy_terms" in compiled_module._COMPILED  # the compiled function was built and used


def test_a_failing_compiler_falls_back_to_eager_once(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(function: object, **kwargs: object) -> object:
        def call(*args: object) -> object:
            raise RuntimeError("no C++ compiler")

        return call

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(compiled_module, "_COMPILED", {})
    monkeypatch.setenv("RLOBJECTIVES_COMPILE", "1")
    log_probs, old, advantages, mask = _batch()
    with pytest.warns(RuntimeWarning, match="runs eagerly"):
        first = rlo.policy_loss(log_probs, old, advantages, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        second = rlo.policy_loss(log_probs, old, advantages, mask)
    monkeypatch.setenv("RLOBJECTIVES_COMPILE", "0")
    assert torch.equal(first.loss, second.loss)
    assert torch.equal(first.loss, rlo.policy_loss(log_probs, old, advantages, mask).loss)


def test_an_error_of_the_call_itself_still_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(rlo.Surrogate):
        def surrogate(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
            raise ArithmeticError("the user's formula")

    monkeypatch.setenv("RLOBJECTIVES_COMPILE", "1")
    log_probs, old, advantages, mask = _batch()
    with pytest.raises(ArithmeticError, match="the user's formula"):
        rlo.policy_loss(log_probs, old, advantages, mask, surrogate=Broken())


def test_the_variable_is_validated() -> None:
    import os

    os.environ["RLOBJECTIVES_COMPILE"] = "yes"
    try:
        with pytest.raises(ValueError, match="RLOBJECTIVES_COMPILE"):
            rlo.policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2))
    finally:
        del os.environ["RLOBJECTIVES_COMPILE"]
