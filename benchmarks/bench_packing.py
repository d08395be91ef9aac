"""Packed (padding-free) vs padded policy loss: the same responses in both layouts, one run.

The batch of issue 15: 64 responses with lengths drawn uniformly from 1 to 4096 (seed 0), padded
to ``B=64 T=4096`` (about half of the tokens are padding), or packed into one row of the ``N``
response tokens (``N = 140210`` for this draw, 0.535 of ``B T``) with ``cu_seqlens``. The
reference variant is our padded call, so the ``x ref`` column is packed time / padded time, to
compare with the token fraction ``N / (B T)`` (the target: ``x ref <= 1.2 N / (B T)``).

Cases: the default GRPO/DAPO loss (``token_mean``, per-sequence advantages), the per-sequence
path (GSPO ``ratio_level="sequence"`` with ``sequence_mean``), whose row sums go through the
packed layout's segment sums, and ``token_mean`` with per-token advantages in both layouts
(GAE / REINFORCE++), where both layouts do the same work per token. The packed calls include
validating ``cu_seqlens`` (one host read) and broadcasting the ``(S,)`` advantages. Backward with
respect to the log-probabilities. Floor: a copy of the packed bytes. The float32 cases also time
both layouts under ``torch.compile(fullgraph=True)`` (the packed call compiles with
``cu_seqlens``: its checks are skipped while tracing).
"""

from __future__ import annotations

from typing import Any

import torch

import harness
import rlobjectives

Inputs = harness.Inputs


def _make(batch: int, tokens: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    def make_inputs(device: torch.device) -> Inputs:
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(1, tokens + 1, (batch,), generator=generator)
        old_log_probs = -torch.rand(batch, tokens, generator=generator) * 3
        log_probs = old_log_probs + 0.3 * torch.randn(batch, tokens, generator=generator)
        mask = torch.arange(tokens).unsqueeze(0) < lengths.unsqueeze(1)  # (B, T) right-padded
        packed = {name: rlobjectives.pack(t, mask).values for name, t in (
            ("log_probs", log_probs), ("old_log_probs", old_log_probs)
        )}  # fmt: skip
        tensors = {
            "log_probs": log_probs.to(dtype),
            "old_log_probs": old_log_probs.to(dtype),
            "mask": mask,
            "advantages": torch.randn(batch, generator=generator),
            "packed_log_probs": packed["log_probs"].to(dtype),
            "packed_old_log_probs": packed["old_log_probs"].to(dtype),
            "packed_mask": torch.ones(int(lengths.sum()), dtype=torch.bool),
            "cu_seqlens": rlobjectives.pack(mask, mask).cu_seqlens,
        }
        # Per-token advantages (GAE, REINFORCE++): (B, T) padded, (1, N) packed.
        token_advantages = tensors["advantages"][:, None].expand(batch, tokens).contiguous()
        tensors["token_advantages"] = token_advantages
        tensors["packed_token_advantages"] = rlobjectives.pack(token_advantages, mask).values[None]
        return {name: tensor.to(device) for name, tensor in tensors.items()}

    return make_inputs


def _padded(options: dict[str, Any]):  # type: ignore[no-untyped-def]
    options = dict(options)
    advantages = options.pop("advantages", "advantages")

    def run(x: Inputs) -> torch.Tensor:
        return rlobjectives.policy_loss(
            x["log_probs"], x["old_log_probs"], x[advantages], x["mask"], **options
        ).loss

    return run


def _packed(options: dict[str, Any]):  # type: ignore[no-untyped-def]
    options = dict(options)
    advantages = "packed_" + options.pop("advantages", "advantages")
    advantages = "advantages" if advantages == "packed_advantages" else advantages

    def run(x: Inputs) -> torch.Tensor:
        return rlobjectives.policy_loss(
            x["packed_log_probs"],
            x["packed_old_log_probs"],
            x[advantages],
            x["packed_mask"],
            cu_seqlens=x["cu_seqlens"],
            **options,
        ).loss

    return run


OPTIONS: dict[str, dict[str, Any]] = {
    "token_mean": {},
    "gspo sequence_mean": {"ratio_level": "sequence", "reduction": "sequence_mean"},
    "token_mean, per-token advantages": {"advantages": "token_advantages"},
}


def packed_tokens(batch: int, tokens: int) -> int:
    """N of the benchmark batch (the same draw as ``make_inputs``)."""
    generator = torch.Generator().manual_seed(0)
    return int(torch.randint(1, tokens + 1, (batch,), generator=generator).sum())


def cases(*, quick: bool, device: str) -> list[harness.Case]:
    batch, tokens = (16, 1024) if quick else (64, 4096)
    dtypes = [torch.float32] if quick else [torch.float32, torch.bfloat16]
    count = packed_tokens(batch, tokens)
    result: list[harness.Case] = []
    for name, options in OPTIONS.items():
        for dtype in dtypes:
            element = torch.finfo(dtype).bits // 8
            forward_bytes = count * (2 * element + 1)
            variants = (
                harness.Variant("ours padded", _padded(options), role="reference"),
                harness.Variant("ours packed", _packed(options)),
            )
            if dtype == torch.float32 and not quick:  # the same under torch.compile
                variants += (
                    harness.Variant("ours padded", _padded(options), compile=True),
                    harness.Variant("ours packed", _packed(options), compile=True),
                )
            result.append(
                harness.Case(
                    operation=f"policy_loss packed vs padded, {name}",
                    shape=f"B={batch} T={tokens} N={count} ({count / (batch * tokens):.3f})",
                    dtype=dtype,
                    make_inputs=_make(batch, tokens, dtype),
                    grad_inputs=("log_probs", "packed_log_probs"),
                    variants=variants,
                    floor=harness.CopyFloor(forward_bytes, forward_bytes + count * element),
                )
            )
    return result
