"""KL terms: the sampled estimators, the KL loss, KL-penalised rewards and the KL controllers."""
