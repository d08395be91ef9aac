"""An elementwise function under ``torch.compile`` when ``RLOBJECTIVES_COMPILE=1`` asks for it.

:func:`compiled` builds ``torch.compile(function, dynamic=True)`` once per function (one graph
family for every shape; the hyperparameters, computed on the host, are constants of the graph)
and falls back to eager for good, with one warning, where no compiler works. An error of the
call itself still raises: the fallback runs the function eagerly first.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["compiled"]

_Function = TypeVar("_Function", bound=Callable[..., Any])

#: The compiled form of each function, built on its first call; ``"failed"``: no compiler.
_COMPILED: dict[str, Any] = {}


def compiled(function: _Function, what: str) -> _Function:
    """``function`` compiled (built on the first call); eager for good if it cannot compile.

    ``what`` names the computation in the warning (``"the policy loss"``).
    """
    built = _COMPILED.get(function.__qualname__)
    if built is None:
        built = _COMPILED[function.__qualname__] = _compiled_or_eager(function, what)
    return built  # type: ignore[return-value]


def _compiled_or_eager(function: Callable[..., Any], what: str) -> Callable[..., Any]:
    graph = torch.compile(function, dynamic=True)

    def call(*args: Any) -> Any:
        if _COMPILED.get("failed") is not None:
            return function(*args)
        try:  # hyperparameters are constants of the graph (thresholds computed on the host)
            with torch._dynamo.config.patch(specialize_float=True):
                return graph(*args)
        except Exception as error:  # no compiler: eager once, and say so once
            result = function(*args)  # an error of the call itself raises here
            _COMPILED["failed"] = function
            warnings.warn(
                f"RLOBJECTIVES_COMPILE=1 but torch.compile failed ({type(error).__name__}: "
                f"{error}); {what} runs eagerly",
                RuntimeWarning,
                stacklevel=3,
            )
            return result

    return call
