"""Count the library modules and functions whose Python code runs in one call (a trace).

Usage (from the repository root)::

    python benchmarks/count_modules.py            # both calls, the modules and their functions
    python benchmarks/count_modules.py --counts   # only ``name modules functions`` per call

Traced calls (after one untraced warm-up, so that lazy imports do not count): a default
``policy_loss`` forward + backward on a ``(4, 8)`` float32 batch, and a default
``fused_policy_loss_from_hidden`` forward + backward (``hidden`` and ``weight`` require grad). A
module counts when a frame of a function defined in its file runs (``call`` events of Python
frames; C functions are not counted); a function counts once however often it runs (nested
comprehensions and lambdas are functions). ``tests/test_module_counts.py`` keeps
``policy_loss`` at most 6 modules and 40 functions, the loss from hidden states at 14 modules.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import rlobjectives

PACKAGE = Path(rlobjectives.__file__).resolve().parent


def _module_of(filename: str) -> str | None:
    """``rlobjectives.x.y`` of a file of the package, or None for other files."""
    try:
        relative = Path(filename).resolve().relative_to(PACKAGE)
    except ValueError:
        return None
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["rlobjectives", *parts])


def trace(call: Callable[[], Any]) -> dict[str, set[str]]:
    """The library modules whose code runs in ``call()``, with the functions that ran."""
    seen: dict[str, set[str]] = {}
    files: dict[str, str | None] = {}

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        filename = frame.f_code.co_filename
        module = files.get(filename)
        if filename not in files:
            module = files[filename] = _module_of(filename)
        if module is not None:
            seen.setdefault(module, set()).add(frame.f_code.co_qualname)

    call()  # warm-up: lazy imports and first-call caches are not part of a call
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def policy_loss_call() -> None:
    """A default ``policy_loss`` forward and backward."""
    generator = torch.Generator().manual_seed(0)
    old_log_probs = -torch.rand(4, 8, generator=generator)
    log_probs = (old_log_probs + 0.1 * torch.randn(4, 8, generator=generator)).requires_grad_()
    mask = torch.rand(4, 8, generator=generator) > 0.3
    advantages = torch.randn(4, generator=generator)
    rlobjectives.policy_loss(log_probs, old_log_probs, advantages, mask).loss.backward()


def fused_policy_loss_from_hidden_call() -> None:
    """A default ``fused_policy_loss_from_hidden`` forward and backward."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 8, 16, generator=generator, requires_grad=True)
    weight = torch.randn(32, 16, generator=generator, requires_grad=True)
    tokens = torch.randint(0, 32, (4, 8), generator=generator)
    old_log_probs = -torch.rand(4, 8, generator=generator) - 3.0
    mask = torch.rand(4, 8, generator=generator) > 0.3
    advantages = torch.randn(4, generator=generator)
    out = rlobjectives.fused_policy_loss_from_hidden(
        hidden, weight, tokens, old_log_probs, advantages, mask
    )
    out.loss.backward()


CALLS: dict[str, Callable[[], None]] = {
    "policy_loss": policy_loss_call,
    "fused_policy_loss_from_hidden": fused_policy_loss_from_hidden_call,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", action="store_true", help="print only the counts")
    args = parser.parse_args(argv)
    for name, call in CALLS.items():
        seen = trace(call)
        functions = sum(len(names) for names in seen.values())
        print(f"{name} {len(seen)} {functions}")
        if not args.counts:
            for module in sorted(seen):
                print(f"  {module}: {', '.join(sorted(seen[module]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
