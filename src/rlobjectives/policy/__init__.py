"""The policy-gradient loss: :func:`rlobjectives.policy_loss`, its surrogates and its paths.

``loss`` validates and dispatches; ``inputs`` holds the validated call and the named results;
``specification`` is the readable autograd path; ``fused`` the autograd Function of the
token-local surrogates; ``seeds`` the seed objective ``grpo_clipped_surrogate``; ``entropy`` the
high-entropy token mask.
"""
