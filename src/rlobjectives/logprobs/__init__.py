"""Log-probabilities.

From logits (and their entropy and full-vocabulary KL), the causal-LM
alignment of responses, and straight from hidden states and the LM head, chunk by chunk (with
the fused policy loss :func:`rlobjectives.fused_policy_loss_from_hidden`).
"""
