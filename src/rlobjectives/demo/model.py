"""A tiny causal transformer in plain PyTorch: the policy of the demo (no downloads)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyTransformer"]


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.attention_norm = nn.LayerNorm(hidden_size)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.attention_out = nn.Linear(hidden_size, hidden_size)
        self.mlp_norm = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, 4 * hidden_size),
            nn.GELU(),
            nn.Linear(4 * hidden_size, hidden_size),
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, size = hidden.shape
        qkv = self.qkv(self.attention_norm(hidden))  # (B, S, 3H)
        query, key, value = qkv.view(batch, length, 3, self.num_heads, -1).unbind(2)
        attended = F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), is_causal=True
        )  # (B, heads, S, H / heads)
        hidden = hidden + self.attention_out(attended.transpose(1, 2).reshape(batch, length, size))
        return hidden + self.mlp(self.mlp_norm(hidden))  # type: ignore[no-any-return]  # (B, S, H)


class TinyTransformer(nn.Module):
    """Decoder-only transformer, learned positions: token ids ``(B, S)`` -> logits ``(B, S, V)``.

    Args:
        vocab_size: number of token ids ``V``.
        context_length: longest sequence ``S`` the position table covers.
        hidden_size: model width ``H``.
        num_layers: number of transformer blocks.
        num_heads: attention heads (must divide ``hidden_size``).
    """

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        *,
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
    ) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(
                f"hidden_size must be divisible by num_heads, got hidden_size={hidden_size} and "
                f"num_heads={num_heads}"
            )
        self.context_length = context_length
        self.token_embedding = nn.Embedding(vocab_size, hidden_size)
        self.position_embedding = nn.Embedding(context_length, hidden_size)
        self.blocks = nn.ModuleList(_Block(hidden_size, num_heads) for _ in range(num_layers))
        self.final_norm = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states ``(B, S, H)`` after the final norm (the head's input) of ``tokens``."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)  # (S,)
        hidden = self.token_embedding(tokens) + self.position_embedding(positions)  # (B, S, H)
        for block in self.blocks:
            hidden = block(hidden)
        return self.final_norm(hidden)  # type: ignore[no-any-return]  # (B, S, H)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, S, V)`` of the next token at every position of ``tokens`` ``(B, S)``."""
        return self.head(self.hidden_states(tokens))  # type: ignore[no-any-return]  # (B, S, V)
