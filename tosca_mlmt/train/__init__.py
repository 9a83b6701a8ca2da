"""Training building blocks shared by the upper and lower trainers."""
