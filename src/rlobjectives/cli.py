"""Command line: ``rlobjectives <command>`` (also ``python -m rlobjectives``).

``grpo-surrogate`` and ``kl-rewards`` read one JSON object whose keys are the parameter names of
:func:`rlobjectives.grpo_clipped_surrogate` / :func:`rlobjectives.kl_penalized_rewards` from a
file argument or standard input and print the outputs as JSON. Every user error prints one line
on standard error and exits with status 2.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

from . import __version__
from .kl.rewards import kl_penalized_rewards
from .policy.grpo_surrogate import grpo_clipped_surrogate

__all__ = ["main"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_FUNCTIONS: dict[str, Callable[..., dict[str, torch.Tensor]]] = {
    "grpo-surrogate": grpo_clipped_surrogate,
    "kl-rewards": kl_penalized_rewards,
}
# Parameters that hold tensors (converted with the chosen dtype); the rest are scalars.
_MASKS = {"token_mask", "response_mask"}


class _UsageError(Exception):
    """A user error: reported as one line on stderr, exit status 2."""


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _shortest(number: float, dtype: torch.dtype) -> float:
    """The shortest decimal that rounds back to ``number`` in ``dtype`` (15 digits for float64).

    float64 results are printed with 15 significant digits so that ``-0.7999999999999999``
    reads ``-0.8``; float32 results with the fewest digits that identify the float32 value.
    """
    if dtype != torch.float32:
        return float(f"{number:.15g}")
    target = struct.pack("<f", number)
    for digits in range(6, 10):
        candidate = float(f"{number:.{digits}g}")
        if struct.pack("<f", candidate) == target:
            return candidate
    return number


def _to_json(value: torch.Tensor) -> Any:
    data = value.detach().to(torch.float64).cpu().tolist()

    def clean(item: Any) -> Any:
        if isinstance(item, list):
            return [clean(x) for x in item]
        if math.isnan(item):
            return None
        if math.isinf(item):
            return "Infinity" if item > 0 else "-Infinity"
        return _shortest(item, value.dtype)

    return clean(data)


def _read_bytes(path: str | None) -> bytes:
    """The raw input: the file at ``path``, or standard input for ``None`` or ``-``."""
    if path is None or path == "-":
        stream = sys.stdin
        if stream is None:  # started with standard input closed (e.g. ``<&-``)
            raise _UsageError("cannot read standard input: it is closed")
        try:
            buffer = getattr(stream, "buffer", None)
            if buffer is not None:
                return bytes(buffer.read())
            return str(stream.read()).encode("utf-8", "surrogatepass")
        except (OSError, ValueError) as error:  # ValueError: I/O operation on closed file
            raise _UsageError(f"cannot read standard input: {error}") from None
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as error:
        raise _UsageError(f"cannot read input {path!r}: {error.strerror}") from None


_MAX_JSON_DEPTH = 512  # far beyond any tensor argument (at most 64 dimensions) in one object


def _nesting_depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` in JSON text, outside strings (one linear scan)."""
    depth = deepest = 0
    in_string = escaped = False
    for character in text:
        if in_string:
            if escaped:
                escaped = False
            elif character == "\\":
                escaped = True
            elif character == '"':
                in_string = False
        elif character == '"':
            in_string = True
        elif character in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif character in "]}":
            depth -= 1
    return deepest


def _read_json(path: str | None) -> dict[str, Any]:
    raw = _read_bytes(path)
    source = "standard input" if path is None or path == "-" else f"input file {path!r}"
    try:
        text = raw.decode("utf-8-sig")  # JSON is UTF-8 (RFC 8259); a leading BOM is tolerated
    except UnicodeDecodeError as error:
        raise _UsageError(
            f"{source} is not valid UTF-8: byte 0x{raw[error.start]:02x} at offset {error.start}"
        ) from None
    if _nesting_depth(text) > _MAX_JSON_DEPTH:
        # Decided before parsing: json's own RecursionError depends on the interpreter's current
        # recursion limit and stack depth, so it would not be reproducible.
        raise _UsageError(
            f"malformed JSON input: nested too deeply (more than {_MAX_JSON_DEPTH} levels)"
        )
    limit = sys.getrecursionlimit()
    try:
        # room for the parser's recursion whatever the caller's stack depth (restored below)
        sys.setrecursionlimit(max(limit, _MAX_JSON_DEPTH + 1000))
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise _UsageError(
            f"malformed JSON input: {error.msg} at line {error.lineno} column {error.colno}"
        ) from None
    except RecursionError:
        raise _UsageError("malformed JSON input: nested too deeply") from None
    except ValueError as error:  # e.g. an integer literal beyond Python's 4300-digit limit
        reason = str(error).split(";")[0]  # drop the advice meant for Python programmers
        raise _UsageError(f"malformed JSON input: {reason}") from None
    finally:
        sys.setrecursionlimit(limit)
    if not isinstance(data, dict):
        raise _UsageError(f"the JSON input must be an object, got {type(data).__name__}")
    return data


def _seed_parameters(function: Any) -> list[str]:
    """The seed's positional parameters: the keys of the command-line input.

    Keyword-only extensions (``cu_seqlens``) are not part of the command-line input.
    """
    signature = inspect.signature(function).parameters
    return [name for name, value in signature.items() if value.kind is not value.KEYWORD_ONLY]


def _run_function(command: str, data: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    function = _FUNCTIONS[command]
    parameters = _seed_parameters(function)
    missing = [name for name in parameters if name not in data]
    unknown = sorted(set(data) - set(parameters))
    if unknown:
        raise _UsageError(f"unknown key(s) {unknown}; expected the keys {parameters}")
    if missing:
        raise _UsageError(f"missing key(s) {missing}; expected the keys {parameters}")
    arguments: dict[str, Any] = {}
    for name in parameters:
        value = data[name]
        if isinstance(value, list) and name not in _MASKS:
            try:
                value = torch.tensor(value, dtype=dtype)
            except (TypeError, ValueError, RuntimeError, OverflowError):
                pass  # let the function raise its own, named, error
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and name not in _MASKS:
            try:
                value = float(value)
            except OverflowError:
                raise _UsageError(
                    f"invalid input: {name} must be a finite real number, got an integer of "
                    f"{int(value).bit_length()} bits"
                ) from None
        arguments[name] = value
    try:
        outputs = function(**arguments)
    except (TypeError, ValueError, OverflowError, RecursionError) as error:
        raise _UsageError(f"invalid input: {error}") from None
    return {key: _to_json(tensor) for key, tensor in outputs.items()}


def _build_parser() -> _ArgumentParser:
    parser = _ArgumentParser(
        prog="rlobjectives",
        description="RL post-training objectives for language models.",
    )
    parser.add_argument("--version", action="version", version=f"rlobjectives {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser)
    for command, function in _FUNCTIONS.items():
        summary = (function.__doc__ or "").strip().splitlines()[0]
        keys = ", ".join(_seed_parameters(function))
        sub = commands.add_parser(
            command,
            help=summary,
            description=f"{summary} Reads one JSON object with the keys: {keys}.",
        )
        sub.add_argument(
            "input", nargs="?", default=None, help="JSON file (default: standard input, or '-')"
        )
        sub.add_argument(
            "--dtype",
            choices=sorted(_DTYPES),
            default="float64",
            help="computation dtype (default: float64)",
        )
    # Parsed by rlobjectives.demo itself (main forwards the arguments): listed here for --help.
    commands.add_parser(
        "demo", help="GRPO or PPO post-training demo on CPU (rlobjectives demo --help)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 success, 2 user error, 130 Ctrl-C)."""
    parser = _build_parser()
    argument_list = list(sys.argv[1:] if argv is None else argv)
    if argument_list[:1] == ["demo"]:
        try:
            from .demo import main as demo_main  # imports tqdm/matplotlib when a run starts

            return demo_main(argument_list[1:])
        except KeyboardInterrupt:  # while the demo's modules import
            print("rlobjectives demo: interrupted (Ctrl-C)", file=sys.stderr)
            return 130
    try:
        arguments = parser.parse_args(argument_list)
        data = _read_json(arguments.input)
        outputs = _run_function(arguments.command, data, _DTYPES[arguments.dtype])
    except _UsageError as error:
        print(f"rlobjectives: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rlobjectives: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    print(json.dumps(outputs))
    return 0
