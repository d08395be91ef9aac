"""Rollout correction.

Sampler/trainer mismatch weights and masks, their metrics, and TRL's
off-policy sequence mask.
"""
