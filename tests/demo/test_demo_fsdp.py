"""FSDP2 in a real-process test (issue 23): ``torchrun ... -m rlobjectives.demo --fsdp``.

The demo trained for a few GRPO steps with ``fully_shard`` on 2 gloo ranks (the real command,
through ``tests/_demo_rank.py``, which also counts the Gloo threads left at exit) gives the same
step losses, metrics and final parameters as the same run in one process. With ``--fsdp`` the
sampler's random numbers and the minibatch order are drawn for the whole step from one stream,
so both runs train on the same samples; what differs is where the float32 sums are taken (each
rank's half of a minibatch, FSDP2's reduce-scatter of the gradients).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlobjectives.demo import main
from rlobjectives.demo._process_group import LEAKED_GROUP_WARNING

pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")

RUN = [
    "--steps",
    "2",
    "--warmup-steps",
    "2",
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--eval-every",
    "2",
    "--eval-size",
    "8",
    "--hidden-size",
    "16",
    "--no-progress",
    "--fsdp",
]
METRICS = ("loss", "reward", "accuracy", "kl", "clip_fraction", "ratio_mean", "approx_kl")
LEARNING_RATE = 1e-3  # the demo's default --lr
UPDATES = 2 * 2 * 2  # steps x epochs x minibatches
TORCHRUN_TIMEOUT_S = 300.0  # the run takes about 35 s on 2 shared cores


def _run_in_own_session(
    command: list[str], *, env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` (torchrun) as the leader of a new session; on a timeout kill the session.

    ``subprocess.run(timeout=...)`` kills only torchrun itself (SIGKILL cannot be forwarded),
    which would leave its two worker ranks running; killing the process group ends them too.
    """
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and its workers
        stdout, stderr = process.communicate()
        pytest.fail(f"torchrun ran past {timeout_s} s:\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _metrics(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
def test_fsdp2_two_ranks_train_as_one_process(tmp_path: Path) -> None:
    sharded, single = tmp_path / "fsdp", tmp_path / "single"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(Path(__file__).resolve().parents[1] / "_demo_rank.py"),
        *RUN,
        "--out",
        str(sharded),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = _run_in_own_session(command, env=env, timeout_s=TORCHRUN_TIMEOUT_S)
    if result.returncode != 0:
        print(result.stdout[-3000:], result.stderr[-6000:])  # shown by pytest on failure
    assert result.returncode == 0
    # The group is really gone at exit (DTensor's caches released): no Gloo thread outlives it.
    assert "terminate called" not in result.stderr
    assert LEAKED_GROUP_WARNING not in result.stderr
    for rank in (0, 1):
        assert f"rank {rank}: status 0, gloo threads 0" in result.stdout, result.stdout[-2000:]
    assert json.loads((sharded / "summary.json").read_text())["world_size"] == 2

    assert main([*RUN, "--out", str(single)]) == 0  # the same run, one process, no sharding

    two, one = _metrics(sharded), _metrics(single)
    assert [row["step"] for row in two] == [row["step"] for row in one] == [1, 2]
    for row_two, row_one in zip(two, one, strict=True):
        for key in METRICS:  # metrics.jsonl keeps 6 decimals
            assert row_two[key] == pytest.approx(row_one[key], rel=1e-5, abs=2e-6), key
    parameters_two = torch.load(sharded / "parameters.pt", weights_only=True)
    parameters_one = torch.load(single / "parameters.pt", weights_only=True)
    assert parameters_two.keys() == parameters_one.keys()
    for name, value in parameters_one.items():
        other = parameters_two[name]
        assert other.shape == value.shape and other.dtype == torch.float32
        if name.endswith("qkv.bias"):
            # The key biases' exact gradient is 0 (softmax is shift-invariant per query): both
            # runs feed AdamW float32 noise there, which it normalises to steps of up to lr.
            hidden = value.shape[0] // 3
            keys = slice(hidden, 2 * hidden)
            noise = (other[keys] - value[keys]).abs().max()
            assert noise <= 2 * LEARNING_RATE * UPDATES
            other, value = other.clone(), value.clone()
            other[keys] = value[keys]
        torch.testing.assert_close(other, value, rtol=1e-5, atol=1e-6, msg=name)


def test_fsdp_is_for_grpo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--fsdp", "--algorithm", "ppo"]) == 2
    assert "--fsdp supports --algorithm grpo, got --algorithm ppo" in capsys.readouterr().err
