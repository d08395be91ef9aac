"""The model plumbing of the demo: calling the model, sampling responses, scoring their tokens.

Everything here is the part of an RL trainer that is not RL math: autoregressive sampling with
its masks, and the log-probabilities of the sampled tokens, whose one-token shift and float32
log-softmax come from :func:`rlobjectives.response_log_probs`.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import response_log_probs as library_response_log_probs
from .config import Forward

__all__ = ["default_forward", "response_log_probs", "sample_responses"]


def default_forward(
    model: nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """The demo model's logits ``(B, S, V)`` of ``tokens`` ``(B, S)`` (it ignores the mask)."""
    # Causal attention: no real token ever sees the padding, which only follows the end token.
    return model(tokens)  # type: ignore[no-any-return]


@torch.no_grad()
def sample_responses(
    model: nn.Module,
    prompts: torch.Tensor,
    *,
    max_new_tokens: int,
    end: int,
    pad: int,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    forward: Forward = default_forward,
    rows: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample (or greedily decode) one response per prompt, stopping at the end token.

    ``rows = (offset, total)``: the prompts are the rows ``offset .. offset + B`` of a batch of
    ``total`` rows split over ranks. Each step then draws ``total`` uniforms from ``generator``
    (the same stream on every rank) and samples each row by the inverse CDF of its own
    uniform, so a row's response does not depend on how the batch is split (``--fsdp``: one
    process and two ranks train on the same samples).

    Args:
        model: the policy.
        prompts: ``(B, P)`` prompt token ids.
        max_new_tokens: response length ``R`` (responses without an end token are cut there).
        end: end-of-response token id (kept in the response and in its mask).
        pad: token written after the end token (outside the mask).
        generator: random generator of the sampling.
        greedy: take the most likely token instead of sampling.
        forward: ``(model, tokens, attention_mask) -> logits``.
        rows: ``(offset, total)`` of a batch split over ranks (see above), or None.

    Returns:
        ``responses`` ``(B, R)`` token ids and ``mask`` ``(B, R)`` bool: True up to and including
        the end token.
    """
    tokens = prompts  # (B, P)
    attention_mask = torch.ones_like(prompts, dtype=torch.bool)  # (B, P)
    finished = torch.zeros(prompts.shape[0], dtype=torch.bool, device=prompts.device)  # (B,)
    columns, mask_columns = [], []
    for _ in range(max_new_tokens):
        logits = forward(model, tokens, attention_mask)[:, -1].float()  # (B, V)
        if greedy:
            next_token = logits.argmax(-1)  # (B,)
        elif rows is None:
            probs = torch.softmax(logits, dim=-1)  # (B, V)
            next_token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
        else:
            offset, total = rows
            uniforms = torch.rand(total, generator=generator, dtype=torch.float64)  # every row
            mine = uniforms[offset : offset + logits.shape[0]]  # (B,) this call's rows
            next_token = _inverse_cdf(torch.softmax(logits, dim=-1), mine)
        next_token = torch.where(finished, pad, next_token)
        mask_columns.append(~finished)
        columns.append(next_token)
        finished = finished | (next_token == end)
        tokens = torch.cat([tokens, next_token.unsqueeze(-1)], dim=1)  # (B, P + step)
        attention_mask = torch.cat([attention_mask, ~finished.unsqueeze(-1)], dim=1)
    return torch.stack(columns, dim=1), torch.stack(mask_columns, dim=1)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token of each row whose CDF interval holds its uniform: ``(B, V), (B,) -> (B,)``.

    Row by row (the count of CDF values below the uniform), so no row depends on the others.
    """
    cdf = probs.double().cumsum(-1)  # (B, V)
    below = (cdf < (uniforms * cdf[:, -1]).unsqueeze(-1)).sum(-1)  # (B,)
    return below.clamp(max=probs.shape[-1] - 1)


def response_log_probs(
    model: nn.Module,
    prompts: torch.Tensor,
    responses: torch.Tensor,
    mask: torch.Tensor,
    *,
    prompt_mask: torch.Tensor | None = None,
    forward: Forward = default_forward,
) -> torch.Tensor:
    """Log-probabilities ``(B, R)`` of the response tokens given their prompts.

    The model reads ``[prompt, response]`` with the attention mask ``[prompt_mask, mask]``, and
    :func:`rlobjectives.response_log_probs` applies the one-token shift (the logits at position
    ``j - 1`` score the token at ``j``) and the float32 log-softmax. The masks come from the
    sampler, never from token ids: a sampled token may equal the padding id.

    Args:
        model: the policy or the reference policy.
        prompts: ``(B, P)`` prompt token ids (left-padded if their lengths differ).
        responses: ``(B, R)`` response token ids.
        mask: ``(B, R)`` bool response mask (True up to and including the end token).
        prompt_mask: ``(B, P)`` bool, False at left padding (default: all True).
        forward: ``(model, tokens, attention_mask) -> logits``.
        rows: ``(offset, total)`` of a batch split over ranks (see above), or None.

    Returns:
        ``(B, R)`` log-probabilities, float32 (float64 for a float64 model), 0 where ``mask`` is
        False; differentiable when grad is enabled.
    """
    if prompt_mask is None:
        prompt_mask = torch.ones_like(prompts, dtype=torch.bool)
    tokens = torch.cat([prompts, responses], dim=1)  # (B, P + R)
    attention_mask = torch.cat([prompt_mask, mask], dim=1)  # (B, P + R)
    logits = forward(model, tokens, attention_mask)  # (B, P + R, V)
    return library_response_log_probs(
        logits, tokens, prompt_mask.sum(-1), attention_mask, response_length=responses.shape[1]
    ).log_probs  # (B, R)
