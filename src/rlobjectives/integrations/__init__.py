"""Integrations with RL trainers (optional extras; importing this package imports no trainer).

- :mod:`rlobjectives.integrations.trl`: a TRL ``GRPOTrainer`` whose loss is computed by this
  library (``pip install 'rlobjectives[trl]'``).
"""

__all__: list[str] = []
