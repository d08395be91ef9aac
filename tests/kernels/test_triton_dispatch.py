"""Backend dispatch: RLOBJECTIVES_KERNELS, lazy triton import, interpreter in any import order."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from backends import requires_triton
from rlobjectives import Clip
from rlobjectives._core.backend import ENV_VAR, kernel_backend, requested_backend, use_kernels
from rlobjectives.kernels.loading import interpreted


def test_default_is_auto_and_cpu_keeps_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert requested_backend() == "auto"
    assert kernel_backend("cpu") == "torch"
    monkeypatch.setenv(ENV_VAR, " Auto ")
    assert kernel_backend(torch.device("cpu")) == "torch"


def test_torch_overrides_everything() -> None:
    with use_kernels("torch"):
        assert kernel_backend("cpu") == "torch"
        assert kernel_backend("cuda") == "torch"


@requires_triton
def test_auto_uses_triton_for_cuda_tensors() -> None:
    with use_kernels("auto"):
        assert kernel_backend("cuda") == "triton"
        assert kernel_backend("cuda", dtype=torch.float64) == "torch"


@requires_triton
def test_triton_on_cpu_means_the_interpreter() -> None:
    with use_kernels("triton"):
        assert kernel_backend("cpu") == "triton"
        assert kernel_backend("cpu", dtype=torch.bfloat16) == "triton"
        assert kernel_backend("cpu", dtype=torch.float64) == "torch"  # kernels are float32
    assert interpreted("cpu")


def test_invalid_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=ENV_VAR):
        kernel_backend("cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        with use_kernels("fast"):
            pass


def test_use_kernels_restores_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "torch")
    with use_kernels("triton"):
        assert os.environ[ENV_VAR] == "triton"
    assert os.environ[ENV_VAR] == "torch"
    monkeypatch.delenv(ENV_VAR)
    with use_kernels("auto"):
        pass
    assert ENV_VAR not in os.environ


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
        # the dispatch of a CPU call (auto) does not import it either
        ones = torch.ones(2, 3)
        rlobjectives.policy_loss(ones, ones, torch.ones(2), ones.bool())
        rlobjectives.kl_loss(ones, ones, ones.bool(), estimator="k2")
        assert "triton" not in sys.modules, "triton imported by a CPU call"
        assert "rlobjectives.kernels.interpreter" not in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr


@requires_triton
def test_interpreter_adaptation_loads_with_an_interpreted_launch_only() -> None:
    # Choosing the backend imports neither triton nor the interpreter's adaptation; an
    # interpreted launch (CPU tensors, RLOBJECTIVES_KERNELS=triton) loads it, once.
    result = _run(
        """
        import sys
        import torch
        import rlobjectives
        from rlobjectives._core.backend import kernel_backend, use_kernels
        with use_kernels("triton"):
            assert kernel_backend("cpu") == "triton"
            assert "rlobjectives.kernels.interpreter" not in sys.modules
            ones = torch.ones(2, 3)
            rlobjectives.policy_loss(ones, ones, torch.ones(2), ones.bool())
        assert "rlobjectives.kernels.interpreter" in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr


@requires_triton
def test_traced_code_and_other_devices_take_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    with use_kernels("triton"):
        assert kernel_backend("meta") == "torch"  # the kernels run on CUDA or (interpreted) CPU
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert kernel_backend("cpu") == "torch"  # the launchers are not traceable
        assert kernel_backend("cuda") == "torch"


def _function_names(loss: torch.Tensor) -> set[str]:
    """Names of the autograd nodes behind ``loss``."""
    names, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and type(node).__name__ not in names:
            names.add(type(node).__name__)
            stack.extend(parent for parent, _ in node.next_functions)
    return names


@requires_triton
def test_public_functions_take_the_kernels_where_they_apply() -> None:
    # The dispatch table of docs/kernels.md: the kernels for token-level surrogates and their
    # options; PyTorch (silently) for GMPO/VESPO, float64, learnable hyperparameters and
    # differentiable kl_loss importance weights.
    import warnings

    from rlobjectives import kl_loss, policy_loss

    log_probs = torch.randn(2, 3, requires_grad=True)
    args = (torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3, dtype=torch.bool))
    kernel = "TokenLossFunctionBackward"
    with use_kernels("triton"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for options in (
            {},
            {"surrogate": "cispo"},
            {"ratio_level": "sequence", "surrogate": Clip(delta=1.5)},
        ):
            assert kernel in _function_names(policy_loss(log_probs, *args, **options).loss)
        entropy = {"entropy": torch.rand(2, 3), "entropy_coef": 0.1}
        assert kernel in _function_names(policy_loss(log_probs, *args, **entropy).loss)
        for options in (
            {"surrogate": "gmpo"},
            {"surrogate": Clip(low=torch.tensor(0.2, requires_grad=True))},
        ):
            assert kernel not in _function_names(policy_loss(log_probs, *args, **options).loss)
        double = log_probs.detach().double().requires_grad_(True)
        assert kernel not in _function_names(policy_loss(double, *args).loss)
        ref, mask = args[0], args[2]
        assert "KLLossFunctionBackward" in _function_names(kl_loss(log_probs, ref, mask))
        weights = torch.ones(2, 3, requires_grad=True)  # TRL's bias correction: autograd
        weighted = kl_loss(log_probs, ref, mask, importance_weights=weights)
        assert "KLLossFunctionBackward" not in _function_names(weighted)


@requires_triton
def test_interpreter_works_after_triton_was_imported_in_compiled_mode() -> None:
    # torch._dynamo imports triton (compiled mode) before the kernels are first needed.
    result = _run(
        """
        import torch, torch._dynamo, sys
        assert "triton" in sys.modules
        from rlobjectives._core.backend import use_kernels
        from rlobjectives.kernels.token_loss import token_loss_forward
        with use_kernels("triton"):
            out = token_loss_forward(torch.zeros(3), torch.zeros(3), torch.ones(3),
                                     torch.ones(3, dtype=torch.bool))
        assert float(out.sums.weighted_loss) == -3.0, out.sums
        import triton.runtime.jit as jit
        assert jit.JITFunction.__call__.__name__ == "__call__"  # restored after the launch
        """
    )
    assert result.returncode == 0, result.stderr
