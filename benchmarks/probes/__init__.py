"""Probes: offline questions about stored runs (base rates, verifier changes, strategy signal)."""
