"""Triton's interpreter adapted so interpreted and compiled kernels share one process.

Loaded only when an interpreted launch is prepared (:func:`rlobjectives.kernels.loading.kernels`
for a CPU tensor, or with ``TRITON_INTERPRET=1``): nothing else imports it, and nothing here runs
on a compiled launch or on the PyTorch paths. Written against Triton 3.9's interpreter
internals (``interpreter._patch_lang``, ``_LangPatchScope``, ``InterpreterBuilder.cast_impl``,
``JITFunction.__call__``): a new Triton version is adapted here, in one module.

Interpreter constraint: ``@triton.jit`` reads ``TRITON_INTERPRET`` when it *decorates* a
function, not at launch. That holds for our kernels and for ``triton.language``'s own library
functions (``tl.sum``, ``tl.zeros``, ``tl.sigmoid``...), decorated once at ``import triton``.
Triton's documented way is therefore to set ``TRITON_INTERPRET=1`` before anything imports
triton (``import torch._dynamo`` does), which would fix the mode for the whole process. Here
both modes coexist instead (the loader decorates the kernels once per mode), and every
interpreted launch runs inside :func:`bridged`:

- when triton itself was imported in compiled mode, an interpreted kernel's calls to
  ``triton.language`` library functions reach compiled-mode ``JITFunction`` objects, which refuse
  to run outside a kernel: ``JITFunction.__call__`` is routed to Triton's ``InterpretedFunction``
  during the launch (:func:`_library_calls_interpreted`; nothing is patched when triton was
  imported with ``TRITON_INTERPRET=1``);
- the interpreter patches ``triton.language`` while it runs and does not undo the patches made
  by device-function calls: each launch records and restores them (:func:`_language_restored`),
  so compiled kernels can still be compiled afterwards in the same process, and patches each
  language module once per launch instead of at every device-function call
  (:func:`_language_patched_once`);
- float32 -> bfloat16 conversions round to nearest even, as the GPU does
  (:func:`_bfloat16_rounded_to_nearest`).

Interpreted launches are not thread-safe (the interpreter patches ``triton.language`` while it
runs).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

__all__ = ["bridge", "bridged"]

_INTERPRETED_LIBRARY: dict[Any, Any] = {}


def bridge(module: ModuleType) -> None:
    """Wrap the ``run`` of every interpreted kernel of the loaded kernel package (once each)."""
    from triton.runtime.interpreter import InterpretedFunction

    for submodule in (module.lm_head,):
        for attribute in vars(submodule).values():
            if isinstance(attribute, InterpretedFunction) and not hasattr(attribute, "bridged"):
                attribute.run = bridged(attribute.run)  # type: ignore[method-assign]
                attribute.bridged = True  # type: ignore[attr-defined]


def bridged(run: Callable[..., Any]) -> Callable[..., Any]:
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
