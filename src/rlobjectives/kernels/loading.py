"""Which backend runs a call, and loading the Triton kernels (compiled or interpreted).

Rule (read at call time, so tests and users can switch it per call):

- ``RLOBJECTIVES_KERNELS`` unset or ``auto``: CUDA tensors use the Triton kernels when ``triton``
  is importable, everything else the PyTorch path.
- ``RLOBJECTIVES_KERNELS=torch``: always the PyTorch path.
- ``RLOBJECTIVES_KERNELS=triton``: always the Triton kernels; on CPU tensors they run through
  Triton's interpreter (numpy, slow: meant for tests and debugging). Raises when triton is not
  importable.
- In every mode float64 inputs, code being traced by ``torch.compile`` and devices other than
  CUDA and CPU use PyTorch: the kernels compute in float32, their launchers are not traceable,
  and they run compiled on CUDA or interpreted on CPU only.

Interpreter constraint (Triton 3.9): ``@triton.jit`` reads ``TRITON_INTERPRET`` when it
*decorates* a function, not at launch. That holds for our kernels and for ``triton.language``'s
own library functions (``tl.sum``, ``tl.zeros``, ``tl.sigmoid``...), decorated once at
``import triton``. Triton's documented way is therefore to set ``TRITON_INTERPRET=1`` before
anything imports triton (``import torch._dynamo`` does), which would fix the mode for the whole
process. Here both modes coexist instead:

- :func:`kernels` loads the kernel package once per mode: compiled as
  ``rlobjectives.kernels.jit`` (decorated with ``TRITON_INTERPRET=0``) and interpreted as
  the alias ``rlobjectives.kernels._interpreted_jit`` (decorated with
  ``TRITON_INTERPRET=1``); the variable is restored afterwards.
- When triton itself was imported in compiled mode, an interpreted kernel's calls to
  ``triton.language`` library functions reach compiled-mode ``JITFunction`` objects, which refuse
  to run outside a kernel. Each interpreted launch therefore runs with ``JITFunction.__call__``
  routed to Triton's ``InterpretedFunction`` (restored after the launch); nothing is patched
  when triton was imported with ``TRITON_INTERPRET=1``.
- The interpreter patches ``triton.language`` while it runs and does not undo the patches made
  by device-function calls; each interpreted launch records and restores them, so compiled
  kernels can still be compiled afterwards in the same process.

Interpreted kernels are used for CPU tensors, and for every device when ``TRITON_INTERPRET=1``
is set (Triton's own debugging switch; the interpreter copies device tensors to the host).
Interpreted launches are not thread-safe (the interpreter patches ``triton.language`` while it
runs).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import torch

from . import triton_available

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "Backend",
    "interpreted",
    "kernel_backend",
    "kernels",
    "requested_backend",
    "use_kernels",
]

ENV_VAR = "RLOBJECTIVES_KERNELS"
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")
Backend = Literal["triton", "torch"]

_COMPILED = "rlobjectives.kernels.jit"
_INTERPRETED = "rlobjectives.kernels._interpreted_jit"
_KERNEL_DIR = Path(__file__).resolve().parent / "jit"
_LOCK = threading.Lock()
_TRUE = ("1", "true", "on", "yes")
_INTERPRETED_LIBRARY: dict[Any, Any] = {}
_KERNEL_DEVICES = ("cuda", "cpu")  # compiled, interpreted; other devices keep PyTorch


def requested_backend() -> str:
    """The validated value of ``RLOBJECTIVES_KERNELS`` (``"auto"`` when unset or empty).

    Raises:
        ValueError: naming the variable, on any value other than auto, triton or torch.
    """
    value = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(
            f"{ENV_VAR} must be one of {', '.join(BACKENDS)} (or unset), "
            f"got {os.environ.get(ENV_VAR)!r}"
        )
    return value


def kernel_backend(device: torch.device | str, *, dtype: torch.dtype | None = None) -> Backend:
    """``"triton"`` or ``"torch"``: the implementation a call on ``device`` should use.

    Args:
        device: the device of the call's tensors.
        dtype: the computation dtype, if known: float64 always uses ``"torch"``.

    Returns:
        ``"triton"`` or ``"torch"`` (see the module docstring for the rule).

    Raises:
        ValueError: on an invalid ``RLOBJECTIVES_KERNELS``.
        RuntimeError: with ``RLOBJECTIVES_KERNELS=triton`` when triton is not importable.
    """
    if torch.compiler.is_compiling():  # the launchers are not traceable
        return "torch"
    choice = requested_backend()
    kind = torch.device(device).type
    if choice == "torch" or dtype == torch.float64 or kind not in _KERNEL_DEVICES:
        return "torch"
    if choice == "triton":
        if not triton_available():
            raise RuntimeError(
                f"{ENV_VAR}=triton but triton is not importable; install it with "
                '`pip install "rlobjectives[kernels]"` or unset the variable'
            )
        return "triton"
    return "triton" if kind == "cuda" and triton_available() else "torch"


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
    from triton.runtime.interpreter import InterpretedFunction

    for submodule in (module.token_loss, module.kl_rewards, module.scale, module.lm_head):
        for attribute in vars(submodule).values():
            if isinstance(attribute, InterpretedFunction) and not hasattr(attribute, "bridged"):
                attribute.run = _bridged(attribute.run)  # type: ignore[method-assign]
                attribute.bridged = True  # type: ignore[attr-defined]
    return module


def _bridged(run: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an interpreted kernel's ``run`` so that library ``JITFunction`` calls interpret."""
    import numpy

    @functools.wraps(run)
    def bridged_run(*args: Any, **kwargs: Any) -> Any:
        # Lanes outside the data compute log(0), 0/0... and are masked at the store: numpy's
        # warnings about them are noise.
        with _language_restored(), _language_patched_once(), _library_calls_interpreted():
            with _bfloat16_rounded_to_nearest(), numpy.errstate(all="ignore"):
                return run(*args, **kwargs)

    return bridged_run


@contextlib.contextmanager
def _bfloat16_rounded_to_nearest() -> Iterator[None]:
    """Round float32 -> bfloat16 conversions to nearest even, as the GPU (and PyTorch) does.

    Triton 3.9's interpreter truncates the mantissa in ``x.to(tl.bfloat16)`` (its conversion
    drops the low 16 bits), where the compiled kernel's ``cvt.rn.bf16.f32`` rounds to nearest
    even; bf16 outputs would differ by an ulp from the GPU's and from ``tensor.to(bfloat16)``.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return original(self, src, dst_type)
        bits = np.asarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # nearest, ties to even
        quiet = (bits >> 16) | 0x0040  # NaN stays NaN (quiet), whatever its payload
        upper = np.where(np.isnan(src.data), quiet, rounded).astype(np.uint16)
        return interpreter.TensorHandle(upper, dst_type.scalar)

    builder.cast_impl = cast_impl  # type: ignore[method-assign]
    try:
        yield
    finally:
        builder.cast_impl = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _language_patched_once() -> Iterator[None]:
    """Patch each ``triton.language`` module once per interpreted launch, not at every call.

    The interpreter patches ``triton.language`` again at every device-function call (our
    helpers, ``tl.sum``...): an ``inspect.getmembers`` of the language modules, about a
    millisecond each, most of the time of a small launch. Within one launch the patches of a
    module stay in place until the launch ends (they are undone by the launch's scope and by
    :func:`_language_restored`), so patching a module again changes nothing; the first call that
    reaches a module not yet patched (``triton.language.core`` for the library's functions)
    patches it as before.
    """
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang
    languages = (tl, tl.core)
    patched: set[int] = set()
    seen: dict[int, set[int]] = {}  # the language modules of each global namespace

    def patch_lang(fn: Any) -> Any:
        found = seen.get(id(fn.__globals__))
        if found is None:
            found = {id(value) for value in fn.__globals__.values() if inspect.ismodule(value)}
            found &= {id(language) for language in languages}
            seen[id(fn.__globals__)] = found
        if found and found <= patched:
            return interpreter._LangPatchScope()  # nothing to undo
        patched.update(found)
        return original(fn)

    interpreter._patch_lang = patch_lang
    try:
        yield
    finally:
        interpreter._patch_lang = original


@contextlib.contextmanager
def _library_calls_interpreted() -> Iterator[None]:
    """Route ``JITFunction.__call__`` to ``InterpretedFunction`` while an interpreted launch runs.

    Only needed (and only applied) when ``triton.language`` was decorated in compiled mode.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if not isinstance(tl.zeros, JITFunction):
        yield
        return
    original = JITFunction.__call__

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        interpreted = _INTERPRETED_LIBRARY.get(self.fn)
        if interpreted is None:
            interpreted = _INTERPRETED_LIBRARY[self.fn] = InterpretedFunction(self.fn)
        return interpreted(*args, **kwargs)

    JITFunction.__call__ = call  # type: ignore[method-assign]
    try:
        yield
    finally:
        JITFunction.__call__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _language_restored() -> Iterator[None]:
    """Undo every patch Triton's interpreter makes to ``triton.language`` during a launch.

    The interpreter patches ``triton.language`` (builtins, ``tl.tensor`` operators, reductions)
    through ``_LangPatchScope`` objects; the launch restores its own scope, but each device
    function call (``InterpretedFunction.__call__``) opens one that is never restored. Harmless
    when the whole process interprets; here compiled kernels may be compiled later in the same
    process, and a patched ``triton.language`` breaks their compilation. The first original
    value of every attribute patched during the launch is recorded and put back afterwards.
    """
    from triton.runtime import interpreter

    base = interpreter._LangPatchScope
    missing = object()
    originals: dict[tuple[int, str], tuple[object, str, object]] = {}

    class RecordingScope(base):  # type: ignore[misc, valid-type]
        def set_attr(self, obj: object, name: str, value: object) -> None:
            originals.setdefault((id(obj), name), (obj, name, getattr(obj, name, missing)))
            super().set_attr(obj, name, value)

    interpreter._LangPatchScope = RecordingScope
    try:
        yield
    finally:
        interpreter._LangPatchScope = base
        for obj, name, original in originals.values():
            if original is missing:
                if hasattr(obj, name):
                    delattr(obj, name)
            else:
                setattr(obj, name, original)


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


@contextlib.contextmanager
def use_kernels(backend: str) -> Iterator[None]:
    """Set ``RLOBJECTIVES_KERNELS`` to ``backend`` inside the block, restore it afterwards.

    Meant for tests (parametrising a suite over the backends) and benchmarks.

    Raises:
        ValueError: if ``backend`` is not auto, triton or torch.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    previous = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = backend
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = previous
