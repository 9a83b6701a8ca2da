"""Learning: does training move accuracy, per method, seed and environment."""
