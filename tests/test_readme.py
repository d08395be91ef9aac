"""The README's Python quick start and command-line examples run and print what they claim."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def test_python_quick_start_runs() -> None:
    blocks = _blocks("python")
    assert blocks, "the README has no Python quick start"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})


def test_command_line_examples_print_what_the_readme_says() -> None:
    (block,) = [b for b in _blocks("bash") if "rlobjectives grpo-surrogate" in b]
    examples = re.findall(
        r"echo '(.*?)' \\\n\s*\| rlobjectives (\S+)(.*?)\n# (.*?)\n", block, flags=re.S
    )
    assert len(examples) == 2
    for payload, command, options, printed in examples:
        result = subprocess.run(
            [sys.executable, "-m", "rlobjectives", command, *options.split()],
            input=payload,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert json.loads(result.stdout) == json.loads(printed)
