"""The public API: explicit exports, documented shapes, keyword-only hyperparameters, doctests."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect
import pkgutil

import pytest

import rlobjectives

PUBLIC = [name for name in rlobjectives.__all__ if name != "__version__"]
# The two seed functions take their arguments positionally, as the specification writes them.
SEED_FUNCTIONS = {"grpo_clipped_surrogate", "kl_penalized_rewards"}
# The grouping of the outcome-advantage functions is data, not a hyperparameter: `group_size`
# stays positional (`group_relative_advantages(rewards, 8)`, as since 0.1.0) and defaults to
# None so that `group_relative_advantages(rewards, group_ids=ids)` works.
POSITIONAL_GROUPING = {
    ("group_relative_advantages", "group_size"),
    ("rloo_advantages", "group_size"),
    ("passk_advantages", "group_size"),
    ("opo_advantages", "group_size"),
    ("gdpo_advantages", "group_size"),
    ("maxrl_advantages", "group_size"),
    ("gpg_advantages", "group_size"),
    ("optimal_token_baseline_advantages", "group_size"),
}


def test_all_is_explicit_and_importable() -> None:
    assert len(set(rlobjectives.__all__)) == len(rlobjectives.__all__)
    for name in rlobjectives.__all__:
        assert hasattr(rlobjectives, name), name


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_symbol_is_documented(name: str) -> None:
    obj = getattr(rlobjectives, name)
    doc = inspect.getdoc(obj)
    if doc is None and getattr(obj, "__module__", None) == "typing":
        return  # a type alias such as Reduction
    assert doc, f"{name} has no docstring"
    if inspect.isfunction(obj):
        assert "Args:" in doc and "Returns:" in doc, f"{name} docstring lacks Args/Returns"
        assert any(s in doc for s in ("(B", "(N", "(V", "scalar", "()", "0-d")), name


@pytest.mark.parametrize("name", PUBLIC)
def test_hyperparameters_are_keyword_only(name: str) -> None:
    obj = getattr(rlobjectives, name)
    if not inspect.isfunction(obj) or name in SEED_FUNCTIONS:
        return
    for parameter in inspect.signature(obj).parameters.values():
        if (name, parameter.name) in POSITIONAL_GROUPING:
            assert parameter.default is None
            continue
        if parameter.default is not inspect.Parameter.empty:
            assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, (
                f"{name}({parameter.name}=...) should be keyword-only"
            )


def _modules() -> list[str]:
    names = ["rlobjectives"]
    for info in pkgutil.walk_packages(rlobjectives.__path__, "rlobjectives."):
        if ".demo" in info.name or info.name.endswith("__main__"):
            continue
        if info.name == "rlobjectives.integrations.trl" and not importlib.util.find_spec("trl"):
            continue  # the optional extra is not installed
        if info.name in ("rlobjectives.integrations.verl", "rlobjectives.integrations.openrlhf"):
            continue  # importing them imports the trainer (tests/integrations/ run them)
        names.append(info.name)
    return names


@pytest.mark.parametrize("module_name", _modules())
def test_docstring_examples_run(module_name: str) -> None:
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
