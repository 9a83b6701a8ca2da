"""Offline Q-learning math: TD targets, conservatism terms, target networks, AWR weights
and off-policy evaluation. Pure functions on tensors; no model, no data loading.

Shapes: B = transitions (one strategy decision each), A = strategies (discrete actions),
N = episodes, K = decisions per episode.

References: DQN target r + gamma * max_a' Q_bar(s', a'); IQL (Kostrikov et al. 2021)
expectile value and the backup through V(s') that never queries unseen actions; CQL
(Kumar et al. 2020) logsumexp penalty; AWR (Peng et al. 2019) exp(A / beta) weights;
self-normalised importance sampling (weighted IS) for the value of a target policy.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from tosca_mlmt.algos import registrar

# --------------------------------------------------------------------------- TD targets

BOOTSTRAPS: dict[str, Callable] = {}


register_bootstrap = registrar(BOOTSTRAPS)


@register_bootstrap("max")
def bootstrap_max(q_next_target: torch.Tensor, **_) -> torch.Tensor:
    """DQN: max_a' Q_bar(s', a').  q_next_target [B, A] -> [B]."""
    return q_next_target.max(dim=-1).values


@register_bootstrap("value")
def bootstrap_value(v_next: torch.Tensor, **_) -> torch.Tensor:
    """IQL: V(s') -- an in-sample estimate, so no max over never-logged actions.  [B] -> [B]."""
    return v_next


def td_target(reward: torch.Tensor, done: torch.Tensor, bootstrap: torch.Tensor, gamma: float) -> torch.Tensor:
    """y = r + gamma * (1 - done) * bootstrap.  All [B] -> [B]; no gradient flows into y."""
    return (reward + gamma * (1.0 - done.float()) * bootstrap).detach()


# --------------------------------------------------------------------------- regression losses


def expectile_loss(u: torch.Tensor, tau: float) -> torch.Tensor:
    """|tau - 1[u < 0]| * u^2, elementwise ([...] -> [...]).

    With u = Q_bar(s, a) - V(s) and tau > 0.5, V(s) tends towards an upper expectile of
    Q over the logged actions: a soft in-sample max (tau = 0.5 is the mean, tau -> 1 the max)."""
    weight = torch.abs(tau - (u < 0).float())
    return weight * u.pow(2)


def cql_penalty(q: torch.Tensor, actions: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """T * logsumexp_a(Q(s, a) / T) - Q(s, a_data).  q [B, A], actions [B] -> [B], always >= 0 - T log A.

    Minimising it pushes every action's Q down (softmax-weighted, so the largest first) and
    the logged action's Q up: actions never seen in a state cannot drift above the data."""
    q_data = q.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
    return temperature * torch.logsumexp(q / temperature, dim=-1) - q_data


# --------------------------------------------------------------------------- target networks


@torch.no_grad()
def polyak_update(target: Iterable[torch.Tensor], online: Iterable[torch.Tensor], tau: float) -> None:
    """theta_bar <- (1 - tau) * theta_bar + tau * theta, in place (the target may sit on another
    device than the online tensors: a copy made before the trainer placed them)."""
    for t, o in zip(target, online, strict=True):
        t.mul_(1.0 - tau).add_(o.detach().to(t.device, t.dtype), alpha=tau)


@torch.no_grad()
def hard_update(target: Iterable[torch.Tensor], online: Iterable[torch.Tensor]) -> None:
    """theta_bar <- theta, in place."""
    for t, o in zip(target, online, strict=True):
        t.copy_(o.detach())


def target_due(step: int, mode: str, sync_every: int) -> bool:
    """Whether the target moves after optimiser step ``step`` (1-based): Polyak every step,
    hard sync every ``sync_every`` steps."""
    if mode == "polyak":
        return True
    if mode == "hard":
        return step % sync_every == 0
    raise ValueError(f"unknown target update {mode!r}; allowed: polyak, hard")


# --------------------------------------------------------------------------- AWR


def awr_weights(adv: torch.Tensor, beta: float, max_weight: float) -> torch.Tensor:
    """w = min(exp(A / beta), max_weight).  adv [B] -> [B], detached (weights are targets).

    Exponentiate in a clamped log space so a large A cannot overflow before the clip."""
    log_w = (adv.detach() / beta).clamp(max=torch.log(torch.tensor(float(max_weight))).item())
    return torch.exp(log_w)


def effective_sample_size(w: torch.Tensor) -> torch.Tensor:
    """(sum w)^2 / sum w^2 for non-negative weights [B] -> scalar in [1, B] (B when all equal)."""
    return w.sum().pow(2) / w.pow(2).sum().clamp(min=1e-12)


# --------------------------------------------------------------------------- off-policy evaluation


def importance_weighted_value(returns: torch.Tensor, target_probs: torch.Tensor, behaviour_probs: torch.Tensor,
                              mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Self-normalised (weighted) importance-sampling estimate of a target policy's return.

    returns [N]: discounted return of each logged episode.
    target_probs, behaviour_probs [N] or [N, K]: pi(a_k | s_k) and mu(a_k | s_k) of each
    logged decision; mask [N, K] marks real decisions (episodes may have fewer than K).
    rho_i = prod_k pi / mu;  V_hat = sum rho_i G_i / sum rho_i;  ESS = (sum rho)^2 / sum rho^2.

    Self-normalising trades a small bias for bounded variance (V_hat stays within the range
    of the logged returns), which matters with few episodes. When ESS is a small fraction of
    N, V_hat rests on a handful of episodes: report it, do not trust it.
    """
    if target_probs.dim() == 1:
        target_probs, behaviour_probs = target_probs[:, None], behaviour_probs[:, None]
    if mask is None:
        mask = torch.ones_like(target_probs)
    ratio = torch.where(mask > 0, target_probs / behaviour_probs.clamp(min=1e-30), torch.ones_like(target_probs))
    rho = ratio.prod(-1)  # [N]; exactly 0 when the target never takes a logged action
    total = rho.sum()
    value = (rho * returns).sum() / total.clamp(min=1e-30)
    return {"value": value, "behaviour_value": returns.mean(), "ess": effective_sample_size(rho),
            "ess_frac": effective_sample_size(rho) / len(rho), "max_rho": rho.max()}
