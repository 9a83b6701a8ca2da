"""The high-level (feedback writer) learner: offline strategic Q-learning + AWR."""
