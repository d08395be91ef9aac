"""Loading the Triton kernels, compiled (CUDA) or through Triton's interpreter (CPU).

:func:`kernels` loads the kernel package :mod:`rlobjectives.kernels.jit` once per mode, on the
first launch: compiled as ``rlobjectives.kernels.jit`` (decorated with ``TRITON_INTERPRET=0``)
and interpreted as the alias ``rlobjectives.kernels._interpreted_jit`` (decorated with
``TRITON_INTERPRET=1``); the variable is restored afterwards. Interpreted kernels are used for
CPU tensors, and for every device when ``TRITON_INTERPRET=1`` is set (Triton's own debugging
switch; the interpreter copies device tensors to the host); their launches go through
:mod:`rlobjectives.kernels.interpreter`, imported only then. Which backend a call uses is
decided by :func:`rlobjectives._core.backend.lm_head_backend`, before anything here runs.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["interpreted", "kernels"]

_COMPILED = "rlobjectives.kernels.jit"
_INTERPRETED = "rlobjectives.kernels._interpreted_jit"
_KERNEL_DIR = Path(__file__).resolve().parent / "jit"
_LOCK = threading.Lock()
_TRUE = ("1", "true", "on", "yes")


def interpreted(device: torch.device | str) -> bool:
    """Whether kernels for ``device`` run through Triton's interpreter.

    True for CPU tensors, and for every device when ``TRITON_INTERPRET`` is set truthy.
    """
    forced = os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE
    return forced or torch.device(device).type == "cpu"


def kernels(device: torch.device | str) -> ModuleType:
    """The kernel package for ``device``, loaded on first use (compiled or interpreted).

    Returns:
        The module ``rlobjectives.kernels.jit`` (compiled) or its interpreted alias; both
        expose the submodules ``token_loss``, ``kl_rewards``, ``scale`` and ``lm_head``.
    """
    name = _INTERPRETED if interpreted(device) else _COMPILED
    module = sys.modules.get(name)
    if module is not None:
        return module
    with _LOCK:
        module = sys.modules.get(name)
        if module is None:
            module = _load(name, interpret=name == _INTERPRETED)
    return module


def _load(name: str, *, interpret: bool) -> ModuleType:
    """Import the kernel package as ``name`` with ``TRITON_INTERPRET`` set for its decoration."""
    with _interpret_mode(interpret):
        if name == _COMPILED:
            return importlib.import_module(name)
        spec = importlib.util.spec_from_file_location(
            name, _KERNEL_DIR / "__init__.py", submodule_search_locations=[str(_KERNEL_DIR)]
        )
        if spec is None or spec.loader is None:  # pragma: no cover - the file is ours
            raise ImportError(f"cannot load the Triton kernels from {_KERNEL_DIR}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
    from . import interpreter  # the interpreter's adaptation, for interpreted launches only

    interpreter.bridge(module)
    return module


@contextlib.contextmanager
def _interpret_mode(flag: bool) -> Iterator[None]:
    """Set ``TRITON_INTERPRET`` (and clear a programmatic override) while decorating kernels."""
    from triton import knobs

    missing = object()
    override = vars(knobs.runtime).pop("interpret", missing)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if flag else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
        if override is not missing:
            vars(knobs.runtime)["interpret"] = override
