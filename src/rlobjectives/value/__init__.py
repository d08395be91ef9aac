"""The PPO critic's loss (:func:`rlobjectives.value_loss`)."""
