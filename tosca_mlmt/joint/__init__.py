"""The hierarchical loop: collect -> train-upper -> train-lower, round after round."""
