"""NaN/inf at unselected positions reach no output and no gradient, for every masked function.

Registry-driven (``tests/nan_cases.py``): for each public function taking a mask, hypothesis
draws shapes, a mask (with empty and full rows) and a combination of the function's options;
the entries that must not matter are filled with NaN, +inf, -inf or a mix, and every output
and the gradient of every differentiable input must be bit-identical to those of the same batch
with finite fills. float64 throughout, so "identical" has no tolerance to hide behind.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_flatten

import rlobjectives
from nan_cases import EXEMPT, NAN_CASES, Batch, NanCase

POISONS = ("nan", "inf", "-inf", "mixed")


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    # Tiny tensors gain nothing from intra-op threads, and on a loaded machine a 2-thread
    # log_softmax of a (24, 7) tensor was measured at 20 ms (1 thread: 8 us).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_masked_function_has_a_row() -> None:
    masked = {
        name
        for name in rlobjectives.__all__
        if inspect.isfunction(getattr(rlobjectives, name))
        and any("mask" in p for p in inspect.signature(getattr(rlobjectives, name)).parameters)
    }
    rows = {case.name for case in NAN_CASES} | {exempt.name for exempt in EXEMPT}
    assert masked <= rows, f"add a row to tests/nan_cases.py for {sorted(masked - rows)}"
    for case in NAN_CASES:
        assert case.function is getattr(rlobjectives, case.name)


def _fill(value: torch.Tensor, poison: torch.Tensor, kind: str, seed: int) -> torch.Tensor:
    if kind == "mixed":
        generator = torch.Generator().manual_seed(seed)
        choice = torch.randint(0, 3, value.shape, generator=generator)
        fills = torch.tensor([math.nan, math.inf, -math.inf], dtype=value.dtype)[choice]
    else:
        fills = torch.full_like(value, float(kind))
    return torch.where(poison, fills, value)


def _evaluate(
    case: NanCase, batch: Batch, arguments: dict[str, Any], seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Outputs and the gradients of a fixed random projection of them."""
    inputs = {}
    for name in batch.differentiate:
        inputs[name] = arguments[name].detach().clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rlobjectives.BiasedGradientWarning)
        out = case.function(**{**arguments, **inputs})
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    generator = torch.Generator().manual_seed(seed)
    projection = sum(
        (
            (t * torch.randn(t.shape, generator=generator, dtype=t.dtype)).sum()
            for t in outputs
            if t.requires_grad
        ),
        torch.zeros((), dtype=torch.float64),
    )
    grads: list[torch.Tensor | None] = [None] * len(inputs)
    if projection.requires_grad:
        grads = list(torch.autograd.grad(projection, list(inputs.values()), allow_unused=True))
    return [t.detach() for t in outputs], grads


def _same(actual: torch.Tensor | None, expected: torch.Tensor | None, what: str) -> None:
    if actual is None or expected is None:
        assert actual is None and expected is None, what
        return
    assert torch.isfinite(expected).all() or not torch.isfinite(actual).all(), what
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=False, msg=what)


@pytest.mark.parametrize("case", NAN_CASES, ids=lambda case: case.name)
def test_poison_at_unselected_positions_changes_nothing(case: NanCase) -> None:
    @settings(max_examples=case.max_examples, deadline=None, derandomize=True)
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        batch = case.draw(data.draw)
        kind = data.draw(st.sampled_from(POISONS), label="poison")
        seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
        dirty = dict(batch.arguments)
        for name, poison in batch.poison.items():
            dirty[name] = _fill(batch.arguments[name], poison, kind, seed)
        clean_out, clean_grads = _evaluate(case, batch, batch.arguments, seed)
        dirty_out, dirty_grads = _evaluate(case, batch, dirty, seed)
        assert len(clean_out) == len(dirty_out)
        for i, (actual, expected) in enumerate(zip(dirty_out, clean_out, strict=True)):
            _same(actual, expected, f"{case.name}: output {i} with {kind}")
        for name, actual, expected in zip(
            batch.differentiate, dirty_grads, clean_grads, strict=True
        ):
            _same(actual, expected, f"{case.name}: gradient of {name} with {kind}")

    check()
