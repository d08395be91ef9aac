"""The public functions' wiring onto the Triton launchers.

A validated call in, the library's
named results out (``policy`` for the policy loss and the seed, ``kl`` for the KL functions,
``head`` for the hidden-state functions).
"""
