"""Advantage estimators.

Outcome rewards (GRPO, RLOO, OPO, pass@k, ReMax), GAE and REINFORCE++,
masked whitening and the groups of responses they normalise over.
"""
