"""Supervised terms over the sampled tokens.

:func:`rlobjectives.nll_loss` (the SFT term with its own normaliser) and
:func:`rlobjectives.dft_loss` (Dynamic Fine-Tuning).
"""
