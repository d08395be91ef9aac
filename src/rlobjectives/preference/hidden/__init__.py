"""The preference and KTO losses from hidden states and the LM head (no ``(N, V)`` logits)."""

from .kto import kto_loss_from_hidden
from .pairs import preference_loss_from_hidden

__all__ = ["kto_loss_from_hidden", "preference_loss_from_hidden"]
