"""The strategy critic: Q(s, .) (and V(s) for IQL) read from the writer's state features.

h(s) [B, H] is the writer's final-layer hidden state at the last token of the state
prompt (what ``PolicyPair.q_values`` reads at collect time). Two readings of Q:

* ``head``: ``QHead`` (the Linear in models/q_head.py, zero-init, so Q starts at 0 for every
  strategy). Its target network is a copy of the head applied to trunk features computed
  without gradient: the trunk is shared with the text policy and is not duplicated.
* ``logits`` (ToSCA): Q(s, a) = LM logit of the strategy-index token "a+1" at that same
  position = W_lm[tok_a] . h(s). That is a linear map of h(s) too, so the trained writer is
  saved as an *exactly equivalent* ``QHead`` (weights = those W_lm rows) and ``mlmt collect``
  reads it with no special case. W_lm is frozen, so Q moves only through the adapter, and
  the target network is a copy of the adapter (see ``trunk.TargetAdapter``). ToSCA appends
  a multiple-choice menu before reading the logits; we read them at the end of the state
  because that is the exact prefix collection scores.

V(s) is a separate linear head on detached features (IQL only): it is a training-time
estimate, not part of the saved writer.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tosca_mlmt.algos.qlearning import hard_update, polyak_update, target_due
from tosca_mlmt.config import UpperConfig
from tosca_mlmt.config.episode import SIGNAL_BUCKETS
from tosca_mlmt.errors import ConfigError
from tosca_mlmt.models.q_head import QHead
from tosca_mlmt.prompts import boundary_anchor, encode_piece
from tosca_mlmt.tensors import onto


class VHead(QHead):
    """V(s) from h(s): [B, H] -> [B]. Zero-init and standardised like QHead."""

    def __init__(self, hidden: int):
        super().__init__(hidden, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return super().forward(h).squeeze(-1)


class LogitsQ(nn.Module):
    """Q(s, a) = W_lm[tok_a] . h(s) (+ the LM head's bias, if any). No trainable parameters."""

    def __init__(self, rows: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("rows", rows.detach().float().clone())  # [A, H]
        self.register_buffer("bias", (bias.detach().float().clone() if bias is not None
                                      else torch.zeros(rows.shape[0])))  # [A]

    def forward(self, h: torch.Tensor, signal: torch.Tensor | None = None) -> torch.Tensor:  # [B, H] -> [B, A]
        h, = onto(self, h.float())  # host in, host out (tensors.onto)
        return nn.functional.linear(h, self.rows, self.bias).cpu()  # no signal table (q_signal needs a head)

    def as_q_head(self) -> QHead:
        head = QHead(self.rows.shape[1], self.rows.shape[0])
        with torch.no_grad():
            head.proj.weight.copy_(self.rows)
            head.proj.bias.copy_(self.bias)
        return head


def feature_stats(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature mean and scale of h(s) [N, H] -> ([H], [H]). The scale is floored at a tenth of
    the median feature's std: a feature that hardly varies over the logged states must not be
    blown up into the largest input of a fresh state."""
    f = features.float()
    mean = f.mean(0)
    std = f.std(0, unbiased=False) if len(f) > 1 else torch.ones_like(mean)
    floor = 0.1 * std.median() if bool(std.median() > 0) else torch.tensor(1.0)
    return mean, std.clamp_min(float(floor))


def strategy_token_ids(tokenizer, n_actions: int) -> list[int]:
    """Token ids of "1".."K": the logits option needs each index to be a single token."""
    ids, anchor = [], boundary_anchor(tokenizer)
    for k in range(1, n_actions + 1):
        enc = encode_piece(tokenizer, str(k), anchor)  # as inside a text: no SentencePiece "▁" in front
        if len(enc) != 1:
            raise ConfigError(f"invalid value for field 'upper.q_source': 'logits' needs every strategy index to be "
                              f"one token, but '{k}' is {len(enc)} tokens for this tokenizer; use q_source=head "
                              f"(or at most 9 strategies)")
        ids.append(enc[0])
    return ids


class StrategyCritic(nn.Module):
    def __init__(self, cfg: UpperConfig, hidden: int, n_actions: int, lm_rows: torch.Tensor | None = None,
                 lm_bias: torch.Tensor | None = None, init_head: QHead | None = None):
        super().__init__()
        self.cfg = cfg
        self.n_actions = n_actions
        if cfg.q_source == "head":
            # a continued head keeps the table it was fitted with
            table = cfg.q_signal or (init_head is not None and init_head.signal_table is not None)
            self.q = QHead(hidden, n_actions, SIGNAL_BUCKETS if table else 0)
            if init_head is not None:  # continue from a saved writer's head
                sd = dict(init_head.state_dict())
                if table:  # a head saved without a table starts with a zero one
                    sd.setdefault("signal_table", torch.zeros_like(self.q.signal_table))
                self.q.load_state_dict(sd)
            self.q_target = copy.deepcopy(self.q).requires_grad_(False)
        else:
            if lm_rows is None:
                raise ValueError("q_source=logits needs the LM head rows of the strategy tokens")
            self.q = LogitsQ(lm_rows, lm_bias)
            self.q_target = self.q  # no parameters: the target lives in the adapter copy
        self.v = VHead(hidden) if cfg.conservatism == "iql" else None

    def _fresh_heads(self) -> list[QHead]:
        """The linear heads upper.q_standardize fixes stats for: a fresh Q head (a head continued from a
        saved writer keeps the stats it was fitted with: new stats would change what its weights mean)
        with its target, and the IQL V head, fresh in every run, whichever head Q is read from."""
        heads = []
        if self.cfg.q_standardize and self.cfg.q_source == "head" and not self.q.has_feature_stats():
            heads += [self.q, self.q_target]
        if self.cfg.q_standardize and self.v is not None and not self.v.has_feature_stats():
            heads.append(self.v)
        return heads

    def needs_feature_stats(self) -> bool:
        return bool(self._fresh_heads())

    def set_feature_stats(self, features: torch.Tensor) -> None:
        """Fix the fresh heads' per-feature standardisation from h(s) of the logged states [N, H]."""
        mean, std = feature_stats(features)
        for head in self._fresh_heads():
            head.set_feature_stats(mean, std)

    def head_parameters(self) -> list[nn.Parameter]:
        """Trainable head parameters but the signal table (empty for logits without IQL)."""
        params = [p for n, p in self.q.named_parameters() if n != "signal_table"] if self.cfg.q_source == "head" else []
        if self.v is not None:
            params += list(self.v.parameters())
        return params

    def table_parameters(self) -> list[nn.Parameter]:
        """The signal table (upper.q_signal; its own learning rate, upper.signal_lr), or nothing."""
        table = getattr(self.q, "signal_table", None)
        return [table] if table is not None else []

    def update_target(self, step: int) -> bool:
        """Move the head's target after optimiser step ``step``; True if it moved."""
        if self.cfg.q_source != "head" or not target_due(step, self.cfg.target_update, self.cfg.target_sync_every):
            return False
        online, target = list(self.q.parameters()), list(self.q_target.parameters())
        if self.cfg.target_update == "polyak":
            polyak_update(target, online, self.cfg.target_tau)
        else:
            hard_update(target, online)
        return True

    def exported_head(self) -> QHead:
        """The Q head the saved writer carries (collect computes softmax over it)."""
        if isinstance(self.q, LogitsQ):
            return self.q.as_q_head()
        return QHead.from_state_dict({k: v.detach().clone() for k, v in self.q.state_dict().items()})
