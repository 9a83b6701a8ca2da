"""tosca-mlmt: hierarchical RL (feedback writer + solver) for reasoning with textual feedback."""

__version__ = "0.1.0"
