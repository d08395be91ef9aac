"""Limits a reader can hold the library to (``docs/architecture.md``, "Size and layering").

Counted on the source files, with the standard library's ``ast``: a docstring spans the lines of
its string literal; a code line is a non-blank line outside docstrings and comments. The import
rules are checked on every ``import`` statement, lazy ones (inside functions) included.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "rlobjectives"
SOURCES = sorted(PACKAGE.rglob("*.py"))
MAX_DOCSTRING_LINES = 60
MAX_MODULE_LINES = 500
MAX_CODE_LINES = {"policy": 1600, "kernels": 1200}
# Words of the project's history: they say what changed, not what the code is.
HISTORY = re.compile(
    r"seed specification|\bissue \d+|bit-pattern|\bversion \(0\.\d\)|hand-fused|fused stage",
    re.IGNORECASE,
)
# folder -> the folders of the package it must never import (lazily or not)
FORBIDDEN_IMPORTS = {
    "kernels": ("policy", "logprobs", "distillation", "preference", "kl", "presets"),
    "_core": ("policy", "logprobs", "distillation", "preference", "kl", "presets", "kernels"),
    "logprobs": ("policy", "distillation", "preference", "presets"),
}


def _docstrings(tree: ast.Module) -> Iterator[tuple[str, int, int]]:
    """``(name, first line, last line)`` of every module, class and function docstring."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    end = body[0].end_lineno or body[0].lineno
                    yield getattr(node, "name", "<module>"), body[0].lineno, end


def _code_lines(text: str) -> int:
    documented = {
        line for _, first, last in _docstrings(ast.parse(text)) for line in range(first, last + 1)
    }
    return sum(
        1
        for number, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in documented
    )


def _relative(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


def test_code_line_counts_are_right() -> None:
    # a known text: 2 code lines (the def and the return), a 3-line docstring and a comment
    sample = 'def f():\n    """One.\n\n    Two."""\n    # note\n\n    return 1\n'
    assert _code_lines(sample) == 2
    assert [(n, b - a + 1) for n, a, b in _docstrings(ast.parse(sample))] == [("f", 3)]


def test_no_docstring_over_60_lines() -> None:
    long = [
        f"{_relative(path)}:{name} ({last - first + 1} lines)"
        for path in SOURCES
        for name, first, last in _docstrings(ast.parse(path.read_text()))
        if last - first + 1 > MAX_DOCSTRING_LINES
    ]
    assert not long, long


def test_no_module_over_500_lines() -> None:
    long = {
        _relative(path): n
        for path in SOURCES
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, long


@pytest.mark.parametrize("folder", sorted(MAX_CODE_LINES))
def test_folder_code_lines(folder: str) -> None:
    total = sum(_code_lines(path.read_text()) for path in (PACKAGE / folder).rglob("*.py"))
    assert 0 < total <= MAX_CODE_LINES[folder], total


def test_no_words_of_the_history_in_the_source() -> None:
    found = [
        f"{_relative(path)}:{number}: {line.strip()}"
        for path in SOURCES
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert not found, found


def _imported_folders(text: str, parts: tuple[str, ...]) -> set[str]:
    """The package folders a module imports (``parts``: its package below ``rlobjectives``)."""
    folders: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(parts[: len(parts) - (node.level - 1)])
                target = base + (node.module.split(".") if node.module else [])
                if not node.module:  # from .. import name: the names are the modules
                    folders.update((base + [alias.name])[0] for alias in node.names)
            elif node.module and node.module.startswith("rlobjectives."):
                target = node.module.split(".")[1:]
            else:
                continue
            if target:
                folders.add(target[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("rlobjectives."):
                    folders.add(alias.name.split(".")[1])
    return folders


@pytest.mark.parametrize("folder", sorted(FORBIDDEN_IMPORTS))
def test_layers_import_downward(folder: str) -> None:
    wrong = {
        _relative(path): sorted(
            _imported_folders(path.read_text(), path.relative_to(PACKAGE).parts[:-1])
            & set(FORBIDDEN_IMPORTS[folder])
        )
        for path in (PACKAGE / folder).rglob("*.py")
    }
    wrong = {name: folders for name, folders in wrong.items() if folders}
    assert not wrong, wrong


def test_import_resolution_sees_lazy_and_relative_imports() -> None:
    text = (
        "import rlobjectives.kl.loss\n"
        "def f():\n    from ..policy import loss\n    from .._core import x\n"
        "    from .jit import head\n    from . import y\n    from .. import distillation\n"
    )
    assert _imported_folders(text, ("kernels",)) == {"policy", "_core", "kl", "kernels",
                                                     "distillation"}  # fmt: skip
