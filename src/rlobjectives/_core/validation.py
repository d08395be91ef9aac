"""Input coercion and boundary validation shared by every public function.

Everything here runs once per call, on shapes, dtypes and Python scalars only: no tensor values
are inspected (no host syncs), so the functions that use these helpers stay traceable by
``torch.compile``. Every error names the argument, what was expected and what was received.

The peers' spellings (aliases, "did you mean" tables, flat surrogate keywords) are tables in
:mod:`rlobjectives._core.spellings`; the walk of a nested list argument is
:mod:`rlobjectives._core.nested`. The functions a default call runs stay here.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist

from .context import ContextGroup
from .nested import nested_shape
from .spellings import (
    ESTIMATOR_HINTS,
    PRESET_TRL,
    PRESET_VERL,
    REDUCTION_ALIASES,
    REDUCTION_HINTS,
    check_surrogate_keywords,
)

__all__ = [
    "BACKENDS",
    "COMPILE_VARIABLE",
    "KERNELS_VARIABLE",
    "ArrayLike",
    "Scalar",
    "as_batch_matrix",
    "as_float_tensor",
    "as_mask",
    "as_per_sequence",
    "as_tensor",
    "as_token_ids",
    "canonical_reduction",
    "check_environment",
    "compile_requested",
    "environment",
    "requested_backend",
    "check_estimator_spelling",
    "check_same_device",
    "check_shape",
    "checks_environment",
    "compute_dtype",
    "describe",
    "expand_per_sequence",
    "scalar_number",
    "validate_bool",
    "validate_choice",
    "validate_context_group",
    "validate_length",
    "validate_scalar",
]


ArrayLike = Any  # torch.Tensor | numpy.ndarray | nested lists/tuples of numbers/bools


Scalar = float | int | torch.Tensor
_Parameters = ParamSpec("_Parameters")
_Result = TypeVar("_Result")


KERNELS_VARIABLE = "RLOBJECTIVES_KERNELS"
COMPILE_VARIABLE = "RLOBJECTIVES_COMPILE"
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")
_COMPILE_VALUES = {"": False, "0": False, "false": False, "1": True, "true": True}


def environment() -> tuple[str, bool]:
    """The validated configuration: ``(RLOBJECTIVES_KERNELS, RLOBJECTIVES_COMPILE)``.

    ``RLOBJECTIVES_KERNELS``: ``auto`` (unset or empty), ``triton`` or ``torch``;
    ``RLOBJECTIVES_COMPILE``: ``1``/``true`` (compile) or ``0``/``false``/unset.

    Raises:
        ValueError: naming the variable, on any other value.
    """
    kernels = os.environ.get(KERNELS_VARIABLE, "").strip().lower() or "auto"
    if kernels not in BACKENDS:
        raise ValueError(
            f"{KERNELS_VARIABLE} must be one of {', '.join(BACKENDS)} (or unset), "
            f"got {os.environ.get(KERNELS_VARIABLE)!r}"
        )
    compiled = os.environ.get(COMPILE_VARIABLE, "").strip().lower()
    if compiled not in _COMPILE_VALUES:
        raise ValueError(
            f"{COMPILE_VARIABLE} must be 1, true, 0, false (or unset), "
            f"got {os.environ.get(COMPILE_VARIABLE)!r}"
        )
    return kernels, _COMPILE_VALUES[compiled]


def requested_backend() -> str:
    """The validated ``RLOBJECTIVES_KERNELS`` (see :func:`environment`)."""
    return environment()[0]


def compile_requested() -> bool:
    """The validated ``RLOBJECTIVES_COMPILE`` (see :func:`environment`)."""
    return environment()[1]


def check_environment() -> None:
    """Validate the configuration read from the environment (:func:`environment`).

    Every public function runs it first, on every call, whatever path the call then takes, so a
    misspelt value is a ``ValueError`` naming the variable at once, never a setting that silently
    applies to some calls only. Skipped while ``torch.compile`` traces.

    Raises:
        ValueError: naming ``RLOBJECTIVES_KERNELS`` (not auto, triton or torch) or
            ``RLOBJECTIVES_COMPILE`` (not 1, true, 0 or false).
    """
    if not torch.compiler.is_compiling():
        environment()


def checks_environment(
    function: Callable[_Parameters, _Result],
) -> Callable[_Parameters, _Result]:
    """Decorator of a public function: :func:`check_environment` before each call.

    A function with a ``surrogate`` parameter also turns a flat surrogate keyword it does not
    take (``clip_low=0.2``) into a ``TypeError`` naming the object field that holds it
    (:func:`check_surrogate_keywords`).
    """
    signature = inspect.signature(function).parameters
    takes_surrogate = "surrogate" in signature and not any(
        parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in signature.values()
    )
    parameters = frozenset(signature)
    name = function.__name__

    @functools.wraps(function)
    def checked(*args: _Parameters.args, **kwargs: _Parameters.kwargs) -> _Result:
        if not torch.compiler.is_compiling():
            environment()  # check_environment, one frame fewer on every call
        if takes_surrogate and kwargs:
            check_surrogate_keywords(name, parameters, kwargs)
        return function(*args, **kwargs)

    return checked


def describe(value: object) -> str:
    """A short description of an argument for error messages (shape/dtype/device of tensors)."""
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device})"
    return type(value).__name__


def as_tensor(value: ArrayLike, name: str, device: torch.device | None = None) -> torch.Tensor:
    """Coerce ``value`` to a tensor without copying tensors and without modifying the input.

    Tensors are returned as they are (their device is checked separately); NumPy arrays and
    nested lists/tuples of numbers or bools are converted on ``device`` (CPU when ``None``).

    Raises:
        TypeError: for non-numeric data (strings, objects, complex numbers) or unsupported types.
        ValueError: for ragged nested lists, lists nested more than 64 levels deep and integers
            outside the int64 range (never ``RecursionError`` or ``OverflowError``).
    """
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise TypeError(f"{name} must be a real tensor, got dtype {value.dtype}")
        return value
    if isinstance(value, (list, tuple)) or (
        isinstance(value, (bool, numbers.Real)) and not isinstance(value, (str, bytes))
    ):
        nested_shape(value, name)
        try:
            return torch.tensor(value, device=device)
        except (TypeError, ValueError, RuntimeError, OverflowError) as error:
            raise TypeError(f"{name} could not be converted to a tensor: {error}") from None
    module = type(value).__module__
    if module == "numpy" or hasattr(value, "__array__"):
        import numpy as np

        array = np.asarray(value)
        if array.dtype.kind not in "biuf":
            raise TypeError(
                f"{name} must be a numeric or bool array, got NumPy dtype {array.dtype}"
            )
        return torch.as_tensor(array.copy(), device=device)
    raise TypeError(
        f"{name} must be a torch.Tensor, a NumPy array or a nested list of numbers, "
        f"got {describe(value)}"
    )


def as_float_tensor(
    value: ArrayLike, name: str, device: torch.device | None = None
) -> torch.Tensor:
    """Like :func:`as_tensor`, but integer/bool data becomes the default float dtype."""
    tensor = as_tensor(value, name, device)
    if not tensor.is_floating_point():
        tensor = tensor.to(torch.get_default_dtype())
    return tensor


def as_mask(value: ArrayLike, name: str, device: torch.device | None = None) -> torch.Tensor:
    """Coerce a mask to bool: any nonzero entry (True, 1, 0.5, ...) selects the token."""
    tensor = as_tensor(value, name, device)
    if tensor.dtype != torch.bool:
        tensor = tensor != 0
    return tensor


def as_batch_matrix(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Check a ``(B, T)`` argument; a plain empty list (shape ``(0,)``) becomes ``(0, 0)``."""
    if tensor.ndim == 1 and tensor.numel() == 0:
        return tensor.reshape(0, 0)
    if tensor.ndim != 2:
        raise ValueError(
            f"{name} must have shape (B, T) (2 dimensions), got shape {tuple(tensor.shape)} "
            f"({tensor.ndim} dimensions)"
        )
    return tensor


def as_token_ids(value: ArrayLike, name: str, device: torch.device | None) -> torch.Tensor:
    """Coerce integer ids (token ids, lengths, indices); floating and bool data is a TypeError."""
    tensor = as_tensor(value, name, device)
    if tensor.is_floating_point() or tensor.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {tensor.dtype}")
    return tensor


def check_shape(tensor: torch.Tensor, name: str, expected: Sequence[int], reference: str) -> None:
    """Raise ``ValueError`` unless ``tensor.shape == expected`` (the shape of ``reference``)."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(
            f"{name} must have the same shape as {reference} {tuple(expected)}, "
            f"got shape {tuple(tensor.shape)}"
        )


def check_same_device(tensors: dict[str, torch.Tensor]) -> torch.device:
    """Raise ``ValueError`` if the tensors are not all on one device; return that device.

    The message blames an argument that is off the majority device (ties: the earlier
    arguments' device wins), and names the first argument on the majority device.
    """
    counts: dict[torch.device, int] = {}  # devices in order of first appearance
    for tensor in tensors.values():
        counts[tensor.device] = counts.get(tensor.device, 0) + 1
    majority = max(counts, key=counts.__getitem__)  # ties: the earlier device (max is stable)
    if len(counts) == 1:
        return majority
    reference = [name for name, tensor in tensors.items() if tensor.device == majority][0]
    for name, tensor in tensors.items():
        if tensor.device != majority:
            raise ValueError(
                f"{name} must be on the same device as {reference} ({majority}), "
                f"got device {tensor.device}"
            )
    return majority


def expand_per_sequence(
    values: torch.Tensor, name: str, batch_shape: tuple[int, int], reference: str
) -> torch.Tensor:
    """Accept ``(B,)``, ``(B, 1)`` or ``(B, T)`` per-sequence/per-token values.

    Returns ``(B, 1)`` for per-sequence values (broadcast over tokens) and ``(B, T)`` as is.
    """
    batch, tokens = batch_shape
    if values.ndim == 1 and values.shape[0] == batch:
        return values.unsqueeze(-1)
    if values.ndim == 2 and values.shape[0] == batch and values.shape[1] in (1, tokens):
        return values
    raise ValueError(
        f"{name} must have shape (B,), (B, 1) or (B, T) with (B, T) = {batch_shape} from "
        f"{reference}, got shape {tuple(values.shape)}"
    )


def as_per_sequence(values: torch.Tensor, name: str, batch: int, reference: str) -> torch.Tensor:
    """Accept ``(B,)`` or ``(B, 1)`` per-sequence values (rewards, scores); return ``(B,)``."""
    if values.ndim == 2 and values.shape[1] == 1:
        values = values.squeeze(-1)
    if values.ndim != 1 or values.shape[0] != batch:
        raise ValueError(
            f"{name} must have shape (B,) = ({batch},) or (B, 1) (one value per sequence of "
            f"{reference}), got shape {tuple(values.shape)}"
        )
    return values


def _scalar_value(value: Scalar, name: str, allow_tensor: bool) -> float | None:
    """The value of a scalar hyperparameter as a float (None while ``torch.compile`` traces)."""
    if isinstance(value, torch.Tensor):
        if not allow_tensor:
            raise TypeError(
                f"{name} must be a real number (a Python number, not a tensor), "
                f"got {describe(value)}"
            )
        if value.ndim != 0 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(
                f"{name} must be a real number or a 0-d real tensor (not bool), "
                f"got {describe(value)}"
            )
        if torch.compiler.is_compiling():
            return None
        if value.device.type == "meta":
            raise ValueError(f"{name} must hold a value, got a tensor on the meta device")
        return float(value.detach().cpu())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {describe(value)} ({value!r})")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got an integer too large for a float") from None


def validate_scalar(
    value: Scalar,
    name: str,
    *,
    minimum: float | None = 0.0,
    strict: bool = False,
    maximum: float | None = None,
    allow_tensor: bool = True,
) -> float | torch.Tensor:
    """Validate a hyperparameter: a real Python number or a 0-d real tensor, finite, in range.

    ``minimum`` is inclusive unless ``strict``; ``maximum`` is exclusive. A 0-d tensor is
    returned as a tensor (so it can be traced); its value is checked on the host except while
    ``torch.compile`` traces, where inspecting it would break the graph.
    """
    number = _scalar_value(value, name, allow_tensor)
    if number is None:
        return value
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number}")
    if minimum is not None and (number <= minimum if strict else number < minimum):
        relation = ">" if strict else ">="
        raise ValueError(f"{name} must be {relation} {minimum}, got {number}")
    if maximum is not None and number >= maximum:
        raise ValueError(f"{name} must be < {maximum}, got {number}")
    return value if isinstance(value, torch.Tensor) else number


def scalar_number(value: float | torch.Tensor) -> float | None:
    """The host value of a validated scalar, for the checks that :func:`validate_scalar` leaves.

    A range a field needs beyond ``validate_scalar``'s (an inclusive upper bound, an order
    between two fields) is checked on this number, so that a 0-d tensor is held to the same
    range as its Python number (``docs/conventions.md``: a 0-d tensor "is checked on the host:
    it must be finite and in range"). A Python number is returned as a float; a 0-d tensor is
    read on the host, except while ``torch.compile`` traces (None: nothing to check there).
    """
    if isinstance(value, torch.Tensor):
        return None if torch.compiler.is_compiling() else float(value.detach().cpu())
    return float(value)


def validate_length(value: Scalar, name: str) -> int | torch.Tensor:
    """Validate a positive integer length: an int (or integral float) or a 0-d tensor holding one.

    Fractional values raise ``ValueError`` (a length such as Dr. GRPO's ``max_response_length``
    is a token count); a 0-d tensor is returned as is (checked except under compile).
    """
    number = _scalar_value(value, name, True)
    if number is None:
        assert isinstance(value, torch.Tensor)  # only a tensor is left unread (under compile)
        return value
    if not (math.isfinite(number) and number >= 1 and number == int(number)):
        raise ValueError(f"{name} must be > 0 and a whole number (a token count), got {number!r}")
    if isinstance(value, torch.Tensor):
        return value
    return int(number)


def validate_bool(value: object, name: str) -> bool:
    """Raise ``TypeError`` unless ``value`` is a Python bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value


def validate_choice(value: object, name: str, choices: Sequence[str]) -> str:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The internal computation dtype: float32, or float64 if any floating input is float64."""
    dtype = torch.float32
    for tensor in tensors:
        if tensor.is_floating_point():
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def canonical_reduction(reduction: object) -> object:
    """``reduction`` with an accepted peer alias rewritten; a hinted peer name raises.

    Raises:
        ValueError: for a peer name of :data:`REDUCTION_HINTS`, with the exact arguments.
    """
    if not isinstance(reduction, str):
        return reduction
    if reduction in REDUCTION_HINTS:
        preset = PRESET_TRL if "-" not in reduction else PRESET_VERL
        raise ValueError(
            f"reduction={reduction!r} is a peer option, not a reduction name; did you mean "
            f"{REDUCTION_HINTS[reduction]}? ({preset.format(name=reduction)})"
        )
    return REDUCTION_ALIASES.get(reduction, reduction)


def check_estimator_spelling(
    estimator: object, known: tuple[str, ...], *, prefix: str = ""
) -> None:
    """Raise a "did you mean" ``ValueError`` for a peer KL estimator name not in ``known``.

    ``prefix`` names the keywords of the caller (``"kl_"`` for ``kl_estimator`` /
    ``kl_straight_through``).

    Raises:
        ValueError: for a name of :data:`ESTIMATOR_HINTS`, with the exact arguments.
    """
    if isinstance(estimator, str) and estimator not in known and estimator in ESTIMATOR_HINTS:
        hint = ESTIMATOR_HINTS[estimator].replace("estimator=", f"{prefix}estimator=")
        hint = hint.replace("straight_through=", f"{prefix}straight_through=")
        raise ValueError(
            f"{prefix}estimator={estimator!r} is verl's spelling; did you mean {hint}?"
        )


def validate_context_group(context_group: object) -> ContextGroup | None:
    """The :class:`ContextGroup` of a public ``context_group=`` argument (None: no group).

    A group of one rank is returned as None (nothing to combine).

    Raises:
        TypeError: ``context_group`` is neither None nor a ``torch.distributed.ProcessGroup``.
        ValueError: no process group is initialised, or this rank is not in ``context_group``
            (including ``GroupMember.NON_GROUP_MEMBER``, what ``new_group`` returns to the ranks
            outside the new group).
    """
    if context_group is None:
        return None
    outside = dist.GroupMember.NON_GROUP_MEMBER  # what new_group returns to the other ranks
    if type(context_group) is type(outside) and context_group == outside:
        raise ValueError(
            f"context_group must contain this rank, got torch.distributed.GroupMember."
            f"NON_GROUP_MEMBER ({outside!r}: new_group's value on a rank outside the group); "
            "call with the group of the ranks that hold this rank's sequences"
        )
    if not isinstance(context_group, dist.ProcessGroup):
        raise TypeError(
            "context_group must be a torch.distributed.ProcessGroup (the ranks that hold parts of "
            f"the same sequences) or None, got {type(context_group).__name__} ({context_group!r})"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "context_group was given but no torch.distributed process group is initialised; "
            "call torch.distributed.init_process_group first, or pass context_group=None for "
            "whole sequences on one process"
        )
    rank = dist.get_rank(context_group)
    if rank < 0:
        raise ValueError(
            f"context_group must contain this rank (global rank {dist.get_rank()}), got a group "
            f"of ranks {dist.get_process_group_ranks(context_group)}"
        )
    size = dist.get_world_size(context_group)
    return None if size == 1 else ContextGroup(context_group, rank, size)
