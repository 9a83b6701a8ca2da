"""Pure RL math: advantage estimators, policy/value losses, Q-learning targets (registries)."""
