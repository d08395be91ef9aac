"""Integrations with RL trainers (optional extras; importing this package imports no trainer).

- :mod:`rlobjectives.integrations.trl`: a TRL ``GRPOTrainer`` whose loss is computed by this
  library (``pip install 'rlobjectives[trl]'``).
- :mod:`rlobjectives.integrations.verl`: importing it registers the verl presets with verl's
  ``register_policy_loss`` as ``rlo_<mode>`` (verl's ``external_lib``).
- :mod:`rlobjectives.integrations.openrlhf`: ``install_policy_loss`` makes OpenRLHF's actor
  build the preset where it builds ``PolicyLoss`` (a Ray worker set-up hook).
"""

__all__: list[str] = []
