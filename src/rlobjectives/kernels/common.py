"""Host-side helpers of the launchers: argument checks, launch sizes, first-order backward."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

_Function = TypeVar("_Function", bound=Callable[..., Any])

__all__ = [
    "KERNEL_DTYPES",
    "first_order_only",
    "on_tensor_device",
    "check_mask",
    "grid_blocks",
    "mask_bytes",
]

# Input dtypes the kernels read (the math is float32 for all of them).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device})"
    return type(value).__name__


def check_mask(mask: object, count: int, device: torch.device) -> torch.Tensor:
    """The bool ``(N,)`` mask on ``device`` (else raise)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {_describe(mask)}")
    if tuple(mask.shape) != (count,) or mask.device != device:
        raise ValueError(f"mask must have shape ({count},) on {device}, got {_describe(mask)}")
    return mask.contiguous()


def mask_bytes(mask: torch.Tensor) -> torch.Tensor:
    """The bool mask viewed as uint8 (no copy): kernels test ``!= 0``."""
    return mask.view(torch.uint8)


def grid_blocks(count: int, block: int) -> int:
    """Number of programs for ``count`` items in blocks of ``block`` (at least one)."""
    return max(1, -(-count // block))


def on_tensor_device(function: _Function) -> _Function:
    """Run a launcher with its first tensor's CUDA device current.

    Triton launches on ``torch.cuda.current_device()``; a tensor on another GPU would be read
    through the wrong context. The check costs one ``current_device()`` call.
    """

    @functools.wraps(function)
    def wrapper(first: Any, *args: Any, **kwargs: Any) -> Any:
        device = first.device if isinstance(first, torch.Tensor) else None
        if (
            device is not None
            and device.type == "cuda"
            and device.index is not None
            and device.index != torch.cuda.current_device()
        ):
            with torch.cuda.device(device):
                return function(first, *args, **kwargs)
        return function(first, *args, **kwargs)

    return cast(_Function, wrapper)


_FIRST_ORDER = b"rlobjectives: the Triton kernel path supports first-order gradients only"


def first_order_only(backward: _Function) -> _Function:
    """Decorate an autograd ``backward``: no graph inside, and its gradients not differentiable.

    Where ``torch.autograd.function.once_differentiable`` gives a double backward gradients that
    silently do not require grad (when the incoming gradient does not), differentiating these
    raises, as the fused PyTorch path's do (``backward(create_graph=True)``).
    """

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        differentiable = torch.is_grad_enabled()
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not differentiable or torch.compiler.is_compiling():
            return outputs
        return tuple(
            output
            if not isinstance(output, torch.Tensor)
            else torch._C._functions.DelayedError(_FIRST_ORDER, 1)(
                output.detach().requires_grad_(True)
            )
            for output in outputs
        )

    return cast(_Function, wrapper)
