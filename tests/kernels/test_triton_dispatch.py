"""Backend choice of the LM-head functions: use_backend, RLOBJECTIVES_KERNELS, lazy triton."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import rlobjectives as rlo
from backends import requires_triton
from rlobjectives._core.backend import chosen_backend, lm_head_backend, use_backend
from rlobjectives._core.validation import KERNELS_VARIABLE as ENV_VAR
from rlobjectives._core.validation import requested_backend
from rlobjectives.kernels.loading import interpreted


def test_default_is_auto_and_cpu_keeps_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert requested_backend() == "auto"
    assert lm_head_backend("cpu", dtype=torch.float32) == "torch"
    monkeypatch.setenv(ENV_VAR, " Auto ")
    assert lm_head_backend(torch.device("cpu"), dtype=torch.float32) == "torch"


def test_torch_overrides_everything() -> None:
    with use_backend("torch"):
        for device in ("cpu", "cuda", "meta"):
            assert lm_head_backend(device, dtype=torch.float64, kept_set=True) == "torch"


@requires_triton
def test_auto_uses_triton_for_cuda_tensors_it_can_take() -> None:
    with use_backend("auto"):
        assert lm_head_backend("cuda", dtype=torch.bfloat16) == "triton"
        assert lm_head_backend("cuda", dtype=torch.float64) == "torch"
        assert lm_head_backend("cuda", dtype=torch.float32, kept_set=True) == "torch"


@requires_triton
def test_triton_on_cpu_means_the_interpreter() -> None:
    with use_backend("triton"):
        assert lm_head_backend("cpu", dtype=torch.float32) == "triton"
        assert lm_head_backend("cpu", dtype=torch.bfloat16) == "triton"
    assert interpreted("cpu")


@requires_triton
@pytest.mark.parametrize(
    ("device", "dtype", "kept", "match"),
    [
        ("cpu", torch.float64, False, "float64"),
        ("cpu", torch.float32, True, "kept set"),
        ("meta", torch.float32, False, "'meta'"),
    ],
)
def test_an_explicit_request_that_cannot_be_honoured_raises(
    device: str, dtype: torch.dtype, kept: bool, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with use_backend("triton"), pytest.raises(ValueError, match=match):
        lm_head_backend(device, dtype=dtype, kept_set=kept)
    monkeypatch.setenv(ENV_VAR, "triton")  # the environment's default is an explicit request too
    with pytest.raises(ValueError, match=match):
        lm_head_backend(device, dtype=dtype, kept_set=kept)


@requires_triton
def test_public_call_with_an_unhonoured_request_raises() -> None:
    hidden, weight = torch.randn(1, 2, 3), torch.randn(5, 3)
    tokens = torch.tensor([[1, 2]])
    with use_backend("triton"):
        with pytest.raises(ValueError, match="kept set"):
            rlo.token_log_probs_from_hidden(hidden, weight, tokens, top_k=2)
        with pytest.raises(ValueError, match="float64"):
            rlo.token_log_probs_from_hidden(hidden.double(), weight.double(), tokens)
    with use_backend("torch"):  # the same call on the torch backend
        assert rlo.token_log_probs_from_hidden(hidden, weight, tokens, top_k=2).shape == (1, 2)


@requires_triton
def test_traced_code_cannot_take_an_explicit_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with use_backend("auto"):
        assert lm_head_backend("cuda", dtype=torch.float32) == "torch"
    with use_backend("triton"), pytest.raises(ValueError, match="torch.compile"):
        lm_head_backend("cpu", dtype=torch.float32)


def test_invalid_values_name_the_variable_or_the_argument(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=ENV_VAR):
        lm_head_backend("cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match=ENV_VAR):  # every public function checks it
        rlo.policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2))
    monkeypatch.delenv(ENV_VAR)
    with pytest.raises(ValueError, match="backend must be one of"):
        use_backend("fast")  # when called, before any block


def test_use_backend_nests_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "torch")
    assert chosen_backend() == "torch"
    with use_backend("triton"):
        assert chosen_backend() == "triton"
        with use_backend("auto"):
            assert chosen_backend() == "auto"
        assert chosen_backend() == "triton"
        assert os.environ[ENV_VAR] == "torch"  # the block does not touch the environment
    assert chosen_backend() == "torch"
    with pytest.raises(RuntimeError), use_backend("auto"):
        raise RuntimeError
    assert chosen_backend() == "torch"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_VAR, "TRITON_INTERPRET")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip


def test_importing_the_library_does_not_import_triton() -> None:
    result = _run(
        """
        import sys
        import torch
        import rlobjectives
        import rlobjectives.kernels
        import rlobjectives.kernels.loading
        assert "triton" not in sys.modules, "triton imported"
        # CPU calls (auto) do not import it either
        ones = torch.ones(2, 3)
        rlobjectives.policy_loss(ones, ones, torch.ones(2), ones.bool())
        rlobjectives.kl_loss(ones, ones, ones.bool(), estimator="k2")
        rlobjectives.token_log_probs_from_hidden(torch.ones(1, 2, 3), torch.ones(4, 3),
                                                 torch.zeros(1, 2, dtype=torch.long))
        assert "triton" not in sys.modules, "triton imported by a CPU call"
        assert "rlobjectives.kernels.interpreter" not in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr


@requires_triton
def test_interpreter_adaptation_loads_with_an_interpreted_launch_only() -> None:
    # Choosing the backend imports neither triton nor the interpreter's adaptation; an
    # interpreted launch (CPU tensors, the triton backend) loads it, once.
    result = _run(
        """
        import sys
        import torch
        import rlobjectives
        from rlobjectives._core.backend import lm_head_backend
        with rlobjectives.use_backend("triton"):
            assert lm_head_backend("cpu", dtype=torch.float32) == "triton"
            assert "rlobjectives.kernels.interpreter" not in sys.modules
            rlobjectives.token_log_probs_from_hidden(torch.ones(1, 2, 3), torch.ones(4, 3),
                                                     torch.zeros(1, 2, dtype=torch.long))
        assert "rlobjectives.kernels.interpreter" in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr


def _function_names(loss: torch.Tensor) -> set[str]:
    """Names of the autograd nodes behind ``loss``."""
    names: set[str] = set()
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            names.add(type(node).__name__)
            stack.extend(parent for parent, _ in node.next_functions)
    return names


@requires_triton
def test_the_hidden_state_functions_take_the_kernels() -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 4, generator=generator, requires_grad=True)
    weight = torch.randn(9, 4, generator=generator, requires_grad=True)
    tokens = torch.randint(0, 9, (2, 3), generator=generator)
    with use_backend("triton"):
        log_probs = rlo.token_log_probs_from_hidden(hidden, weight, tokens)
        assert "TritonLogProbsBackward" in _function_names(log_probs.sum())
        out = rlo.fused_policy_loss_from_hidden(
            hidden, weight, tokens, torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3)
        )
        assert "TritonLogProbsBackward" in _function_names(out.loss)
    with use_backend("torch"):
        log_probs = rlo.token_log_probs_from_hidden(hidden, weight, tokens)
        assert "TritonLogProbsBackward" not in _function_names(log_probs.sum())


@requires_triton
def test_interpreter_works_after_triton_was_imported_in_compiled_mode() -> None:
    # torch._dynamo imports triton (compiled mode) before the kernels are first needed.
    result = _run(
        """
        import torch, torch._dynamo, sys
        assert "triton" in sys.modules
        import rlobjectives
        with rlobjectives.use_backend("triton"):
            out = rlobjectives.token_log_probs_from_hidden(
                torch.zeros(1, 3, 2), torch.zeros(4, 2), torch.zeros(1, 3, dtype=torch.long))
        assert torch.allclose(out, torch.full((1, 3), -1.3862944)), out
        import triton.runtime.jit as jit
        assert jit.JITFunction.__call__.__name__ == "__call__"  # restored after the launch
        """
    )
    assert result.returncode == 0, result.stderr
