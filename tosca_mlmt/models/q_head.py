"""The writer's Q head: Q(s, a) for each strategy a, a linear map over the writer's last hidden state.

Fitted by ``train-upper`` (upper/critic.py) and saved beside the writer's adapter
(PolicyPair.save_role); collection picks strategies by it once it was fitted on enough decisions
(``episode.min_q_decisions``). Its own module: the learner that fits it needs the head, not the pair.
"""

from __future__ import annotations

import torch
from torch import nn

from tosca_mlmt.tensors import onto


class QHead(nn.Module):
    """Q(s, a) for every strategy a, read from the writer's last hidden state of s.

    ``mean`` / ``scale`` standardise h(s) per feature before the linear map (identity until
    ``set_feature_stats``; see upper.q_standardize). Heads saved without them load as identity.

    ``signals`` > 0 adds a table T[o, a] (upper.q_signal): Q(s, a) = w_a . h~(s) + b_a + T[o(s), a],
    where o(s) is what episode.writer_sees told the writer about the last attempt (its bucket
    index, rollout/turns.py: _writer_signal). A few hundred decisions fit a table of 2-3 x A
    cells; they do not fit a direction in 576 standardised features."""

    def __init__(self, hidden: int, n_actions: int, signals: int = 0):
        super().__init__()
        self.proj = nn.Linear(hidden, n_actions)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
        self.register_buffer("mean", torch.zeros(hidden))
        self.register_buffer("scale", torch.ones(hidden))
        self.signal_table = nn.Parameter(torch.zeros(signals, n_actions)) if signals else None

    def forward(self, h: torch.Tensor, signal: torch.Tensor | None = None) -> torch.Tensor:  # [B, H], [B] -> [B, A]
        h, = onto(self, h)  # host in, host out: the device rule of tensors.onto
        q = self.proj((h.float() - self.mean) / self.scale)
        if self.signal_table is not None and signal is not None:
            q = q + self.signal_table[onto(self, signal.long())[0]]
        return q.cpu()

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor]) -> "QHead":
        """A head shaped by, and loaded with, a saved head's tensors (with or without a table)."""
        table = sd.get("signal_table")
        head = cls(sd["proj.weight"].shape[1], sd["proj.weight"].shape[0], 0 if table is None else table.shape[0])
        head.load_state_dict(sd)
        return head

    def set_feature_stats(self, mean: torch.Tensor, scale: torch.Tensor) -> None:
        self.mean.copy_(mean.float())
        self.scale.copy_(scale.float())

    def has_feature_stats(self) -> bool:
        return bool(self.mean.any() or (self.scale != 1).any())

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # heads written before standardisation existed carry no stats: they are the identity
        for name, fill in (("mean", torch.zeros_like(self.mean)), ("scale", torch.ones_like(self.scale))):
            state_dict.setdefault(prefix + name, fill)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
