"""The low-level (solver) learner: PPO with the context-dependency bonus."""
