"""GRPO with rlobjectives on a tiny, randomly initialised Hugging Face causal LM (no download).

The loop is the one of ``rlobjectives demo`` (warm start, then GRPO with
``group_relative_advantages``, ``kl_penalized_rewards``, ``policy_loss`` and the global token
normaliser); only the model changes: a ``transformers`` GPT-2 built from a config. What a real
model needs is in :func:`hf_forward`, and in :func:`rlobjectives.response_log_probs`, which the
loop calls on the logits (see :func:`rlobjectives.demo.response_log_probs`):

- the attention mask comes from the sampler (never from token ids: a sampled token may equal
  the padding id), and position ids count only real tokens, so a left-padded prompt gets
  exactly the logits of the unpadded one;
- the logits at position ``s`` predict token ``s + 1`` (the one-token shift): response token ``j``
  of a prompt of padded length ``P`` is scored by the logits at position ``P + j - 1``;
- the loss mask selects the response tokens up to and including the end token: never the prompt,
  never the padding after the end token.

With ``--packed`` the GRPO updates run on packed (padding-free) sequences, the layout of
flash-attention's ``cu_seqlens`` (verl ``use_remove_padding``, TRL ``padding_free``): each
sequence is its prompt followed by its response, and the sequences of a batch are concatenated
into one row of ``N`` tokens with :func:`rlobjectives.pack` (see :func:`packed_grpo_step`):

- :func:`packed_forward` runs the row through the model with a block-diagonal causal attention
  mask and position ids that restart at each sequence, so every sequence gets exactly the logits
  it gets alone (no flash-attention needed);
- :func:`rlobjectives.response_log_probs` with ``cu_seqlens`` takes the one-token shift inside
  each sequence (it never crosses a boundary) and returns ``(N,)`` log-probs and response mask;
- :func:`rlobjectives.kl_penalized_rewards`, :func:`rlobjectives.global_normalizers` and
  :func:`rlobjectives.policy_loss` take the same ``cu_seqlens``; the ``(S,)`` advantages are
  broadcast to their tokens by the library.

Before training, :func:`first_step_losses` computes the loss of the first GRPO update on one
batch both ways and the run stops unless the packed loss equals the padded one.

Run (needs ``pip install transformers``, plus the demo extra ``tqdm matplotlib``)::

    python examples/grpo_transformers.py --out grpo-transformers
    python examples/grpo_transformers.py --packed --out grpo-transformers-packed
    torchrun --nproc_per_node=2 examples/grpo_transformers.py --out grpo-transformers
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import rlobjectives as rlo
from rlobjectives.demo import DemoConfig, DigitTask, sample_responses, train
from rlobjectives.demo import response_log_probs as padded_response_log_probs
from rlobjectives.distributed import normalizer_for_reduction


def hf_forward(
    model: nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Logits ``(B, S, V)`` of a Hugging Face causal LM for token ids ``(B, S)`` with padding.

    Padding (``attention_mask`` False: left of a prompt, right of a finished response) is masked
    out of attention and does not advance the position ids, so a left-padded prompt gets exactly
    the logits of the unpadded one.
    """
    mask = attention_mask.long()  # (B, S)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, S)
    output = model(input_ids=tokens, attention_mask=mask, position_ids=position_ids)
    return output.logits  # type: ignore[no-any-return]


def tiny_gpt2(task: DigitTask, *, hidden_size: int = 64, num_layers: int = 2) -> GPT2LMHeadModel:
    """A randomly initialised GPT-2 over the task's vocabulary, built from a config (no download).

    Dropout is off: with dropout on, the importance ratio of the on-policy first update would be
    noise instead of 1.
    """
    config = GPT2Config(
        vocab_size=task.vocab_size,
        n_positions=task.context_length,
        n_embd=hidden_size,
        n_layer=num_layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=task.end,
        eos_token_id=task.end,
        pad_token_id=task.pad,
    )
    return GPT2LMHeadModel(config)


# --------------------------------------------------------------------------------------------
# Packed sequences
# --------------------------------------------------------------------------------------------


def packed_forward(model: nn.Module, ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Logits ``(1, N, V)`` of the packed row ``ids`` ``(N,)`` of sequences ``cu_seqlens``.

    A block-diagonal causal mask (token ``j`` sees the tokens ``<= j`` of its own sequence) and
    position ids restarting at 0 in each sequence give every sequence the logits it gets alone.
    """
    tokens = ids.shape[0]
    sequence = torch.repeat_interleave(
        torch.arange(cu_seqlens.shape[0] - 1), cu_seqlens.diff(), output_size=tokens
    )  # (N,)
    positions = torch.arange(tokens)  # (N,)
    allowed = (sequence[:, None] == sequence[None, :]) & (positions[:, None] >= positions[None, :])
    dtype = next(model.parameters()).dtype
    mask = torch.zeros((tokens, tokens), dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    position_ids = positions - cu_seqlens[sequence]  # (N,)
    output = model(
        input_ids=ids[None], attention_mask=mask[None, None], position_ids=position_ids[None]
    )
    return output.logits  # type: ignore[no-any-return]


class PackedBatch(NamedTuple):
    """Sampled sequences, padded ``(B, L)`` (``[prompt, response, pad]``) and packed ``(N,)``."""

    tokens: torch.Tensor  # (B, L) prompt then response token ids
    attention: torch.Tensor  # (B, L) True at the prompt and at the response up to its end token
    prompt_length: int

    @property
    def packed(self) -> rlo.PackedTokens:
        return rlo.pack(self.tokens, self.attention)  # ids (N,), cu_seqlens (S + 1,)

    def rows(self, rows: torch.Tensor) -> PackedBatch:
        return PackedBatch(self.tokens[rows], self.attention[rows], self.prompt_length)

    def select(self, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The packed ``(N,)`` values of this batch restricted to ``rows``, packed again."""
        padded = rlo.unpack(values, self.packed.cu_seqlens, length=self.tokens.shape[1])
        return rlo.pack(padded.values[rows], self.attention[rows]).values


def packed_log_probs(model: nn.Module, batch: PackedBatch) -> rlo.ResponseLogProbs:
    """``(N,)`` response-token log-probs and response mask of the packed batch."""
    ids, cu_seqlens = batch.packed
    prompt_lengths = torch.full((cu_seqlens.shape[0] - 1,), batch.prompt_length)
    logits = packed_forward(model, ids, cu_seqlens)  # (1, N, V)
    return rlo.response_log_probs(logits[0], ids, prompt_lengths, None, cu_seqlens=cu_seqlens)


def _sample_batch(
    model: nn.Module,
    task: DigitTask,
    config: DemoConfig,
    generator: torch.Generator,
    prompt_generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's share of the step's prompts, G samples each: digits, prompts, responses, mask."""
    rank, world_size = _rank_and_world_size()
    digits = task.sample_digits(config.prompts_per_step, prompt_generator, held_out=False)
    count = config.prompts_per_step
    digits = digits[rank * count // world_size : (rank + 1) * count // world_size]
    digits = digits.repeat_interleave(config.group_size, dim=0)  # (B, n), groups contiguous
    prompts = task.prompts(digits)  # (B, P)
    model.eval()
    responses, mask = sample_responses(
        model, prompts, max_new_tokens=task.max_response_length, end=task.end, pad=task.pad,
        generator=generator, forward=hf_forward,
    )  # fmt: skip
    return digits, prompts, responses, mask


def _rank_and_world_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _packed_update(
    model: nn.Module,
    batch: PackedBatch,
    old: torch.Tensor,
    advantages: torch.Tensor,
    config: DemoConfig,
    task: DigitTask,
) -> rlo.PolicyLossOutput:
    """The policy loss of one minibatch on packed sequences, with the global normaliser."""
    ids, cu_seqlens = batch.packed
    out = packed_log_probs(model, batch)
    counts = rlo.global_normalizers(out.mask, cu_seqlens=cu_seqlens)  # exact over all ranks
    return rlo.policy_loss(
        out.log_probs, old, advantages, out.mask,
        surrogate=rlo.Clip(low=config.clip_low, high=config.clip_high), reduction=config.reduction,
        normalizer=normalizer_for_reduction(counts, reduction=config.reduction),
        max_response_length=task.max_response_length, diagnostics_normalizer=counts.tokens,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip


def packed_grpo_step(
    model: nn.Module,
    reference: nn.Module,
    optimizer: torch.optim.Optimizer,
    task: DigitTask,
    config: DemoConfig,
    generator: torch.Generator,
    prompt_generator: torch.Generator,
    *,
    forward: object = None,
) -> dict[str, float]:
    """One GRPO step of the demo's loop (same sampling, metrics), the math on packed sequences."""
    policy = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    digits, prompts, responses, mask = _sample_batch(
        policy, task, config, generator, prompt_generator
    )
    scores = task.rewards(digits, responses)
    attention = torch.cat([torch.ones_like(prompts, dtype=torch.bool), mask], dim=1)
    batch = PackedBatch(torch.cat([prompts, responses], dim=1), attention, prompts.shape[1])
    cu_seqlens = batch.packed.cu_seqlens
    with torch.no_grad():
        old = packed_log_probs(policy, batch)
        ref = packed_log_probs(reference, batch)
    penalized = rlo.kl_penalized_rewards(
        old.log_probs, ref.log_probs, scores.reward, old.mask, config.beta, cu_seqlens=cu_seqlens
    )
    advantages = rlo.group_relative_advantages(penalized["penalized_rewards"], config.group_size)
    policy.train()
    scale = rlo.data_parallel_loss_scale()
    diagnostics, losses = [], []
    for _ in range(config.epochs):
        for rows in torch.randperm(prompts.shape[0], generator=generator).chunk(config.minibatches):
            output = _packed_update(
                model, batch.rows(rows), batch.select(old.log_probs, rows), advantages[rows],
                config, task,
            )  # fmt: skip
            optimizer.zero_grad(set_to_none=True)
            (output.loss * scale).backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            diagnostics.append(output.diagnostics)
            losses.append(output.loss.detach())
    step = rlo.sum_diagnostics(diagnostics)  # summed over updates and ranks
    totals = torch.stack(
        [
            scores.reward.sum(), scores.exact_match.sum(),
            penalized["sampled_divergences"].sum(), mask.sum().float(),
            torch.tensor(float(prompts.shape[0])), torch.stack(losses).sum(),
        ]
    )  # fmt: skip
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    sequences, updates = float(totals[4]), len(diagnostics)
    return {
        "reward": float(totals[0]) / sequences,
        "accuracy": float(totals[1]) / sequences,
        "kl": float(totals[2]) / sequences,
        "response_length": float(totals[3]) / sequences,
        "loss": float(totals[5]) / updates,
        "clip_fraction": float(step.clip_fraction_low + step.clip_fraction_high) / updates,
        "clip_fraction_low": float(step.clip_fraction_low) / updates,
        "clip_fraction_high": float(step.clip_fraction_high) / updates,
        "ratio_mean": float(step.ratio_mean) / updates,
        "approx_kl": float(step.approx_kl_k3) / updates,
    }


def first_step_losses(
    model: nn.Module, task: DigitTask, config: DemoConfig, *, seed: int = 0
) -> tuple[float, float]:
    """The loss of the first GRPO update on one sampled batch, padded and packed: equal.

    The padded path is the demo's (``[prompt, response]`` rows, :func:`hf_forward`); the packed
    path is :func:`packed_grpo_step`'s. Both use the reference = the policy (first step) and the
    whole batch as the minibatch, with its global token normaliser.
    """
    generator = torch.Generator().manual_seed(seed)
    digits, prompts, responses, mask = _sample_batch(
        model, task, config, generator, torch.Generator().manual_seed(seed + 1)
    )
    scores = task.rewards(digits, responses).reward
    with torch.no_grad():
        padded = padded_response_log_probs(model, prompts, responses, mask, forward=hf_forward)
        penalized = rlo.kl_penalized_rewards(padded, padded, scores, mask, config.beta)
        rewards = penalized["penalized_rewards"]
        advantages = rlo.group_relative_advantages(rewards, config.group_size)
        counts = rlo.global_normalizers(mask)
        padded_loss = rlo.policy_loss(
            padded, padded, advantages, mask,
            surrogate=rlo.Clip(low=config.clip_low, high=config.clip_high),
            reduction=config.reduction,
            normalizer=normalizer_for_reduction(counts, reduction=config.reduction),
            max_response_length=task.max_response_length,
        ).loss  # fmt: skip
        attention = torch.cat([torch.ones_like(prompts, dtype=torch.bool), mask], dim=1)
        batch = PackedBatch(torch.cat([prompts, responses], dim=1), attention, prompts.shape[1])
        old = packed_log_probs(model, batch)
        penalized_packed = rlo.kl_penalized_rewards(
            old.log_probs, old.log_probs, scores, old.mask, config.beta,
            cu_seqlens=batch.packed.cu_seqlens,
        )  # fmt: skip
        advantages_packed = rlo.group_relative_advantages(
            penalized_packed["penalized_rewards"], config.group_size
        )
        packed_loss = _packed_update(model, batch, old.log_probs, advantages_packed, config, task)
    return float(padded_loss), float(packed_loss.loss)


def main(argv: Sequence[str] | None = None) -> int:
    defaults = DemoConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="grpo-transformers", help="output folder")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="GRPO steps")
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--eval-size", type=int, default=defaults.eval_size)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--packed", action="store_true", help="GRPO updates on packed (padding-free) sequences"
    )
    values = parser.parse_args(argv)
    config = DemoConfig(
        out=values.out,
        seed=values.seed,
        steps=values.steps,
        warmup_steps=values.warmup_steps,
        prompts_per_step=values.prompts_per_step,
        group_size=values.group_size,
        eval_every=values.eval_every,
        eval_size=values.eval_size,
        progress=not values.no_progress,
    )
    task = DigitTask(config.task, length=config.length)
    torch.manual_seed(config.seed)
    model = tiny_gpt2(task, hidden_size=config.hidden_size, num_layers=config.num_layers)
    step_function = None
    if values.packed:
        padded_loss, packed_loss = first_step_losses(model, task, config, seed=config.seed)
        print(f"first-step loss: padded {padded_loss:.8f}, packed {packed_loss:.8f}")
        if not math.isclose(packed_loss, padded_loss, rel_tol=1e-5, abs_tol=1e-6):
            print("the packed loss differs from the padded loss", file=sys.stderr)
            return 1
        step_function = packed_grpo_step
    result = train(config, model=model, forward=hf_forward, custom_step=step_function)
    return 130 if result.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
