"""The command line: round trips on the seed examples and clean error exits."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlobjectives.cli import main
from test_seed_examples import GRPO_EXAMPLES, KL_EXAMPLES

COMMANDS = [("grpo-surrogate", i, o) for i, o in GRPO_EXAMPLES] + [
    ("kl-rewards", i, o) for i, o in KL_EXAMPLES
]


def run(
    argv: list[str], stdin: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_matches(printed: dict[str, object], expected: dict[str, object]) -> None:
    assert set(printed) == set(expected)
    for key, value in expected.items():
        assert printed[key] == pytest.approx(value, abs=1e-6), key


@pytest.mark.parametrize(("command", "inputs", "expected"), COMMANDS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_round_trip_stdin(
    command: str,
    inputs: dict[str, object],
    expected: dict[str, object],
    dtype: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run([command, "--dtype", dtype], json.dumps(inputs), monkeypatch, capsys)
    assert code == 0 and err == ""
    assert_matches(json.loads(out), expected)


def test_float64_output_reads_like_the_spec(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs, _ = GRPO_EXAMPLES[0]
    code, out, _ = run(["grpo-surrogate"], json.dumps(inputs), monkeypatch, capsys)
    assert code == 0
    printed = json.loads(out)
    assert printed["loss"] == -0.8  # not -0.7999999999999999
    assert printed["per_sequence_surrogate"] == [1.7, -1.0]
    inputs, _ = KL_EXAMPLES[1]
    code, out, _ = run(["kl-rewards"], json.dumps(inputs), monkeypatch, capsys)
    assert json.loads(out) == {
        "objective": -0.01,
        "penalized_rewards": [0.94, -0.96],
        "sampled_divergences": [0.3, -0.2],
    }


def test_file_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs, expected = KL_EXAMPLES[0]
    path = tmp_path / "input.json"
    path.write_text(json.dumps(inputs))
    code, out, _ = run(["kl-rewards", str(path)], "", monkeypatch, capsys)
    assert code == 0
    assert_matches(json.loads(out), expected)


def test_empty_batch(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    payload = {
        "policy_log_probs": [],
        "reference_log_probs": [],
        "rewards": [],
        "response_mask": [],
        "beta": 0.5,
    }
    code, out, _ = run(["kl-rewards"], json.dumps(payload), monkeypatch, capsys)
    assert code == 0
    assert json.loads(out) == {"objective": 0.0, "penalized_rewards": [], "sampled_divergences": []}


ERRORS = [
    (["kl-rewards"], "{not json", "malformed JSON input"),
    (["kl-rewards"], "[1, 2]", "the JSON input must be an object, got list"),
    (
        ["kl-rewards"],
        json.dumps(
            {
                "policy_log_probs": [[0]],
                "reference_log_probs": [[0]],
                "rewards": [0],
                "response_mask": [[1]],
            }
        ),
        r"missing key(s) ['beta']",
    ),
    (["kl-rewards"], json.dumps({**KL_EXAMPLES[0][0], "gamma": 1}), r"unknown key(s) ['gamma']"),
    (
        ["grpo-surrogate"],
        json.dumps({**GRPO_EXAMPLES[0][0], "clip_epsilon": -1}),
        "clip_epsilon must be >= 0.0, got -1.0",
    ),
    (
        ["grpo-surrogate"],
        json.dumps({**GRPO_EXAMPLES[0][0], "advantages": [1, 2, 3]}),
        "advantages must have shape",
    ),
    (
        ["grpo-surrogate"],
        json.dumps({**GRPO_EXAMPLES[0][0], "old_log_probs": [[0, "x"], [0, 0]]}),
        "old_log_probs must contain only numbers",
    ),
    (
        ["grpo-surrogate"],
        json.dumps({**GRPO_EXAMPLES[0][0], "token_mask": [[1], [1, 1]]}),
        "token_mask is a ragged nested list",
    ),
    (["grpo-surrogate", "--dtype", "int8"], "{}", "invalid choice: 'int8'"),
    (["no-such-command"], "{}", "invalid choice: 'no-such-command'"),
    (["grpo-surrogate", "/does/not/exist.json"], "", "cannot read input '/does/not/exist.json'"),
]


@pytest.mark.parametrize(("argv", "stdin", "message"), ERRORS)
def test_errors_exit_2_with_one_line(
    argv: list[str],
    stdin: str,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(argv, stdin, monkeypatch, capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("rlobjectives: error: ")
    assert message in err
    assert "Traceback" not in err


def test_python_dash_m_and_console_script() -> None:
    inputs, expected = GRPO_EXAMPLES[1]
    for command in (
        [sys.executable, "-m", "rlobjectives"],
        [str(Path(sys.executable).parent / "rlobjectives")],
    ):
        result = subprocess.run(
            [*command, "grpo-surrogate"],
            input=json.dumps(inputs),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert_matches(json.loads(result.stdout), expected)
    bad = subprocess.run(
        [sys.executable, "-m", "rlobjectives", "kl-rewards"],
        input="{",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1
