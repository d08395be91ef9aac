"""The policy-gradient loss: :func:`rlobjectives.policy_loss`, its surrogates and its variants.

``call`` validates a call once and holds its records and results; ``loss`` is the one path
(the tokens, the surrogate's formula, the reduction, the diagnostics; compiled on request);
``surrogates`` the objects, one formula each; ``from_hidden`` and ``composition`` the loss from
hidden states; ``grpo_surrogate`` the dictionary-returning ``grpo_clipped_surrogate``; ``nll``
the SFT term; ``entropy`` the high-entropy token mask; ``selection`` the batch-level selections.
"""
