"""The error-contract registry: one row per public function (PyTorch ``error_inputs`` style).

Each :class:`Case` says how to build a set of valid arguments and, for every argument, which
wrong inputs to try (wrong shape or rank, wrong dtype or non-numeric data, wrong device through
``meta``, bad values: negative, NaN, infinite, out of range, wrong type), with the exception type
expected and a regular expression that must name the argument. ``tests/test_error_contract.py``
runs the whole table and checks that every public function has a row, so the next function is
covered by adding one row here, and a new option by adding its wrong inputs to its row.

The contract (the brief's "validate once, at the public boundary"): ``ValueError`` or
``TypeError`` whose message *starts* with the argument's name (the subject of the sentence), or
for the first tensor argument (which defines the shape and device the others must match) at
least names it. Rows that fail today carry ``xfail`` with the reason (the issue item).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

import rlobjectives as rlo

B, T, V, H, G = 2, 3, 5, 4, 2
Arguments = dict[str, Any]


@dataclass(frozen=True)
class Wrong:
    """One wrong input: ``argument`` replaced by ``make(valid_arguments)``."""

    argument: str
    kind: str  # "shape", "dtype", "device", "value", "type"
    label: str
    make: Callable[[Arguments], Any]
    error: type[Exception] | tuple[type[Exception], ...]
    match: str
    xfail: str | None = None
    # Other arguments to change consistently (e.g. H = 0 changes ``hidden`` and ``weight``).
    also: Callable[[Arguments], Arguments] | None = None


@dataclass(frozen=True)
class Case:
    """A public function, a builder of valid arguments (by name) and its wrong inputs."""

    name: str
    function: Callable[..., Any]
    valid: Callable[[], Arguments]
    wrong: tuple[Wrong, ...] = field(default_factory=tuple)


# --- messages ---------------------------------------------------------------------------------


def subject(argument: str) -> str:
    """The message starts with the argument (``mask must ...``, ``mask[0] is ...``)."""
    return rf"^{re.escape(argument)}\b"


def mention(argument: str) -> str:
    """The message names the argument somewhere (used for the reference tensor)."""
    return rf"\b{re.escape(argument)}\b"


# --- wrong inputs by kind of argument ---------------------------------------------------------


def zeros(*shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


def tensor_wrongs(
    argument: str,
    *,
    shapes: tuple[tuple[int, ...], ...],
    dtype: torch.dtype = torch.float64,
    reference: bool = False,
    kinds: str = "shape dtype device type",
    xfail: dict[str, str] | None = None,
) -> tuple[Wrong, ...]:
    """Wrong inputs of a tensor argument of ``dtype`` (float, bool mask or int64 ids).

    ``shapes`` are wrong shapes (rank or size) for this argument given the others. For the
    reference argument (the one the others are compared with) the message need only name it.
    """
    named = mention(argument) if reference else subject(argument)
    xfail = xfail or {}
    rows: list[Wrong] = []
    if "shape" in kinds:
        for shape in shapes:
            rows.append(
                Wrong(
                    argument,
                    "shape",
                    f"shape{shape}",
                    lambda a, s=shape: torch.zeros(s, dtype=dtype),
                    ValueError,
                    named,
                    xfail.get(f"shape{shape}", xfail.get("shape")),
                )
            )
    if "dtype" in kinds:
        if dtype == torch.int64:  # token ids / lengths: floats are not indices
            rows.append(
                Wrong(
                    argument,
                    "dtype",
                    "float",
                    lambda a: a[argument].to(torch.float64) + 0.5,
                    TypeError,
                    subject(argument),
                    xfail.get("dtype"),
                )
            )
        else:
            rows.append(
                Wrong(
                    argument,
                    "dtype",
                    "complex",
                    lambda a: torch.as_tensor(a[argument]).to(torch.complex64),
                    TypeError,
                    subject(argument),
                    xfail.get("dtype"),
                )
            )
        rows.append(
            Wrong(
                argument,
                "dtype",
                "strings",
                lambda a: [["x"] * T] * B,
                TypeError,
                subject(argument),
                xfail.get("strings"),
            )
        )
    if "device" in kinds:
        rows.append(
            Wrong(
                argument,
                "device",
                "meta",
                lambda a: torch.as_tensor(a[argument]).to("meta"),
                ValueError,
                named,
                xfail.get("device"),
            )
        )
    if "type" in kinds:
        rows.append(
            Wrong(
                argument,
                "type",
                "str",
                lambda a: "not a tensor",
                TypeError,
                subject(argument),
                xfail.get("type"),
            )
        )
    return tuple(rows)


def scalar_wrongs(
    argument: str,
    *,
    below: float | None,
    above: float | None = None,
    tensors: bool = True,
    xfail: dict[str, str] | None = None,
) -> tuple[Wrong, ...]:
    """Wrong values of a real hyperparameter: out of range, NaN, inf, wrong types.

    ``below``/``above`` are out-of-range values (None: no such bound). ``tensors``: whether a
    0-d tensor is accepted (then 1-d, bool, complex and meta tensors are tried).
    """
    xfail = xfail or {}
    values: list[tuple[str, str, Any, Any]] = [
        ("value", "nan", float("nan"), ValueError),
        ("value", "inf", float("inf"), ValueError),
        ("value", "huge-int", 10**400, ValueError),
        ("type", "str", "0.5", TypeError),
        ("type", "bool", True, TypeError),
        ("type", "list", [0.5], TypeError),
    ]
    if below is not None:
        values.append(("value", f"below({below})", below, ValueError))
    if above is not None:
        values.append(("value", f"above({above})", above, ValueError))
    if tensors:
        # a 0-d tensor is held to the range of its number (checked on the host), or refused
        # where only a Python number is taken: never accepted out of range
        values += [
            (
                "value",
                f"tensor-{label}",
                torch.tensor(float(value), dtype=torch.float64),
                (ValueError, TypeError),
            )
            for kind, label, value, _ in list(values)
            if kind == "value" and label != "huge-int"
        ]
        values += [
            ("type", "tensor-1d", torch.tensor([0.5]), TypeError),
            ("dtype", "tensor-bool", torch.tensor(True), TypeError),
            ("dtype", "tensor-complex", torch.tensor(0.5 + 0j), TypeError),
            ("device", "tensor-meta", torch.tensor(0.5, device="meta"), (TypeError, ValueError)),
        ]
    return tuple(
        Wrong(
            argument,
            kind,
            label,
            lambda a, v=value: v,
            error,
            subject(argument),
            xfail.get(label),
        )
        for kind, label, value, error in values
    )


def int_wrongs(
    argument: str, *, minimum: int, fractional: bool = True, xfail: dict[str, str] | None = None
) -> tuple[Wrong, ...]:
    """Wrong values of an integer option (group size, chunk size, lengths)."""
    xfail = xfail or {}
    values: list[tuple[str, str, Any, type[Exception]]] = [
        ("value", f"below({minimum - 1})", minimum - 1, ValueError),
        ("value", "negative", -3, ValueError),
        ("type", "bool", True, TypeError),
        ("type", "str", "2", TypeError),
    ]
    if fractional:
        values.append(("type", "float", 2.5, TypeError))
    return tuple(
        Wrong(
            argument, kind, label, lambda a, v=value: v, error, subject(argument), xfail.get(label)
        )
        for kind, label, value, error in values
    )


def choice_wrongs(argument: str) -> tuple[Wrong, ...]:
    """An unknown name and a non-string for a ``Literal`` option."""
    return (
        Wrong(
            argument, "value", "unknown", lambda a: "no-such-option", ValueError, subject(argument)
        ),
        Wrong(argument, "type", "int", lambda a: 3, (TypeError, ValueError), subject(argument)),
    )


def flag_wrongs(argument: str, xfail: str | None = None) -> tuple[Wrong, ...]:
    """A bool option given a non-bool (a truthy string must not silently switch it on)."""
    return (Wrong(argument, "type", "str", lambda a: "yes", TypeError, subject(argument), xfail),)


# --- shared argument builders -----------------------------------------------------------------


def per_token() -> torch.Tensor:
    return torch.randn(B, T, dtype=torch.float64)


def token_mask() -> torch.Tensor:
    return torch.tensor([[True, True, False], [True, False, True]])


def logits() -> torch.Tensor:
    return torch.randn(B, T, V, dtype=torch.float64)


def token_ids() -> torch.Tensor:
    return torch.randint(0, V, (B, T))


# Wrong shapes of a (B, T) argument when the first (B, T) argument fixes (B, T).
MATRIX_SHAPES = ((B, T + 1), (B + 1, T), (B, T, 1))
PER_SEQUENCE_SHAPES = ((B + 1,), (B, T + 1), (B, T, 1))


def per_token_wrongs(argument: str, *, reference: bool = False, **kw: Any) -> tuple[Wrong, ...]:
    shapes = ((B, T, 1), (B * T,)) if reference else MATRIX_SHAPES
    return tensor_wrongs(argument, shapes=shapes, reference=reference, **kw)


def mask_wrongs(argument: str = "mask", **kw: Any) -> tuple[Wrong, ...]:
    return tensor_wrongs(argument, shapes=MATRIX_SHAPES, dtype=torch.bool, **kw)


def unbroadcastable_mask() -> tuple[Wrong, ...]:
    """A ``(T,)`` mask for ``(B, T)`` values: broadcastable, yet rejected (the mask must have
    the values' shape, never broadcast silently)."""
    return (
        Wrong(
            "mask",
            "shape",
            "broadcastable",
            lambda a: torch.ones(T, dtype=torch.bool),
            ValueError,
            subject("mask"),
        ),
    )


def reduction_wrongs(*, normalizer: bool = True, max_length: bool = True) -> tuple[Wrong, ...]:
    rows = choice_wrongs("reduction")
    if normalizer:
        rows += scalar_wrongs("normalizer", below=0.0)
    if max_length:
        # A fractional length is a value error (decided for issue 10), not a type error.
        rows += int_wrongs("max_response_length", minimum=1, fractional=False) + (
            Wrong(
                "max_response_length",
                "value",
                "fractional",
                lambda a: 2.5,
                ValueError,
                subject("max_response_length"),
            ),
        )
    return rows


def with_reduction(valid: Callable[[], Arguments]) -> Callable[[], Arguments]:
    """Valid arguments with ``sequence_sum_normalized`` (so ``max_response_length`` is read)."""
    return lambda: {**valid(), "reduction": "sequence_sum_normalized"}


def hyper(argument: str, *, below: float | None, above: float | None = None) -> tuple[Wrong, ...]:
    """A real hyperparameter that accepts 0-d tensors (known failures attached)."""
    return scalar_wrongs(argument, below=below, above=above)


def kept_wrongs(shape: tuple[int, ...] = (B, T), vocab: int = V) -> tuple[Wrong, ...]:
    """Wrong kept sets (``kept_ids``, ``kept_pad``, ``kept_mask``, ``top_k``, ``top_p``) and a
    wrong ``vocab_group``, for a function whose log-probabilities have the leading ``shape``."""
    ids = (*shape, 2)
    long = torch.int64

    def wrong(argument: str, kind: str, label: str, make: Callable[[Arguments], Any],
              error: Any, **kw: Any) -> Wrong:  # fmt: skip
        return Wrong(argument, kind, label, make, error, subject(argument), **kw)

    return (
        wrong("kept_ids", "shape", "no-K", lambda a: torch.zeros(shape, dtype=long), ValueError),
        wrong("kept_ids", "shape", "rows+1",
              lambda a: torch.zeros((shape[0] + 1, *ids[1:]), dtype=long), ValueError),
        wrong("kept_ids", "dtype", "float", lambda a: torch.zeros(ids), TypeError),
        wrong("kept_ids", "dtype", "strings", lambda a: [["x"] * T] * B, TypeError),
        wrong("kept_ids", "device", "meta",
              lambda a: torch.zeros(ids, dtype=long, device="meta"), ValueError),
        wrong("kept_ids", "type", "str", lambda a: "ids", TypeError),
        wrong("kept_ids", "value", "with-top_k", lambda a: torch.zeros(ids, dtype=long),
              ValueError, also=lambda a: {"top_k": 2}),
        wrong("kept_pad", "type", "float", lambda a: 0.5, TypeError),
        wrong("kept_pad", "type", "bool", lambda a: True, TypeError),
        wrong("kept_pad", "type", "str", lambda a: "-1", TypeError),
        wrong("kept_mask", "shape", "V+1",
              lambda a: torch.ones((*shape, vocab + 1), dtype=torch.bool), ValueError),
        wrong("kept_mask", "shape", "no-V", lambda a: torch.ones(shape, dtype=torch.bool),
              ValueError),
        wrong("kept_mask", "dtype", "strings", lambda a: [["x"] * T] * B, TypeError),
        wrong("kept_mask", "device", "meta",
              lambda a: torch.ones((*shape, vocab), dtype=torch.bool, device="meta"), ValueError),
        wrong("kept_mask", "type", "str", lambda a: "mask", TypeError),
        wrong("kept_mask", "value", "with-top_p", lambda a: torch.ones((*shape, vocab),
              dtype=torch.bool), ValueError, also=lambda a: {"top_p": 0.5}),
        wrong("vocab_group", "type", "str", lambda a: "tp", TypeError),
        wrong("vocab_group", "type", "object", lambda a: object(), TypeError),
    ) + int_wrongs("top_k", minimum=1) + scalar_wrongs("top_p", below=0.0, above=1.5,
                                                      tensors=False)  # fmt: skip


def temperature_wrongs() -> tuple[Wrong, ...]:
    """A temperature: a positive number, or a per-token tensor of the call's leading shape."""
    numbers = scalar_wrongs("temperature", below=0.0, tensors=False)
    tensors: list[tuple[str, str, Any, Any]] = [
        ("shape", "tensor-1d", torch.tensor([0.5], dtype=torch.float64), ValueError),
        ("shape", "tensor-rows+1", torch.ones(B + 1, T, dtype=torch.float64), ValueError),
        ("type", "tensor-0d", torch.tensor(0.5, dtype=torch.float64), TypeError),
        ("dtype", "tensor-bool", torch.ones(B, T, dtype=torch.bool), TypeError),
        ("dtype", "tensor-complex", torch.ones(B, T, dtype=torch.complex64), TypeError),
        ("device", "tensor-meta", torch.ones(B, T, device="meta"), ValueError),
    ]
    return numbers + tuple(
        Wrong("temperature", kind, label, lambda a, v=value: v, error, subject("temperature"))
        for kind, label, value, error in tensors
    )


TEMPERATURE = temperature_wrongs()
CHUNK = int_wrongs("chunk_size", minimum=1)
SOFTCAP = scalar_wrongs("final_logit_softcapping", below=0.0, tensors=False)
SCALE = scalar_wrongs("logit_scale", below=None, tensors=False)
MIN_P = scalar_wrongs("min_p", below=-0.1, above=1.5, tensors=False)
FP32_HEAD = flag_wrongs("fp32_head")
HEAD_OPTIONS = SOFTCAP + SCALE
STATISTICS = (
    Wrong("statistics", "type", "str", lambda a: "entropy", TypeError, subject("statistics")),
    Wrong("statistics", "type", "ints", lambda a: (1,), TypeError, subject("statistics")),
    Wrong("statistics", "value", "unknown", lambda a: ("entropy", "variance"), ValueError,
          subject("statistics")),
)  # fmt: skip
VOCAB_GROUP = tuple(w for w in kept_wrongs() if w.argument == "vocab_group")


def policy_options() -> tuple[Wrong, ...]:
    """The options shared by ``policy_loss`` and ``fused_policy_loss_from_hidden``.

    The surrogate's own options are fields of its object, whose rows are the surrogate cases
    below (``Clip``, ``CISPO``, ...); here ``surrogate`` is a name or an object.
    """
    return (
        choice_wrongs("surrogate")
        + (
            Wrong(
                "surrogate", "type", "class", lambda a: rlo.Clip, TypeError, subject("surrogate")
            ),
            Wrong(
                "surrogate", "type", "dict", lambda a: {"low": 0.2}, TypeError, subject("surrogate")
            ),
        )
        + choice_wrongs("ratio_level")
        + hyper("log_ratio_bound", below=0.0)
        + reduction_wrongs()
        + hyper("diagnostics_normalizer", below=0.0)
        + tensor_wrongs("importance_weights", shapes=PER_SEQUENCE_SHAPES)
    )


def field_wrongs(
    cls: type, field: str, *, below: float | None, above: float | None = None
) -> tuple[Wrong, ...]:
    """Wrong values of a surrogate object's field: the message starts with ``Cls.field``."""
    return tuple(
        replace(wrong, match=subject(f"{cls.__name__}.{field}"))
        for wrong in scalar_wrongs(field, below=below, above=above)
    )


#: The surrogate objects' rows: each field's wrong values (the object validates itself).
SURROGATE_CASES: tuple[Case, ...] = (
    Case(
        "Clip",
        rlo.Clip,
        lambda: {"low": 0.2, "high": 0.28, "dual": 3.0, "delta": 1.5},
        field_wrongs(rlo.Clip, "low", below=-0.1, above=1.0)
        + field_wrongs(rlo.Clip, "high", below=-0.1)
        + field_wrongs(rlo.Clip, "dual", below=1.0)
        + field_wrongs(rlo.Clip, "delta", below=1.0),
    ),
    Case(
        "CISPO",
        rlo.CISPO,
        lambda: {"cap": None, "low": 0.2, "high": 0.28},
        field_wrongs(rlo.CISPO, "low", below=-0.1, above=1.0)
        + field_wrongs(rlo.CISPO, "high", below=-0.1)
        + tuple(  # the cap alone (with a band edge it is a wrong combination, see below)
            replace(w, also=lambda a: {"low": None, "high": None})
            for w in field_wrongs(rlo.CISPO, "cap", below=0.0)
        ),
    ),
    Case(
        "SAPO",
        rlo.SAPO,
        lambda: {"temperature_pos": 1.0, "temperature_neg": 1.05},
        field_wrongs(rlo.SAPO, "temperature_pos", below=0.0)
        + field_wrongs(rlo.SAPO, "temperature_neg", below=0.0),
    ),
    Case(
        "GMPO",
        rlo.GMPO,
        lambda: {"low": 0.2, "high": 0.28},
        field_wrongs(rlo.GMPO, "low", below=-0.1, above=1.0)
        + field_wrongs(rlo.GMPO, "high", below=-0.1),
    ),
    Case(
        "VESPO",
        rlo.VESPO,
        lambda: {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0},
        field_wrongs(rlo.VESPO, "k_pos", below=-0.1)
        + field_wrongs(rlo.VESPO, "lambda_pos", below=0.0)
        + field_wrongs(rlo.VESPO, "k_neg", below=-0.1)
        + field_wrongs(rlo.VESPO, "lambda_neg", below=0.0),
    ),
)


def _named(argument: str, message: str, label: str, value: Any, error: Any, **kw: Any) -> Wrong:
    """A wrong value of a surrogate object's field whose message starts with ``message``."""
    return Wrong(argument, "value" if error is ValueError else "type", label, lambda a: value,
                 error, subject(message), **kw)  # fmt: skip


#: Issue 24's objects: DPPO, DRO, M2PO, Clip-Cov, KL-Cov.
OBJECTIVE_CASES: tuple[Case, ...] = (
    Case(
        "DPPO",
        rlo.DPPO,
        lambda: {"divergence": "kl", "low": 0.02, "high": 0.08, "ratio_cap": 3.0},
        field_wrongs(rlo.DPPO, "low", below=-0.1)
        + field_wrongs(rlo.DPPO, "high", below=-0.1)
        + field_wrongs(rlo.DPPO, "ratio_cap", below=0.0)
        + (
            _named("divergence", "DPPO.divergence", "unknown", "js", ValueError),
            _named("divergence", "DPPO.divergence", "int", 1, TypeError),
            # a binary TV threshold above 1 (|p - p_old| <= 1)
            _named(
                "low",
                "DPPO.low",
                "tv-above-1",
                1.5,
                ValueError,
                also=lambda a: {"divergence": "tv"},
            ),
            _named(
                "high",
                "DPPO.high",
                "tv-above-1",
                1.5,
                ValueError,
                also=lambda a: {"divergence": "tv"},
            ),
            # the same ranges for 0-d tensors (checked on the host)
            _named(
                "low",
                "DPPO.low",
                "tv-tensor-above-1",
                torch.tensor(1.5),
                ValueError,
                also=lambda a: {"divergence": "tv"},
            ),
            _named(
                "high",
                "DPPO.high",
                "tv-tensor-above-1",
                torch.tensor(1.5),
                ValueError,
                also=lambda a: {"divergence": "tv"},
            ),
        ),  # fmt: skip
    ),
    Case("DRO", rlo.DRO, lambda: {"beta": 0.5}, field_wrongs(rlo.DRO, "beta", below=0.0)),
    Case(
        "M2PO",
        rlo.M2PO,
        lambda: {"threshold": 0.04, "low": 0.2, "high": 0.28},
        field_wrongs(rlo.M2PO, "threshold", below=0.0)
        + field_wrongs(rlo.M2PO, "low", below=-0.1, above=1.0)
        + field_wrongs(rlo.M2PO, "high", below=-0.1),
    ),
    Case(
        "ClipCov",
        rlo.ClipCov,
        lambda: {
            "ratio": 0.1,
            "low": 0.2,
            "high": 0.28,
            "cov_lb": 1.0,
            "cov_ub": 5.0,
            "generator": torch.Generator().manual_seed(0),
        },  # fmt: skip
        field_wrongs(rlo.ClipCov, "ratio", below=0.0, above=1.5)
        + field_wrongs(rlo.ClipCov, "low", below=-0.1, above=1.0)
        + field_wrongs(rlo.ClipCov, "high", below=-0.1)
        + field_wrongs(rlo.ClipCov, "cov_lb", below=None)
        + field_wrongs(rlo.ClipCov, "cov_ub", below=None)
        + (
            _named("cov_lb", "ClipCov.cov_lb", "above-cov_ub", 6.0, ValueError),
            _named(
                "cov_lb", "ClipCov.cov_lb", "tensor-above-cov_ub", torch.tensor(6.0), ValueError
            ),  # fmt: skip
            _named(
                "cov_ub", "ClipCov.cov_lb", "tensor-below-cov_lb", torch.tensor(0.5), ValueError
            ),  # fmt: skip
            _named("generator", "ClipCov.generator", "int", 0, TypeError),
            _named("selection", "ClipCov.selection", "float", torch.zeros(B, T), TypeError),
        ),
    ),
    Case(
        "KLCov",
        rlo.KLCov,
        lambda: {"ratio": 0.1, "coef": 1.0},
        field_wrongs(rlo.KLCov, "ratio", below=0.0, above=1.5)
        + field_wrongs(rlo.KLCov, "coef", below=-0.1)
        + (_named("selection", "KLCov.selection", "list", [[True]], TypeError),),
    ),
)


#: Issue 35's surrogate objects.
SURROGATE35_CASES: tuple[Case, ...] = (
    Case(
        "ProbabilityBand",
        rlo.ProbabilityBand,
        lambda: {"tau": 0.1, "kappa": 0.01},
        field_wrongs(rlo.ProbabilityBand, "tau", below=-0.1)
        + field_wrongs(rlo.ProbabilityBand, "kappa", below=-0.1)
        + (
            _named("tau", "ProbabilityBand.tau", "above-1", 1.5, ValueError),
            _named("tau", "ProbabilityBand.tau", "tensor-above-1", torch.tensor(1.5), ValueError),
        ),
    ),
    Case(
        "TOPR",
        rlo.TOPR,
        lambda: {
            "rewards": torch.tensor([1.0, 0.0]),
            "positive_weight": 1.0,
            "negative_weight": 0.5,
        },  # fmt: skip
        field_wrongs(rlo.TOPR, "positive_weight", below=-0.1)
        + field_wrongs(rlo.TOPR, "negative_weight", below=-0.1)
        + (
            _named("rewards", "TOPR.rewards", "2d", torch.zeros(2, 2), ValueError),
            _named("rewards", "TOPR.rewards", "0d", torch.tensor(1.0), ValueError),
            _named("rewards", "TOPR.rewards", "str", "1.0", TypeError),
            _named("rewards", "TOPR.rewards", "complex", torch.tensor([1j]), TypeError),
            _named("rewards", "TOPR.rewards", "none", None, TypeError),
        ),
    ),
    Case("REAL", rlo.REAL, lambda: {"tau": 0.5}, field_wrongs(rlo.REAL, "tau", below=0.0)),
    Case(
        "FIPO",
        rlo.FIPO,
        lambda: {
            "gamma": 0.9,
            "cap": 0.2,
            "low": 0.2,
            "high": 0.28,
            "delta": 1.5,
            "cap_high_only": False,
            "safety_threshold": 4.0,
        },  # fmt: skip
        field_wrongs(rlo.FIPO, "gamma", below=-0.1)
        + field_wrongs(rlo.FIPO, "cap", below=-0.1)
        + field_wrongs(rlo.FIPO, "low", below=-0.1, above=1.0)
        + field_wrongs(rlo.FIPO, "high", below=-0.1)
        + field_wrongs(rlo.FIPO, "delta", below=1.0)
        + field_wrongs(rlo.FIPO, "safety_threshold", below=0.0)
        + (
            _named("gamma", "FIPO.gamma", "above-1", 1.5, ValueError),
            _named("gamma", "FIPO.gamma", "tensor-above-1", torch.tensor(1.5), ValueError),
            _named("cap_high_only", "FIPO.cap_high_only", "int", 1, TypeError),
            _named("cap_high_only", "FIPO.cap_high_only", "str", "yes", TypeError),
        ),
    ),
)


def _cov_arguments() -> Arguments:
    return {
        "log_probs": per_token(),
        "old_log_probs": per_token(),
        "advantages": torch.randn(B, dtype=torch.float64),
        "mask": token_mask(),
        "surrogate": rlo.KLCov(ratio=0.5),
    }


COV_SELECTION_WRONGS = (
    per_token_wrongs("log_probs", reference=True)
    + per_token_wrongs("old_log_probs")
    + tensor_wrongs("advantages", shapes=PER_SEQUENCE_SHAPES)
    + mask_wrongs()
    + choice_wrongs("surrogate")
    + (Wrong("surrogate", "type", "Clip", lambda a: rlo.Clip(), TypeError, subject("surrogate")),)
    + hyper("log_ratio_bound", below=0.0)
)
M2PO_MASK_WRONGS = (
    per_token_wrongs("log_ratio", reference=True)
    + mask_wrongs()
    + scalar_wrongs("threshold", below=0.0)
)
GROUP_WRONGS = (
    Wrong("group", "type", "str", lambda a: "x", (TypeError, ValueError), subject("group")),
)

ENTROPY_MASK_WRONGS = (
    per_token_wrongs("entropy", reference=True)
    + mask_wrongs()
    + scalar_wrongs("quantile", below=-0.1, above=1.5)  # a Python number in [0, 1]
)

# --- the registry: one row per public function ------------------------------------------------


def _policy_arguments() -> Arguments:
    return {
        "log_probs": per_token(),
        "old_log_probs": per_token(),
        "advantages": torch.randn(B, dtype=torch.float64),
        "mask": token_mask(),
        "reduction": "sequence_sum_normalized",
        "importance_weights": per_token().abs(),
        "entropy": per_token().abs(),
        "entropy_coef": 0.01,
    }


def _hidden_arguments() -> Arguments:
    return {
        "hidden": torch.randn(B, T, H, dtype=torch.float64),
        "weight": torch.randn(V, H, dtype=torch.float64),
        "tokens": token_ids(),
        "bias": torch.randn(V, dtype=torch.float64),
    }


def _fused_hidden_arguments() -> Arguments:
    return {
        **_hidden_arguments(),
        "old_log_probs": per_token(),
        "advantages": torch.randn(B, dtype=torch.float64),
        "mask": token_mask(),
        "ref_log_probs": per_token(),
        "kl_coef": 0.1,
        "kl_estimator": "k2",
        "reduction": "sequence_sum_normalized",
        "importance_weights": per_token().abs(),
    }


def _zero_vocabulary(a: Arguments) -> Arguments:
    return {
        "bias": torch.zeros(0, dtype=torch.float64),
        "tokens": torch.zeros(B, T, dtype=torch.int64),
    }


def _zero_hidden(a: Arguments) -> Arguments:
    return {"weight": torch.zeros(V, 0, dtype=torch.float64)}


HIDDEN_WRONGS = (
    tensor_wrongs("hidden", shapes=((B, T), (B, T, H + 1)), reference=True)
    + tensor_wrongs("weight", shapes=((V, H + 1), (V,)))
    + tensor_wrongs("tokens", shapes=MATRIX_SHAPES, dtype=torch.int64)
    + tensor_wrongs("bias", shapes=((V + 1,), (V, 1)))
    + TEMPERATURE
    + CHUNK
    + (
        Wrong(
            "weight",
            "shape",
            "V=0",
            lambda a: torch.zeros(0, H, dtype=torch.float64),
            ValueError,
            subject("weight"),
            also=_zero_vocabulary,
        ),
        Wrong(
            "hidden",
            "shape",
            "H=0",
            lambda a: torch.zeros(B, T, 0, dtype=torch.float64),
            ValueError,
            subject("hidden"),
            also=_zero_hidden,
        ),
    )
)


def _alignment_arguments() -> Arguments:
    # Right-padded rows of length L = 4: prompt 2 tokens, response 2 and 1 tokens.
    return {
        "input_ids": torch.tensor([[1, 2, 3, 4], [1, 2, 3, 0]]),
        "prompt_lengths": torch.tensor([2, 2]),
        "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
        "response_length": 2,
    }


def _start_instead(a: Arguments) -> Arguments:
    """Give ``response_start`` instead of ``prompt_lengths`` (exactly one of them)."""
    return {"prompt_lengths": None}


def _start(label: str, kind: str, value: Any, error: Any) -> Wrong:
    return Wrong(
        "response_start",
        kind,
        label,
        lambda a: value,
        error,
        subject("response_start"),
        also=_start_instead,
    )


RESPONSE_START = (
    _start("zero", "value", 0, ValueError),
    _start("beyond-row", "value", torch.tensor([2, 5]), ValueError),
    _start("float", "type", 2.5, TypeError),
    _start("bool", "type", True, TypeError),
    _start("str", "type", "2", TypeError),
    _start("shape(3,)", "shape", torch.tensor([2, 2, 2]), ValueError),
    _start("meta", "device", torch.tensor([2, 2], device="meta"), ValueError),
    # Both or neither of prompt_lengths and response_start.
    Wrong("response_start", "value", "with-prompt_lengths", lambda a: 2, ValueError,
          mention("response_start")),
    Wrong("prompt_lengths", "value", "neither", lambda a: None, ValueError,
          mention("prompt_lengths")),
)  # fmt: skip

ALIGNMENT_WRONGS = RESPONSE_START + (
    tensor_wrongs("input_ids", shapes=((B, 4, 1), (B * 4,)), dtype=torch.int64, reference=True)
    + tensor_wrongs("prompt_lengths", shapes=((B + 1,), (B, 1, 1)), dtype=torch.int64)
    + tensor_wrongs("attention_mask", shapes=((B, 5), (B + 1, 4), (B, 4, 1)), dtype=torch.bool)
    + int_wrongs("response_length", minimum=1)
    + flag_wrongs("check_layout")
    + (
        Wrong(
            "prompt_lengths",
            "value",
            "zero",
            lambda a: torch.tensor([0, 2]),
            ValueError,
            subject("prompt_lengths"),
        ),
        Wrong(
            "prompt_lengths",
            "value",
            "beyond-row",
            lambda a: torch.tensor([2, 5]),
            ValueError,
            subject("prompt_lengths"),
        ),
    )
)


def group_ids_wrongs(*, size_argument: str | None = "group_size") -> tuple[Wrong, ...]:
    """``group_ids`` (one label per sequence) instead of ``group_size``: wrong length, rank,
    and both given."""

    def instead(a: Arguments) -> Arguments:
        return {size_argument: None} if size_argument else {}

    rows = (
        Wrong(
            "group_ids",
            "shape",
            "one-too-many",
            lambda a: list(range(B * G + 1)),
            ValueError,
            subject("group_ids"),
            also=instead,
        ),
        Wrong(
            "group_ids",
            "shape",
            "2-d",
            lambda a: torch.zeros(B * G, 2, dtype=torch.int64),
            ValueError,
            subject("group_ids"),
            also=instead,
        ),
    )
    if size_argument:
        rows += (
            Wrong(
                "group_ids",
                "value",
                f"with-{size_argument}",
                lambda a: list(range(B * G)),
                ValueError,
                mention("group_ids"),
            ),
        )
    return rows  # fmt: skip


def prompt_group_wrongs() -> tuple[Wrong, ...]:
    """``"prompt_mean"``'s groups on a ``(B, T)`` reduction: ``group_size`` (contiguous) or
    ``group_ids`` (one label per sequence), and ``"prompt_mean"`` without either."""

    def wrong(argument: str, kind: str, label: str, value: Any, error: Any, **kw: Any) -> Wrong:
        return Wrong(argument, kind, label, lambda a, v=value: v, error, subject(argument), **kw)

    return int_wrongs("group_size", minimum=1) + (
        wrong("group_size", "value", "not-dividing", B + 1, ValueError),
        wrong("group_ids", "shape", "one-too-many", list(range(B + 1)), ValueError),
        wrong("group_ids", "shape", "2-d", torch.zeros(B, 2, dtype=torch.int64), ValueError),
        wrong("group_ids", "dtype", "float", torch.zeros(B), TypeError),
        wrong("group_ids", "dtype", "float-label", [0.5, 1.5], TypeError),
        wrong("group_ids", "device", "meta", torch.zeros(B, dtype=torch.int64, device="meta"),
              ValueError),
        wrong("group_ids", "type", "str", "ab", TypeError),
        Wrong("group_ids", "value", "with-group_size", lambda a: [0, 0], ValueError,
              mention("group_ids"), also=lambda a: {"group_size": 1}),
        wrong("reduction", "value", "prompt_mean-without-groups", "prompt_mean", ValueError),
    )  # fmt: skip


def _group_arguments() -> Arguments:
    return {"rewards": torch.randn(B * G, dtype=torch.float64), "group_size": G}


# --- the packed layout (issue 15): cu_seqlens wherever a function takes it ---------------------


def _packed(length: int, rows: int = B) -> Callable[[Arguments], Arguments]:
    """The valid arguments in the packed layout: ``(B, L, ...)`` tensors flattened to ``(B L,)``.

    Each row becomes a sequence, so the valid boundaries are ``[0, L, 2 L, ...]`` (``S = B``).
    """

    def also(a: Arguments) -> Arguments:
        out: Arguments = {}
        for name, value in a.items():
            if (
                isinstance(value, torch.Tensor)
                and value.ndim >= 2
                and value.shape[:2] == (rows, length)
            ):
                out[name] = value.reshape(rows * length, *value.shape[2:])
        if "response_length" in a:
            out["response_length"] = None
        if "masks" in a:
            out["masks"] = [mask.reshape(-1) for mask in a["masks"]]
        return out

    return also


def context_group_wrongs() -> tuple[Wrong, ...]:
    """``context_group=`` given something that is not a process group (TypeError naming it).

    A real group needs initialised processes: its value errors (this rank outside the group,
    a data-parallel group that overlaps it) are tested with real ranks in
    ``tests/distributed/test_context_parallel.py``.
    """
    return tuple(
        Wrong(
            "context_group",
            "type",
            label,
            lambda a, v=value: v,
            TypeError,
            subject("context_group"),
        )
        for label, value in (("str", "cp"), ("int", 0), ("ranks", [0, 1]))
    )


def cu_seqlens_wrongs(length: int = T, *, rows: int = B, listed: bool = False) -> tuple[Wrong, ...]:
    """Malformed ``cu_seqlens`` for valid packed ``(B L,)`` arguments: each a named ValueError.

    ``listed``: the argument is a list with one ``cu_seqlens`` per mask (global_normalizers).
    """
    n = rows * length
    values: list[tuple[str, str, Any, Any]] = [
        ("value", "decreasing", torch.tensor([0, n - 1, 1, n]), ValueError),
        ("value", "not-from-0", torch.tensor([1, length, n]), ValueError),
        ("value", "not-to-N", torch.tensor([0, length, n - 1]), ValueError),
        ("dtype", "float", torch.tensor([0.0, length, n]), ValueError),
        ("dtype", "bool", torch.tensor([False, True, True]), ValueError),
        ("shape", "2-d", torch.tensor([[0, length, n]]), ValueError),
        ("shape", "empty", torch.zeros(0, dtype=torch.int64), ValueError),
        ("device", "meta", torch.tensor([0, length, n], device="meta"), ValueError),
        ("type", "str", "x", (TypeError, ValueError)),
    ]
    rows = tuple(
        Wrong(
            "cu_seqlens",
            kind,
            label,
            (lambda a, v=value: [v, v]) if listed else (lambda a, v=value: v),
            error,
            subject("cu_seqlens"),
            also=_packed(length, rows),
        )
        for kind, label, value, error in values
    )
    if listed:  # one entry per mask
        rows += (
            Wrong(
                "cu_seqlens",
                "shape",
                "one-for-two-masks",
                lambda a: [torch.tensor([0, length, n])],
                ValueError,
                subject("cu_seqlens"),
                also=_packed(length, rows),
            ),
        )
    return rows


PACKING_CASES: tuple[Case, ...] = (
    Case(
        "pack",
        rlo.pack,
        lambda: {"values": per_token(), "attention_mask": token_mask()},
        tensor_wrongs("values", shapes=((B * T,),), reference=True)
        + mask_wrongs("attention_mask"),
    ),
    Case(
        "unpack",
        rlo.unpack,
        lambda: {
            "values": torch.randn(6, dtype=torch.float64),
            "cu_seqlens": torch.tensor([0, 2, 6]),
            "length": 5,
            "padding_side": "left",
            "padding_value": 0.0,
        },
        tensor_wrongs("values", shapes=((),), reference=True, kinds="shape dtype type")
        + tuple(replace(wrong, also=None) for wrong in cu_seqlens_wrongs(3))
        + int_wrongs("length", minimum=4)
        + choice_wrongs("padding_side")
        + (
            Wrong("padding_value", "type", "str", lambda a: "0", TypeError,
                  subject("padding_value")),
            Wrong("padding_value", "type", "list", lambda a: [0.0], TypeError,
                  subject("padding_value")),
        ),
    ),
)  # fmt: skip


# --- issue 25: distillation losses and the 2026 advantages ------------------------------------

K = 2  # teacher top-k slots


def _teacher_slots() -> Arguments:
    return {
        "teacher_log_probs": torch.log_softmax(torch.randn(B, T, K, dtype=torch.float64), -1) - 0.5,
        "teacher_ids": torch.randint(0, V, (B, T, K)),
    }


def _head_arguments() -> Arguments:
    """A student head on the 1/8 grid (its float32 product is exact: the mixed-dtype rows)."""
    return {
        "hidden": torch.round(torch.randn(B, T, H, dtype=torch.float64) * 8) / 8,
        "weight": torch.round(torch.randn(V, H, dtype=torch.float64) * 8) / 8,
        "bias": torch.round(torch.randn(V, dtype=torch.float64) * 8) / 8,
    }


def _no_vocabulary(a: Arguments) -> Arguments:
    return {"bias": torch.zeros(0, dtype=torch.float64)}


#: The LM head's wrong inputs for the functions that read no sampled token (no ``tokens``).
HEAD_WRONGS = (
    tensor_wrongs("hidden", shapes=((B, T), (B, T, H + 1)), reference=True)
    + tensor_wrongs("weight", shapes=((V, H + 1), (V,)))
    + tensor_wrongs("bias", shapes=((V + 1,), (V, 1)))
    + TEMPERATURE
    + CHUNK
    + (
        Wrong("weight", "shape", "V=0", lambda a: torch.zeros(0, H, dtype=torch.float64),
              ValueError, subject("weight"), also=_no_vocabulary),
        Wrong("hidden", "shape", "H=0", lambda a: torch.zeros(B, T, 0, dtype=torch.float64),
              ValueError, subject("hidden"), also=_zero_hidden),
    )
)  # fmt: skip

SLOT_WRONGS = tensor_wrongs(
    "teacher_log_probs", shapes=((B, T), (B, T + 1, K), (B, T, 0))
) + tensor_wrongs("teacher_ids", shapes=((B, T), (B, T, K + 1)), dtype=torch.int64)

TOPK_OPTIONS = flag_wrongs("tail") + flag_wrongs("renormalize") + reduction_wrongs()


def _reverse_arguments() -> Arguments:
    return {
        "tokens": token_ids(),
        "teacher_log_probs": -per_token().abs(),
        "mask": token_mask(),
        "estimator": "k2",
        "reduction": "sequence_sum_normalized",
    }


REVERSE_WRONGS = (
    tensor_wrongs("tokens", shapes=MATRIX_SHAPES, dtype=torch.int64)
    + per_token_wrongs("teacher_log_probs")
    + mask_wrongs()
    + choice_wrongs("estimator")
    + flag_wrongs("straight_through")
    + hyper("log_ratio_bound", below=0.0)
    + reduction_wrongs()
    + cu_seqlens_wrongs()
)

BETA = scalar_wrongs("beta", below=-0.1, above=1.5, tensors=False)


def _teacher_head() -> Arguments:
    return {
        "teacher_hidden": torch.round(torch.randn(B, T, 2, dtype=torch.float64) * 8) / 8,
        "teacher_weight": torch.round(torch.randn(V, 2, dtype=torch.float64) * 8) / 8,
        "teacher_bias": torch.round(torch.randn(V, dtype=torch.float64) * 8) / 8,
    }


def lambda_wrongs(argument: str) -> tuple[Wrong, ...]:
    """A GAE lambda: a number in [0, 1], or a floating tensor of one value per sequence."""
    values: list[tuple[str, str, Any, Any]] = [
        ("value", "nan", float("nan"), ValueError),
        ("value", "inf", float("inf"), ValueError),
        ("value", "huge-int", 10**400, ValueError),
        ("value", "below(-0.1)", -0.1, ValueError),
        ("value", "above(1.5)", 1.5, ValueError),
        ("type", "str", "0.5", TypeError),
        ("type", "bool", True, TypeError),
        ("shape", "list-of-one", [0.5], ValueError),
        ("shape", "tensor-0d", torch.tensor(0.5, dtype=torch.float64), ValueError),
        ("shape", "per-token", torch.full((B, T), 0.5, dtype=torch.float64), ValueError),
        ("dtype", "tensor-int", torch.ones(B, dtype=torch.int64), TypeError),
        ("dtype", "tensor-bool", torch.tensor(True), TypeError),
        ("dtype", "tensor-complex", torch.full((B,), 0.5 + 0j), TypeError),
        ("device", "tensor-meta", torch.full((B,), 0.5, device="meta"), ValueError),
    ]
    return tuple(
        Wrong(argument, kind, label, lambda a, v=value: v, error, subject(argument))
        for kind, label, value, error in values
    )


def length_wrongs() -> tuple[Wrong, ...]:
    return tensor_wrongs("lengths", shapes=((B, T), ()), kinds="shape dtype type") + (
        Wrong("lengths", "dtype", "bool", lambda a: torch.ones(B, dtype=torch.bool), TypeError,
              subject("lengths")),
    )  # fmt: skip


ISSUE25_CASES: tuple[Case, ...] = (
    Case(
        "topk_forward_kl",
        rlo.topk_forward_kl,
        lambda: {"logits": logits(), **_teacher_slots(), "mask": token_mask(),
                 "reduction": "sequence_sum_normalized"},
        tensor_wrongs("logits", shapes=((B, T), (B, T, V, 1)), reference=True)
        + SLOT_WRONGS + mask_wrongs() + TOPK_OPTIONS + TEMPERATURE + CHUNK + cu_seqlens_wrongs(),
    ),
    Case(
        "topk_forward_kl_from_hidden",
        rlo.topk_forward_kl_from_hidden,
        lambda: {**_head_arguments(), **_teacher_slots(), "mask": token_mask(),
                 "reduction": "sequence_sum_normalized"},
        HEAD_WRONGS + SLOT_WRONGS + mask_wrongs() + TOPK_OPTIONS + cu_seqlens_wrongs()
        + HEAD_OPTIONS + FP32_HEAD,
    ),
    Case(
        "reverse_kl_loss",
        rlo.reverse_kl_loss,
        lambda: {"logits": logits(), **_reverse_arguments()},
        tensor_wrongs("logits", shapes=((B, T), (B, T, V, 1)), reference=True)
        + REVERSE_WRONGS + TEMPERATURE + CHUNK,
    ),
    Case(
        "reverse_kl_loss_from_hidden",
        rlo.reverse_kl_loss_from_hidden,
        lambda: {**_head_arguments(), **_reverse_arguments()},
        HIDDEN_WRONGS + REVERSE_WRONGS[len(tensor_wrongs("tokens", shapes=MATRIX_SHAPES,
                                                          dtype=torch.int64)):]
        + HEAD_OPTIONS + FP32_HEAD,
    ),
    Case(
        "reverse_kl_rewards",
        rlo.reverse_kl_rewards,
        lambda: {"log_probs": -per_token().abs(), "teacher_log_probs": -per_token().abs(),
                 "mask": token_mask(), "coef": 0.5},
        per_token_wrongs("log_probs", reference=True)
        + per_token_wrongs("teacher_log_probs")
        + mask_wrongs()
        + hyper("coef", below=-0.1)
        + choice_wrongs("estimator")
        + hyper("log_ratio_bound", below=0.0)
        + cu_seqlens_wrongs(),
    ),
    Case(
        "generalized_jsd_loss",
        rlo.generalized_jsd_loss,
        lambda: {"logits": logits(), "teacher_logits": logits(), "mask": token_mask(),
                 "beta": 0.3, "reduction": "sequence_sum_normalized"},
        tensor_wrongs("logits", shapes=((B, T), (B, T, V, 1)), reference=True)
        + tensor_wrongs("teacher_logits", shapes=((B, T, V + 1), (B, T + 1, V), (B, T)))
        + mask_wrongs() + BETA + TEMPERATURE + reduction_wrongs() + CHUNK + cu_seqlens_wrongs(),
    ),
    Case(
        "generalized_jsd_loss_from_hidden",
        rlo.generalized_jsd_loss_from_hidden,
        lambda: {**_head_arguments(), **_teacher_head(), "mask": token_mask(), "beta": 0.3,
                 "reduction": "sequence_sum_normalized"},
        HEAD_WRONGS
        + tensor_wrongs("teacher_hidden", shapes=((B, T), (B, T + 1, 2)))
        + tensor_wrongs("teacher_weight", shapes=((V, 3), (V,), (V + 1, 2)))
        + tensor_wrongs("teacher_bias", shapes=((V + 1,), (V, 1)))
        + mask_wrongs() + BETA + reduction_wrongs() + cu_seqlens_wrongs() + HEAD_OPTIONS
        + FP32_HEAD + scalar_wrongs("teacher_final_logit_softcapping", below=0.0, tensors=False)
        + scalar_wrongs("teacher_logit_scale", below=None, tensors=False),
    ),
    Case(
        "gdpo_advantages",
        rlo.gdpo_advantages,
        lambda: {"rewards": torch.randn(B * G, 2, dtype=torch.float64), "group_size": G,
                 "weights": torch.tensor([1.0, 0.5], dtype=torch.float64)},
        tensor_wrongs("rewards", shapes=((B * G, 2, 1), (B * G, 0)), reference=True,
                      kinds="shape dtype type")
        + int_wrongs("group_size", minimum=1)
        + group_ids_wrongs()
        + tensor_wrongs("weights", shapes=((3,), (2, 1)))
        + hyper("eps", below=-0.1)
        + flag_wrongs("whiten"),
    ),
    Case(
        "maxrl_advantages",
        rlo.maxrl_advantages,
        lambda: {"rewards": torch.rand(B * G, dtype=torch.float64), "group_size": G, "eps": 1e-6},
        tensor_wrongs("rewards", shapes=((B * G, 1, 1),), reference=True, kinds="shape dtype type")
        + int_wrongs("group_size", minimum=1)
        + group_ids_wrongs()
        + hyper("eps", below=-0.1),
    ),
    Case(
        "iw_opd_advantages",
        rlo.iw_opd_advantages,
        lambda: {"teacher_log_probs": -per_token().abs(), "rollout_log_probs": -per_token().abs(),
                 "mask": token_mask(), "gamma": 0.5, "eps": 1e-6},
        per_token_wrongs("teacher_log_probs", reference=True)
        + per_token_wrongs("rollout_log_probs")
        + mask_wrongs()
        + hyper("gamma", below=-0.1)
        + hyper("eps", below=0.0)
        + cu_seqlens_wrongs(),
    ),
    Case(
        "gpg_advantages",
        rlo.gpg_advantages,
        lambda: {"rewards": torch.rand(B * G, dtype=torch.float64), "group_size": G,
                 "f_norm": 0.5},
        tensor_wrongs("rewards", shapes=((B * G, 1),), reference=True, kinds="shape dtype type")
        + int_wrongs("group_size", minimum=1)
        + group_ids_wrongs()
        + hyper("f_norm", below=0.0),
    ),
    Case(
        "optimal_token_baseline_advantages",
        rlo.optimal_token_baseline_advantages,
        lambda: {"rewards": torch.randn(B * G, T, dtype=torch.float64),
                 "mask": torch.rand(B * G, T) < 0.8,
                 "old_log_probs": -torch.rand(B * G, T, dtype=torch.float64),
                 "log_sum_sq_probs": -torch.rand(B * G, T, dtype=torch.float64),
                 "group_size": G,
                 "importance_weights": torch.rand(B * G, T, dtype=torch.float64)},
        tensor_wrongs("rewards", shapes=((B * G,), (B * G, T, 1)), reference=True)
        + tensor_wrongs("mask", shapes=((B * G, T + 1), (B * G + 1, T)), dtype=torch.bool)
        + tensor_wrongs("old_log_probs", shapes=((B * G, T + 1), (B * G + 1, T)))
        + tensor_wrongs("log_sum_sq_probs", shapes=((B * G, T + 1), (B * G + 1, T)))
        + tensor_wrongs("importance_weights", shapes=((B * G, T + 1), (B * G,)))
        + int_wrongs("group_size", minimum=1)
        + group_ids_wrongs()
        + choice_wrongs("alignment")
        + flag_wrongs("handle_zero_tail")
        + hyper("eps", below=-0.1),
    ),
    Case(
        "length_adaptive_lambda",
        rlo.length_adaptive_lambda,
        lambda: {"lengths": torch.tensor([0, 10, 100]), "alpha": 0.05},
        length_wrongs() + scalar_wrongs("alpha", below=0.0, tensors=False),
    ),
    Case(
        "relative_position_lambda",
        rlo.relative_position_lambda,
        lambda: {"lengths": torch.tensor([0, 1, 5]), "q": 0.5},
        length_wrongs() + scalar_wrongs("q", below=0.0, above=1.5, tensors=False),
    ),
    Case(
        "group_length_penalty",
        rlo.group_length_penalty,
        lambda: {"rewards": torch.rand(B * G, dtype=torch.float64),
                 "quantities": torch.rand(B * G, 3, dtype=torch.float64) * 9,
                 "weights": torch.tensor([0.25, 0.1, 0.1], dtype=torch.float64),
                 "group_size": G},
        tensor_wrongs("rewards", shapes=((B * G, 1),), reference=True, kinds="shape dtype type")
        + tensor_wrongs("quantities", shapes=((B * G + 1, 3), (B * G, 3, 1)))
        + tensor_wrongs("weights", shapes=((2,), (3, 1)))
        + int_wrongs("group_size", minimum=1)
        + group_ids_wrongs(),
    ),
    Case(
        "overlong_penalty",
        rlo.overlong_penalty,
        lambda: {"lengths": torch.tensor([10.0, 17.0, 22.0], dtype=torch.float64),
                 "max_length": 20, "cache_length": 4, "factor": 0.5},
        length_wrongs()
        + int_wrongs("max_length", minimum=1)
        + int_wrongs("cache_length", minimum=0)
        + (Wrong("cache_length", "value", "above-max_length", lambda a: 21, ValueError,
                 subject("cache_length")),)
        + scalar_wrongs("factor", below=-0.1, tensors=False),
    ),
)  # fmt: skip


def _diagnostics() -> Any:
    return rlo.policy_loss(torch.zeros(B, T), torch.zeros(B, T), torch.ones(B), token_mask())[2]


# --- issue 34: the preference and reward-model losses ----------------------------------------

_PAIR_TENSORS = ("chosen_log_probs", "rejected_log_probs", "ref_chosen_log_probs",
                 "ref_rejected_log_probs", "chosen_log_sum_sq_probs",
                 "rejected_log_sum_sq_probs")  # fmt: skip


def _pair_arguments() -> Arguments:
    arguments: Arguments = {name: -per_token().abs() for name in _PAIR_TENSORS}
    return arguments | {
        "chosen_mask": token_mask(), "rejected_mask": token_mask().flip(-1),
        "nll_mask": token_mask(), "objective": rlo.DPO(beta=0.1) + rlo.SFT(), "ld_alpha": 0.5,
    }  # fmt: skip


OBJECTIVE_WRONGS = (
    Wrong("objective", "type", "str", lambda a: "dpo", TypeError, subject("objective")),
    Wrong("objective", "type", "int", lambda a: 3, TypeError, subject("objective")),
)
SIDE_SHAPES = ((B + 1, T), (B, T, 1))  # the other side may have another T


def _reference_shapes(argument: str) -> tuple[Wrong, ...]:
    return tensor_wrongs(argument, shapes=((B, T + 1), (B + 1,), (B, T, 1)))


PAIR_WRONGS = (
    per_token_wrongs("chosen_log_probs", reference=True)
    + tensor_wrongs("rejected_log_probs", shapes=SIDE_SHAPES)
    + mask_wrongs("chosen_mask")
    + mask_wrongs("rejected_mask")
    + _reference_shapes("ref_chosen_log_probs")
    + _reference_shapes("ref_rejected_log_probs")
    + OBJECTIVE_WRONGS
    + mask_wrongs("nll_mask")
    + scalar_wrongs("ld_alpha", below=-0.1, above=1.5)
    + per_token_wrongs("chosen_log_sum_sq_probs")
    + per_token_wrongs("rejected_log_sum_sq_probs")
    + scalar_wrongs("normalizer", below=0.0)
    + scalar_wrongs("nll_normalizer", below=0.0)
    + cu_seqlens_wrongs(listed=True)
)


def _kto_arguments() -> Arguments:
    return {"log_probs": -per_token().abs(), "mask": token_mask(),
            "desirable": torch.tensor([True, False]), "ref_log_probs": -per_token().abs(),
            "kl": 0.1}  # fmt: skip


KTO_WRONGS = (
    tensor_wrongs("desirable", shapes=((B + 1,), (B, T)), dtype=torch.bool)
    + _reference_shapes("ref_log_probs")
    + scalar_wrongs("kl", below=None)
    + scalar_wrongs("beta", below=0.0)
    + scalar_wrongs("desirable_weight", below=-1.0)
    + scalar_wrongs("undesirable_weight", below=-1.0)
    + choice_wrongs("kind")
    + scalar_wrongs("normalizer", below=0.0)
    + cu_seqlens_wrongs()
)


def _pair_head_arguments() -> Arguments:
    return {
        **_hidden_arguments(), "mask": token_mask(), "ref_log_probs": -per_token().abs(),
        "objective": rlo.DPO(beta=0.1) + rlo.SFT(), "nll_mask": token_mask(), "ld_alpha": 0.5,
        "log_sum_sq_probs": -per_token().abs(),
    }  # fmt: skip


PAIR_HEAD_WRONGS = (
    HIDDEN_WRONGS
    + mask_wrongs()
    + _reference_shapes("ref_log_probs")
    + OBJECTIVE_WRONGS
    + mask_wrongs("nll_mask")
    + scalar_wrongs("ld_alpha", below=-0.1, above=1.5)
    + per_token_wrongs("log_sum_sq_probs")
    + scalar_wrongs("normalizer", below=0.0)
    + scalar_wrongs("nll_normalizer", below=0.0)
    + cu_seqlens_wrongs()
    + VOCAB_GROUP
    + HEAD_OPTIONS
    + FP32_HEAD
)

PREFERENCE_CASES: tuple[Case, ...] = (
    Case("preference_loss", rlo.preference_loss, _pair_arguments, PAIR_WRONGS),
    Case("preference_loss_from_hidden", rlo.preference_loss_from_hidden, _pair_head_arguments,
         PAIR_HEAD_WRONGS),
    Case("kto_loss", rlo.kto_loss, _kto_arguments,
         per_token_wrongs("log_probs", reference=True) + mask_wrongs() + KTO_WRONGS),
    Case("kto_loss_from_hidden", rlo.kto_loss_from_hidden,
         lambda: {**_hidden_arguments(),
                  **{k: v for k, v in _kto_arguments().items() if k != "log_probs"}},
         HIDDEN_WRONGS + mask_wrongs() + KTO_WRONGS + VOCAB_GROUP + HEAD_OPTIONS + FP32_HEAD),
    Case(
        "reward_model_loss",
        rlo.reward_model_loss,
        lambda: {"chosen_rewards": torch.randn(B, dtype=torch.float64),
                 "rejected_rewards": torch.randn(B, dtype=torch.float64),
                 "margin": torch.rand(B, dtype=torch.float64), "center_coefficient": 0.01},
        tensor_wrongs("chosen_rewards", shapes=((B, T), ()), reference=True)
        + tensor_wrongs("rejected_rewards", shapes=((B + 1,), (B, T)))
        + tensor_wrongs("margin", shapes=((B + 1,), (B, T)))
        + choice_wrongs("kind")
        + scalar_wrongs("center_coefficient", below=-0.1)
        + scalar_wrongs("normalizer", below=0.0),
    ),
)  # fmt: skip


CASES: tuple[Case, ...] = (
    Case(
        "aggregate",
        rlo.aggregate,
        lambda: {
            "values": per_token(),
            "mask": token_mask(),
            "reduction": "sequence_sum_normalized",
        },
        per_token_wrongs("values", reference=True)
        + mask_wrongs()
        + reduction_wrongs()
        + prompt_group_wrongs()
        + cu_seqlens_wrongs()
        + context_group_wrongs(),
    ),
    Case(
        "data_parallel_loss_scale",
        rlo.data_parallel_loss_scale,
        lambda: {},
        (Wrong("group", "type", "str", lambda a: "x", (TypeError, ValueError), subject("group")),),
    ),
    Case(
        "full_vocab_kl",
        rlo.full_vocab_kl,
        lambda: {"logits": logits(), "ref_logits": logits(), "mask": token_mask()},
        tensor_wrongs("logits", shapes=((B, T), (B, T, V, 1)), reference=True)
        + tensor_wrongs("ref_logits", shapes=((B, T, V + 1), (B, T + 1, V), (B, T)))
        + mask_wrongs()
        + TEMPERATURE
        + CHUNK
        + VOCAB_GROUP,
    ),
    Case(
        "full_vocab_kl_loss",
        rlo.full_vocab_kl_loss,
        lambda: {
            "logits": logits(),
            "ref_logits": logits(),
            "mask": token_mask(),
            "reduction": "sequence_sum_normalized",
        },
        tensor_wrongs("logits", shapes=((B, T), (B, T, V, 1)), reference=True)
        + tensor_wrongs("ref_logits", shapes=((B, T, V + 1), (B, T + 1, V), (B, T)))
        + mask_wrongs()
        + reduction_wrongs()
        + TEMPERATURE
        + CHUNK
        + cu_seqlens_wrongs()
        + VOCAB_GROUP,
    ),
    Case(
        "fused_policy_loss_from_hidden",
        rlo.fused_policy_loss_from_hidden,
        _fused_hidden_arguments,
        HIDDEN_WRONGS
        + per_token_wrongs("old_log_probs")
        + tensor_wrongs("advantages", shapes=PER_SEQUENCE_SHAPES)
        + mask_wrongs()
        + per_token_wrongs("ref_log_probs")
        + policy_options()
        + scalar_wrongs("entropy_coef", below=None)  # any real, a Python number
        + scalar_wrongs("kl_coef", below=-0.1)  # a Python number: 0-d tensors are rejected
        + choice_wrongs("kl_estimator")
        + flag_wrongs("kl_straight_through")
        + cu_seqlens_wrongs()
        + context_group_wrongs()
        + kept_wrongs()
        + prompt_group_wrongs()
        + MIN_P
        + HEAD_OPTIONS
        + FP32_HEAD,
    ),
    Case(
        "gae",
        rlo.gae,
        lambda: {
            "rewards": per_token(),
            "values": per_token(),
            "mask": token_mask(),
            "gamma": 0.9,
            "lam": 0.8,
            "value_lam": torch.tensor([1.0, 0.5], dtype=torch.float64),
        },
        per_token_wrongs("rewards", reference=True)
        + per_token_wrongs("values")
        + mask_wrongs()
        + scalar_wrongs("gamma", below=-0.1, above=1.5, xfail=None)
        + lambda_wrongs("lam")
        + lambda_wrongs("value_lam")
        + flag_wrongs("whiten")
        + choice_wrongs("holes")
        + cu_seqlens_wrongs()
        + context_group_wrongs(),
    ),
    Case(
        "global_normalizers",
        rlo.global_normalizers,
        lambda: {"masks": [token_mask(), token_mask()]},
        (
            Wrong(
                "masks",
                "shape",
                "3-d",
                lambda a: [torch.ones(B, T, 1, dtype=torch.bool)],
                ValueError,
                subject("masks"),
            ),
            Wrong("masks", "dtype", "strings", lambda a: [[["x"]]], TypeError, subject("masks")),
            Wrong("masks", "type", "str", lambda a: "x", TypeError, subject("masks")),
            Wrong("group", "type", "str", lambda a: "x", (TypeError, ValueError), subject("group")),
            Wrong(
                "device",
                "value",
                "unknown",
                lambda a: "nope",
                ValueError,
                subject("device"),
            ),
        )
        + cu_seqlens_wrongs(listed=True)
        + context_group_wrongs(),
    ),
    Case(
        "group_relative_advantages",
        rlo.group_relative_advantages,
        lambda: {"rewards": torch.randn(B * G, dtype=torch.float64), "group_size": G},
        tensor_wrongs("rewards", shapes=((B * G, 1, 1),), reference=True, kinds="shape dtype type")
        + int_wrongs("group_size", minimum=1)
        + group_ids_wrongs()
        + choice_wrongs("scale")
        + hyper("eps", below=-0.1),
    ),
    Case(
        "grpo_clipped_surrogate",
        rlo.grpo_clipped_surrogate,
        lambda: {
            "new_log_probs": per_token(),
            "old_log_probs": per_token(),
            "advantages": torch.randn(B, dtype=torch.float64),
            "token_mask": token_mask(),
            "clip_epsilon": 0.2,
        },
        per_token_wrongs("new_log_probs", reference=True)
        + per_token_wrongs("old_log_probs")
        + tensor_wrongs("advantages", shapes=PER_SEQUENCE_SHAPES)
        + mask_wrongs("token_mask")
        + hyper("clip_epsilon", below=-0.1)
        + cu_seqlens_wrongs(),
    ),
    Case(
        "kl_estimate",
        rlo.kl_estimate,
        lambda: {"log_probs": per_token(), "ref_log_probs": per_token(), "mask": token_mask()},
        per_token_wrongs("log_probs", reference=True)
        + per_token_wrongs("ref_log_probs")
        + mask_wrongs()
        + choice_wrongs("estimator")
        + flag_wrongs("straight_through")
        + hyper("log_ratio_bound", below=0.0),
    ),
    Case(
        "kl_loss",
        rlo.kl_loss,
        lambda: {
            "log_probs": per_token(),
            "ref_log_probs": per_token(),
            "mask": token_mask(),
            "estimator": "k2",
            "reduction": "sequence_sum_normalized",
            "importance_weights": torch.rand(B, T, dtype=torch.float64),
        },
        per_token_wrongs("log_probs", reference=True)
        + per_token_wrongs("ref_log_probs")
        + mask_wrongs()
        + choice_wrongs("estimator")
        + flag_wrongs("straight_through")
        + hyper("log_ratio_bound", below=0.0)
        + reduction_wrongs()
        + cu_seqlens_wrongs()
        + tensor_wrongs("importance_weights", shapes=PER_SEQUENCE_SHAPES)
        + context_group_wrongs(),
    ),
    Case(
        "rollout_correction",
        rlo.rollout_correction,
        lambda: {
            "log_probs": per_token(),
            "rollout_log_probs": per_token(),
            "mask": token_mask(),
            "lower": 0.5,
            "veto": 0.01,
        },
        per_token_wrongs("log_probs", reference=True)
        + per_token_wrongs("rollout_log_probs")
        + mask_wrongs()
        + choice_wrongs("level")
        + choice_wrongs("mode")
        + hyper("upper", below=0.0)
        + hyper("lower", below=-0.1, above=5.0)  # above upper = 2
        + hyper("veto", below=0.0)
        + cu_seqlens_wrongs()
        + context_group_wrongs(),
    ),
    Case(
        "off_policy_sequence_mask",
        rlo.off_policy_sequence_mask,
        lambda: {
            "log_probs": per_token(),
            "sampling_log_probs": per_token(),
            "advantages": torch.randn(B, dtype=torch.float64),
            "mask": token_mask(),
            "threshold": 0.1,
        },
        per_token_wrongs("log_probs", reference=True)
        + per_token_wrongs("sampling_log_probs")
        + tensor_wrongs("advantages", shapes=PER_SEQUENCE_SHAPES)
        + mask_wrongs()
        + hyper("threshold", below=None)
        + cu_seqlens_wrongs()
        + context_group_wrongs(),
    ),
    Case(
        "proximal_log_probs",
        rlo.proximal_log_probs,
        lambda: {
            "log_probs": -per_token().abs(),
            "behavior_log_probs": -per_token().abs(),
            "versions": torch.tensor([[3, 4, -1], [5, 2, 4]]),
            "current_version": 5,
            "method": "linear",
        },
        per_token_wrongs("log_probs", reference=True)
        + per_token_wrongs("behavior_log_probs")
        + tensor_wrongs("versions", shapes=MATRIX_SHAPES, dtype=torch.int64)
        + (
            Wrong("versions", "dtype", "bool", lambda a: torch.ones(B, T, dtype=torch.bool),
                  TypeError, subject("versions")),
            Wrong("current_version", "type", "float", lambda a: 5.0, TypeError,
                  subject("current_version")),
            Wrong("current_version", "type", "bool", lambda a: True, TypeError,
                  subject("current_version")),
            Wrong("current_version", "type", "tensor", lambda a: torch.tensor(5), TypeError,
                  subject("current_version")),
        )
        + choice_wrongs("method"),
    ),
    Case(
        "rejection_mask",
        rlo.rejection_mask,
        lambda: {
            "proximal_log_probs": -per_token().abs(),
            "behavior_log_probs": -per_token().abs(),
            "mask": token_mask(),
            "upper": 5.0,
            "lower": 0.5,
            "level": "sequence",
            "estimator": "ratio",
            "aggregate": "max",
            "symmetric": False,
        },
        per_token_wrongs("proximal_log_probs", reference=True)
        + per_token_wrongs("behavior_log_probs")
        + mask_wrongs()
        + hyper("upper", below=0.0)
        + hyper("lower", below=0.0)
        + (
            Wrong("lower", "value", "above-upper", lambda a: 6.0, ValueError, subject("lower")),
        )
        + choice_wrongs("level")
        + choice_wrongs("estimator")
        + choice_wrongs("aggregate")
        + flag_wrongs("symmetric")
        + cu_seqlens_wrongs()
        + context_group_wrongs(),
    ),
    Case(
        "kl_penalized_rewards",
        rlo.kl_penalized_rewards,
        lambda: {
            "policy_log_probs": per_token(),
            "reference_log_probs": per_token(),
            "rewards": torch.randn(B, dtype=torch.float64),
            "response_mask": token_mask(),
            "beta": 0.1,
        },
        per_token_wrongs("policy_log_probs", reference=True)
        + per_token_wrongs("reference_log_probs")
        + tensor_wrongs("rewards", shapes=PER_SEQUENCE_SHAPES)
        + mask_wrongs("response_mask")
        + hyper("beta", below=-0.1)
        + cu_seqlens_wrongs()
        + context_group_wrongs(),
    ),
    Case(
        "kl_penalized_token_rewards",
        rlo.kl_penalized_token_rewards,
        lambda: {
            "log_probs": per_token(),
            "ref_log_probs": per_token(),
            "scores": torch.randn(B, dtype=torch.float64),
            "mask": token_mask(),
            "kl_coef": 0.1,
        },
        per_token_wrongs("log_probs", reference=True)
        + per_token_wrongs("ref_log_probs")
        + tensor_wrongs("scores", shapes=PER_SEQUENCE_SHAPES)
        + mask_wrongs()
        + hyper("kl_coef", below=-0.1)
        + choice_wrongs("estimator")
        + hyper("log_ratio_bound", below=0.0)
        + cu_seqlens_wrongs()
        + context_group_wrongs(),
    ),
    *(
        Case(
            name,
            getattr(rlo, name),
            lambda: {"values": per_token(), "mask": token_mask()},
            tensor_wrongs("values", shapes=(), reference=True)
            + mask_wrongs()
            + unbroadcastable_mask()
            + (
                Wrong(
                    "dim",
                    "value",
                    "out-of-range",
                    lambda a: 5,
                    ValueError,
                    subject("dim"),
                ),
                Wrong(
                    "dim",
                    "type",
                    "float",
                    lambda a: 1.0,
                    TypeError,
                    subject("dim"),
                ),
            ),
        )
        for name in ("masked_mean", "masked_sum")
    ),
    Case("use_backend", rlo.use_backend, lambda: {"backend": "torch"}, choice_wrongs("backend")),
    Case(
        "normalizer_for_reduction",
        rlo.normalizer_for_reduction,
        lambda: {"normalizers": rlo.global_normalizers([token_mask()]), "reduction": "token_mean"},
        (
            Wrong(
                "normalizers",
                "type",
                "tuple",
                lambda a: (1, 2, 3),
                TypeError,
                subject("normalizers"),
            ),
            *choice_wrongs("reduction"),
        ),
    ),
    Case(
        "policy_loss",
        rlo.policy_loss,
        _policy_arguments,
        per_token_wrongs("log_probs", reference=True)
        + per_token_wrongs("old_log_probs")
        + tensor_wrongs("advantages", shapes=PER_SEQUENCE_SHAPES)
        + mask_wrongs()
        + policy_options()
        + per_token_wrongs("entropy")
        + hyper("entropy_coef", below=None)
        + flag_wrongs("return_per_token")
        + cu_seqlens_wrongs()
        + context_group_wrongs()
        + prompt_group_wrongs(),
    ),
    Case(
        "reinforce_plus_plus_advantages",
        rlo.reinforce_plus_plus_advantages,
        lambda: {
            "rewards": torch.randn(B, dtype=torch.float64),
            "mask": token_mask(),
            "token_rewards": per_token(),
            "group_size": 1,
        },
        tensor_wrongs("rewards", shapes=((B + 1,), (B, 2), (B, 1, 1)), reference=True)
        + tensor_wrongs(
            "mask",
            shapes=((B + 1, T), (B, T, 1)),
            dtype=torch.bool,
        )
        + per_token_wrongs("token_rewards")
        + scalar_wrongs("gamma", below=-0.1, above=1.5, xfail=None)
        + int_wrongs("group_size", minimum=1)
        + group_ids_wrongs()
        + flag_wrongs("unbiased")
        + hyper("eps", below=-0.1)
        + choice_wrongs("holes")
        + cu_seqlens_wrongs()
        + context_group_wrongs(),
    ),
    Case(
        "response_alignment",
        rlo.response_alignment,
        _alignment_arguments,
        ALIGNMENT_WRONGS + cu_seqlens_wrongs(4),
    ),
    Case(
        "response_log_probs",
        rlo.response_log_probs,
        lambda: {**_alignment_arguments(), "logits": torch.randn(B, 4, V, dtype=torch.float64)},
        tensor_wrongs("logits", shapes=((B, 5, V), (B, 4)), reference=True)
        + ALIGNMENT_WRONGS
        + TEMPERATURE
        + CHUNK
        + cu_seqlens_wrongs(4)
        + kept_wrongs((B, 2))  # (B, R): the set of each response token
        + MIN_P
        + HEAD_OPTIONS
        + STATISTICS,
    ),
    Case(
        "rloo_advantages",
        rlo.rloo_advantages,
        lambda: {"rewards": torch.randn(B * G, dtype=torch.float64), "group_size": G},
        tensor_wrongs("rewards", shapes=((B * G, 1, 1),), reference=True, kinds="shape dtype type")
        + int_wrongs("group_size", minimum=2)
        + group_ids_wrongs(),
    ),
    Case(
        "sum_diagnostics",
        rlo.sum_diagnostics,
        lambda: {"diagnostics": [_diagnostics(), _diagnostics()]},
        (
            Wrong(
                "diagnostics", "value", "empty", lambda a: [], ValueError, subject("diagnostics")
            ),
            Wrong(
                "diagnostics",
                "type",
                "ints",
                lambda a: [1, 2],
                (TypeError, ValueError),
                subject("diagnostics"),
            ),
            Wrong(
                "diagnostics",
                "type",
                "mixed",
                lambda a: [_diagnostics(), rlo.global_normalizers([token_mask()])],
                (TypeError, ValueError),
                subject("diagnostics"),
            ),
            Wrong("group", "type", "str", lambda a: "x", (TypeError, ValueError), subject("group")),
        ),
    ),
    Case(
        "token_entropy",
        rlo.token_entropy,
        lambda: {"logits": logits(), "mask": token_mask()},
        tensor_wrongs("logits", shapes=((B, T), (B * T * V,)), reference=True)
        + mask_wrongs()
        + TEMPERATURE
        + CHUNK
        + kept_wrongs()
        + MIN_P
        + HEAD_OPTIONS,
    ),
    Case(
        "token_log_probs",
        rlo.token_log_probs,
        lambda: {"logits": logits(), "tokens": token_ids(), "mask": token_mask()},
        tensor_wrongs("logits", shapes=((B, T), (B * T * V,)), reference=True)
        + tensor_wrongs("tokens", shapes=MATRIX_SHAPES, dtype=torch.int64)
        + mask_wrongs()
        + TEMPERATURE
        + CHUNK
        + kept_wrongs()
        + MIN_P
        + HEAD_OPTIONS
        + STATISTICS,
    ),
    Case(
        "value_loss",
        rlo.value_loss,
        lambda: {
            "values": per_token(),
            "old_values": per_token(),
            "returns": per_token(),
            "mask": token_mask(),
            "reduction": "sequence_sum_normalized",
        },
        per_token_wrongs("values", reference=True)
        + per_token_wrongs("old_values")
        + per_token_wrongs("returns")
        + mask_wrongs()
        + hyper("clip", below=-0.1)
        + reduction_wrongs()
        + cu_seqlens_wrongs()
        + context_group_wrongs(),
    ),
    *(
        Case(
            name,
            getattr(rlo, name),
            lambda: {"values": per_token(), "mask": token_mask()},
            tensor_wrongs("values", shapes=(), reference=True)
            + mask_wrongs()
            + unbroadcastable_mask()
            + flag_wrongs("shift_mean")
            + flag_wrongs("unbiased")
            + hyper("eps", below=-0.1)
            + (
                (
                    Wrong(
                        "group",
                        "type",
                        "str",
                        lambda a: "x",
                        (TypeError, ValueError),
                        subject("group"),
                    ),
                )
                if name == "global_masked_whiten"
                else ()
            ),
        )
        for name in ("masked_whiten", "global_masked_whiten")
    ),
    Case(
        "opo_advantages",
        rlo.opo_advantages,
        lambda: {**_group_arguments(), "mask": torch.ones(B * G, T, dtype=torch.bool)},
        tensor_wrongs("rewards", shapes=((B * G, 1, 1),), reference=True, kinds="shape dtype type")
        + tensor_wrongs("mask", shapes=((B * G + 1, T), (B * G, T, 1)), dtype=torch.bool)
        + int_wrongs("group_size", minimum=1)
        + group_ids_wrongs()
        + cu_seqlens_wrongs(rows=B * G),
    ),
    Case(
        "passk_advantages",
        rlo.passk_advantages,
        _group_arguments,
        tensor_wrongs("rewards", shapes=((B * G, 1, 1),), reference=True, kinds="shape dtype type")
        + int_wrongs("group_size", minimum=1)
        + group_ids_wrongs()
        + choice_wrongs("scale")
        + hyper("eps", below=-0.1),
    ),
    Case(
        "remax_advantages",
        rlo.remax_advantages,
        lambda: {
            "rewards": per_token(),
            "baseline_rewards": torch.randn(B, dtype=torch.float64),
            "mask": token_mask(),
        },
        per_token_wrongs("rewards", reference=True)
        + tensor_wrongs("baseline_rewards", shapes=PER_SEQUENCE_SHAPES)
        + mask_wrongs()
        + cu_seqlens_wrongs(),
    ),
    Case(
        "token_log_probs_from_hidden",
        rlo.token_log_probs_from_hidden,
        lambda: {**_hidden_arguments(), "mask": token_mask()},
        HIDDEN_WRONGS
        + mask_wrongs()
        + flag_wrongs("return_entropy")
        + cu_seqlens_wrongs()
        + kept_wrongs()
        + MIN_P
        + HEAD_OPTIONS
        + FP32_HEAD
        + STATISTICS,
    ),
    Case(
        "top_entropy_mask",
        rlo.top_entropy_mask,
        lambda: {"entropy": per_token(), "mask": token_mask(), "quantile": 0.5},
        ENTROPY_MASK_WRONGS + context_group_wrongs(),
    ),
    Case(
        "global_top_entropy_mask",
        rlo.global_top_entropy_mask,
        lambda: {"entropy": per_token(), "mask": token_mask(), "quantile": 0.5},
        ENTROPY_MASK_WRONGS
        + (
            Wrong("group", "type", "str", lambda a: "x", (TypeError, ValueError), subject("group")),
        ),
    ),
    *(
        Case(
            name,
            function,
            lambda: {"log_probs": -per_token().abs(), "mask": token_mask(),
                     "reduction": "sequence_mean"},
            per_token_wrongs("log_probs", reference=True)
            + mask_wrongs()
            + reduction_wrongs()
            + prompt_group_wrongs()
            + cu_seqlens_wrongs()
            + context_group_wrongs(),
        )
        for name, function in (("nll_loss", rlo.nll_loss), ("dft_loss", rlo.dft_loss))
    ),
    Case(
        "m2po_mask",
        rlo.m2po_mask,
        lambda: {"log_ratio": per_token(), "mask": token_mask(), "threshold": 0.04},
        M2PO_MASK_WRONGS + cu_seqlens_wrongs(),
    ),
    Case(
        "global_m2po_mask",
        rlo.global_m2po_mask,
        lambda: {"log_ratio": per_token(), "mask": token_mask(), "threshold": 0.04},
        M2PO_MASK_WRONGS + GROUP_WRONGS,
    ),
    Case("cov_selection", rlo.cov_selection, _cov_arguments,
         COV_SELECTION_WRONGS + cu_seqlens_wrongs()),
    Case("global_cov_selection", rlo.global_cov_selection, _cov_arguments,
         COV_SELECTION_WRONGS + GROUP_WRONGS),
    *PACKING_CASES,
    *ISSUE25_CASES,
    *PREFERENCE_CASES,
    *SURROGATE_CASES,
    *OBJECTIVE_CASES,
    *SURROGATE35_CASES,
)  # fmt: skip
