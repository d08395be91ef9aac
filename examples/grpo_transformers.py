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

Run (needs ``pip install transformers``, plus the demo extra ``tqdm matplotlib``)::

    python examples/grpo_transformers.py --out grpo-transformers
    torchrun --nproc_per_node=2 examples/grpo_transformers.py --out grpo-transformers
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from rlobjectives.demo import DemoConfig, DigitTask, train


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
    result = train(config, model=model, forward=hf_forward)
    return 130 if result.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
