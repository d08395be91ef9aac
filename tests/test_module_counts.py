"""How many library modules one default call runs (issue 21): at most 8 and 12.

The trace is ``benchmarks/count_modules.py``'s (``sys.setprofile``, the distinct
``rlobjectives.*`` modules whose Python functions run in one forward + backward after a warm-up);
``docs/architecture.md`` gives the command and the counts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "count_modules.py"
LIMITS = {"policy_loss": 8, "fused_policy_loss_from_hidden": 12}


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("count_modules", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_default_call_runs_few_modules(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLOBJECTIVES_KERNELS", raising=False)  # the default: auto (CPU: torch)
    script = _script()
    seen = script.trace(script.CALLS[name])
    assert len(seen) <= LIMITS[name], sorted(seen)
    # the trace sees the library: the public function and its fused path at least
    assert any(module.endswith(".fused") for module in seen), sorted(seen)
    assert "rlobjectives._core.backend" in seen  # the backend is chosen on every call


def test_interpreter_adaptation_is_not_on_the_default_path() -> None:
    script = _script()
    for call in script.CALLS.values():
        seen = script.trace(call)
        assert not any(module.startswith("rlobjectives.kernels") for module in seen), seen
