"""Behaviour policy over the writer's discrete strategies.

Offline Q-learning (``train-upper``) needs pi_b(a|s) of every logged choice, so this
returns the full behaviour distribution next to each sampled strategy.
"""

from __future__ import annotations

import numpy as np

# Listed with the episode.strategy_selection knob: config/ may import only the ground floor, so
# the names live there and this module, which implements them, reads them.
from tosca_mlmt.config.episode import SELECTION_MODES as MODES


def behaviour_distribution(q: np.ndarray | None, n_actions: int, mode: str, temperature: float = 1.0,
                           epsilon: float = 0.1) -> np.ndarray:
    """pi_b(. | s) for a batch. q: [B, A] or None -> probs [B, A] (B = 1 when q is None)."""
    if mode not in MODES:
        raise ValueError(f"unknown strategy selection {mode!r}; allowed: {', '.join(MODES)}")
    if q is None or mode == "uniform":
        b = 1 if q is None else q.shape[0]
        return np.full((b, n_actions), 1.0 / n_actions)
    q = np.asarray(q, dtype=np.float64)
    if q.shape[1] != n_actions:
        raise ValueError(f"Q head has {q.shape[1]} actions but the strategy set has {n_actions}")
    greedy = np.zeros_like(q)
    greedy[np.arange(len(q)), q.argmax(1)] = 1.0
    if mode in ("auto", "softmax", "epsilon_softmax"):
        z = (q - q.max(1, keepdims=True)) / temperature
        e = np.exp(z)
        soft = e / e.sum(1, keepdims=True)
        # auto keeps epsilon of uniform exploration: Q fitted on few decisions must not stop the
        # collection of the strategies it has not seen
        return soft if mode == "softmax" else epsilon / n_actions + (1.0 - epsilon) * soft
    if mode == "epsilon_greedy":
        return epsilon / n_actions + (1.0 - epsilon) * greedy
    return greedy


def sample_strategies(probs: np.ndarray, batch: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Draw one strategy per state. Returns (actions [B], chosen probabilities [B])."""
    if probs.shape[0] == 1 and batch > 1:
        probs = np.repeat(probs, batch, axis=0)
    cum = probs.cumsum(1)
    u = rng.random(batch)[:, None]
    actions = np.minimum((u > cum).sum(1), probs.shape[1] - 1)
    return actions, probs[np.arange(batch), actions]
