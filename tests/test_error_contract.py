"""The error contract of every public function, table-driven from ``tests/cases.py``.

For each row of the registry: the valid arguments work, and each wrong input raises the expected
``ValueError``/``TypeError`` whose message names the argument (never a raw torch error, an
``OverflowError``, a ``RecursionError`` or silence). A meta-test checks that every public
function has a row, so a new function without one fails here.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest

import rlobjectives
import rlobjectives.distributed
from cases import CASES, Case, Wrong


def _public_functions() -> set[str]:
    names = set()
    for module in (rlobjectives, rlobjectives.distributed):
        for name in module.__all__:
            if inspect.isfunction(getattr(module, name)):
                names.add(name)
    return names


def test_every_public_function_has_a_row() -> None:
    rows = [case.name for case in CASES]
    assert len(rows) == len(set(rows)), "one row per function"
    missing = _public_functions() - set(rows)
    assert not missing, f"add a row to tests/cases.py for {sorted(missing)}"
    for case in CASES:
        assert case.function is getattr(rlobjectives, case.name)


def test_every_argument_has_wrong_inputs() -> None:
    # Every parameter of every function is exercised by at least one wrong input, so a new
    # option added without rows fails here.
    for case in CASES:
        parameters = set(inspect.signature(case.function).parameters)
        covered = {wrong.argument for wrong in case.wrong}
        assert covered <= parameters, (case.name, covered - parameters)
        assert parameters <= covered, f"{case.name}: no wrong inputs for {parameters - covered}"


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_valid_arguments_work(case: Case) -> None:
    case.function(**case.valid())


def _rows() -> list[Any]:
    rows = []
    for case in CASES:
        for wrong in case.wrong:
            marks = []
            if wrong.xfail is not None:
                marks.append(pytest.mark.xfail(strict=True, reason=wrong.xfail))
            rows.append(
                pytest.param(
                    case,
                    wrong,
                    id=f"{case.name}-{wrong.argument}-{wrong.kind}-{wrong.label}",
                    marks=marks,
                )
            )
    return rows


@pytest.mark.parametrize(("case", "wrong"), _rows())
def test_wrong_input_raises_a_named_error(case: Case, wrong: Wrong) -> None:
    arguments = case.valid()
    replacement = {wrong.argument: wrong.make(arguments)}
    if wrong.also is not None:
        replacement.update(wrong.also(arguments))
    with pytest.raises(wrong.error) as caught:
        case.function(**{**arguments, **replacement})
    message = str(caught.value)
    assert re.search(wrong.match, message), f"{message!r} does not match {wrong.match!r}"
    assert "\n" not in message.strip(), "one-line messages"
    # Decided for issue 10: a message never contradicts itself.
    assert not re.search(r"0-d real tensor, got Tensor\(shape=\(\)", message), message
