"""The upper level's losses, composed from ``algos.qlearning``.

Strategy level, per decision (s, a, r, s', done):

    y      = r + gamma * (1 - done) * bootstrap(s')     max_a' Q_bar(s', a')  (cql, none)
                                                        V(s')                 (iql)
    L_TD   = (Q(s, a) - y)^2
    L_CQL  = alpha * [logsumexp_a Q(s, a) - Q(s, a)]                          (cql)
    L_V    = expectile_tau(Q_bar(s, a) - V(s))                                (iql)

Text level, per decision, on the logged feedback tokens only:

    L_text = w * mean_t[-log pi(g_t | s, a, g_<t)]
    w      = min(exp(A / beta), w_max)  (awr)   or   1[G >= top-fraction cut]  (filtered_bc)
    A      = Q(s, a) - V(s)  or  G - Q(s, a)   (upper.awr_advantage)

V(s) for AWR is the IQL head under iql; otherwise E_{a~pi}[Q(s, a)] under the strategy
policy ``mlmt collect`` will actually run with this Q (episode.strategy_selection).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tosca_mlmt.algos.qlearning import (BOOTSTRAPS, awr_weights, cql_penalty, effective_sample_size,
                                        expectile_loss, td_target)
from tosca_mlmt.strategies import behaviour_distribution
from tosca_mlmt.tensors import masked_mean
from tosca_mlmt.upper.critic import StrategyCritic


@dataclass
class DecisionBatch:
    actions: torch.Tensor  # [B] long
    rewards: torch.Tensor  # [B]
    dones: torch.Tensor  # [B] float, 1 after the last round
    returns: torch.Tensor  # [B] logged return-to-go G
    signals: torch.Tensor | None = None  # [B] long, o(s) (upper.q_signal); None = no table
    next_signals: torch.Tensor | None = None  # [B] long, o(s') (0 for terminal rows)


@dataclass
class PolicySpec:
    """How collect turns Q into strategy probabilities (episode.strategy_*)."""

    mode: str = "auto"
    temperature: float = 1.0
    epsilon: float = 0.1

    def probs(self, q: torch.Tensor) -> torch.Tensor:
        """pi(. | s) [B, A] from Q [B, A], through the very function collect uses."""
        p = behaviour_distribution(q.detach().cpu().double().numpy(), q.shape[-1], self.mode, self.temperature,
                                   self.epsilon)
        return torch.from_numpy(np.ascontiguousarray(p)).to(q.dtype)


def critic_loss(critic: StrategyCritic, b: DecisionBatch, h: torch.Tensor, h_bar: torch.Tensor,
                h_next: torch.Tensor | None, h_next_bar: torch.Tensor | None, gamma: float, alpha: float,
                tau: float, policy: PolicySpec) -> tuple[torch.Tensor, dict]:
    """Q-level loss and what the text loss and metrics need.

    h [B, H]: online features of s (with gradient if the trunk learns from TD);
    h_bar [B, H]: target-network features of s (only read by iql);
    h_next, h_next_bar [B, H] or None: online / target features of s' (rows of terminal
    decisions are ignored; None when the whole batch is terminal)."""
    cfg = critic.cfg
    q = critic.q(h, b.signals)  # [B, A]
    q_sa = q.gather(1, b.actions[:, None]).squeeze(1)  # [B]
    out: dict = {}
    loss = q.new_zeros(())
    with torch.no_grad():
        if cfg.conservatism == "iql":
            boot = critic.v(h_next).detach() if h_next is not None else q.new_zeros(len(q_sa))
            boot = BOOTSTRAPS["value"](v_next=boot)
        else:
            boot = critic.q_target(h_next_bar, b.next_signals) if h_next_bar is not None else q.new_zeros(q.shape)
            boot = BOOTSTRAPS["max"](q_next_target=boot)
        y = td_target(b.rewards, b.dones, boot, gamma)  # [B]
    td = (q_sa - y).pow(2).mean()
    loss = loss + td
    out["td_loss"] = td.detach()
    if cfg.conservatism == "cql":
        cql = cql_penalty(q, b.actions).mean()
        loss = loss + alpha * cql
        out["cql_term"] = cql.detach()
    if cfg.conservatism == "iql":
        v = critic.v(h.detach())  # [B]
        with torch.no_grad():
            q_bar_sa = critic.q_target(h_bar, b.signals).gather(1, b.actions[:, None]).squeeze(1)
        v_loss = expectile_loss(q_bar_sa - v, tau).mean()
        loss = loss + v_loss
        out["v_loss"] = v_loss.detach()
        v_s = v.detach()
    else:
        v_s = (policy.probs(q) * q.detach()).sum(-1)  # E_{a~pi}[Q(s, a)]
    out.update(q=q.detach(), q_sa=q_sa.detach(), v=v_s, target=y)
    return loss, out


def advantages(q_sa: torch.Tensor, v: torch.Tensor, returns: torch.Tensor, kind: str) -> torch.Tensor:
    """A [B] for the text weights (detached)."""
    if kind == "q_minus_v":
        return (q_sa - v).detach()
    if kind == "return_minus_q":
        return (returns - q_sa).detach()
    raise ValueError(f"unknown advantage {kind!r}")


def bc_threshold(all_returns: torch.Tensor, top_frac: float) -> tuple[float, bool]:
    """Cut for filtered BC over the whole dataset: (threshold, strict). Keep G >= cut, or G > cut
    when the cut equals the lowest return (ties at the bottom must not pass as 'top')."""
    cut = float(torch.quantile(all_returns.double(), 1.0 - top_frac))
    strict = cut <= float(all_returns.min()) and float(all_returns.max()) > cut
    return cut, strict


def text_weights(kind: str, adv: torch.Tensor | None, returns: torch.Tensor, beta: float, max_weight: float,
                 cut: tuple[float, bool] | None = None, rewards: torch.Tensor | None = None) -> torch.Tensor:
    """Per-decision weights [B] of the feedback-text loss. ``improved_bc``: 1 on the decisions whose
    own round reward is positive (under improvement/counterfactual rewards: the refine fixed the
    answer), 0 elsewhere: the text is cloned only from feedback that helped."""
    if kind == "awr":
        return awr_weights(adv, beta, max_weight)
    if kind == "improved_bc":
        return (rewards > 0).float()
    if kind == "filtered_bc":
        thr, strict = cut
        return ((returns > thr) if strict else (returns >= thr)).float()
    raise ValueError(f"unknown text loss {kind!r}")


def text_loss(logp: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor,
              over: int | None = None) -> tuple[torch.Tensor, dict]:
    """Weighted NLL of the feedback tokens: 1/N sum_b w_b * mean_t[-log pi] (mask = feedback tokens).

    logp, mask [B, T]; weights [B]. Each decision's text counts once whatever its length. ``over``:
    N when the B rows are the weighted part of a batch of N decisions (the rest weigh 0); else B."""
    nll = masked_mean(-logp, mask, dim=1)  # [B]
    loss = (weights * nll).sum() / (over or len(nll))
    return loss, {"text_nll": nll.mean().detach(), "weights": weights.detach()}


def advantage_stats(adv: torch.Tensor) -> dict[str, float]:
    return {"adv_mean": float(adv.mean()), "adv_std": float(adv.std()) if len(adv) > 1 else 0.0,
            "adv_min": float(adv.min()), "adv_max": float(adv.max())}


def weight_stats(w: torch.Tensor) -> dict[str, float]:
    """Text weights: mean, max and the effective sample size as a fraction of the batch (1 = all
    decisions count equally; small = a few decisions dominate the text update)."""
    return {"w_mean": float(w.mean()), "w_max": float(w.max()),
            "w_ess_frac": float(effective_sample_size(w) / len(w)) if w.sum() > 0 else 0.0}
