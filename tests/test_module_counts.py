"""How much library code one default call runs: modules and functions (``docs/architecture.md``).

The trace is ``benchmarks/count_modules.py``'s (``sys.setprofile``: the distinct
``rlobjectives.*`` modules and functions whose Python frames run in one forward + backward
after a warm-up). A reader follows a default ``policy_loss`` through at most 6 modules and 40
functions, and ``fused_policy_loss_from_hidden`` through at most 14 modules.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "count_modules.py"
MODULES = {"policy_loss": 6, "fused_policy_loss_from_hidden": 14}
FUNCTIONS = {"policy_loss": 40}


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("count_modules", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(MODULES))
def test_default_call_runs_little_code(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLOBJECTIVES_KERNELS", raising=False)  # the default: auto (CPU: torch)
    monkeypatch.delenv("RLOBJECTIVES_COMPILE", raising=False)
    script = _script()
    seen = script.trace(script.CALLS[name])
    assert len(seen) <= MODULES[name], sorted(seen)
    functions = sum(len(names) for names in seen.values())
    assert functions <= FUNCTIONS.get(name, 10**6), seen
    # the trace sees the library: the public function's module and the surrogate's formula
    assert "rlobjectives.policy.loss" in seen and "rlobjectives.policy.surrogates.clip" in seen


def test_the_kernels_are_not_on_the_default_path() -> None:
    script = _script()
    for call in script.CALLS.values():
        seen = script.trace(call)
        assert not any(module.startswith("rlobjectives.kernels") for module in seen), seen
