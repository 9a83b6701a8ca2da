"""Advantage estimators: pure functions, and a registry of them picked by ``lower.advantage``.

A solver trajectory is one token sequence holding every solver turn (turn 1, each
refine) with the writer's feedback and template tokens in between. Shapes:
B = trajectories, T = tokens, K = solver turns per trajectory.

* ``gae`` works per token. Tokens with mask 0 (prompt, feedback, template) are not
  actions, so the recursion skips them: the successor of the last token of turn k is
  the first token of turn k+1 (as verl's multi-turn GAE does).
* ``grpo``, ``rloo`` and ``reinforce`` work per turn on the return-to-go
  R_k = r_k + turn_gamma * R_{k+1} (r_k: the sum of turn k's token rewards; turn_gamma = 1
  sums every later turn, 0 credits each turn with its own reward only, as MT-GRPO's turn
  advantage does) and broadcast A_k to the tokens of turn k. Groups are (problem, turn index): the n turn-1 samples of a
  problem, and their refines, are compared only with each other. Under refine groups
  (lower.refine_samples) a refine's group is its attempt: the k refines of one (x, z, g).
* ``archer`` reads an utterance-level critic: A_k = min_j Q_j(s_k, a_k) - min_j V_j(s_k).

Every registered estimator has one signature, ``(AdvantageInputs, **knobs) -> (A [B, T],
returns [B, T])``, and declares in ``needs`` which model outputs it reads, so a trainer asks
for those instead of branching on estimator names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tosca_mlmt.algos import registrar

ADVANTAGES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}
_register = registrar(ADVANTAGES)

# What an estimator may need besides the rewards: a per-token value head, or the utterance critic.
VALUES, CRITIC = "values", "critic"


@dataclass
class AdvantageInputs:
    rewards: torch.Tensor  # [B, T] token rewards (turn rewards on each turn's last token, KL penalty)
    mask: torch.Tensor  # [B, T] 1.0 on action tokens
    turn_ids: torch.Tensor  # [B, T] solver turn of each token, -1 elsewhere
    groups: torch.Tensor  # [B] problem index
    n_turns: int  # K
    values: torch.Tensor | None = None  # [B, T] V of the state before each token (VALUES)
    q: torch.Tensor | None = None  # [B, K, 2] the critic's two Q heads (CRITIC)
    v: torch.Tensor | None = None  # [B, K, 2] the critic's two V heads (CRITIC)
    refine_groups: torch.Tensor | None = None  # [B] the group of turns k >= 2 (refine groups); None = groups

    def turn_groups(self) -> torch.Tensor:
        """[B, K]: the group each trajectory's turn k is compared in."""
        g = self.groups[:, None].expand(-1, self.n_turns).clone()
        if self.refine_groups is not None and self.n_turns > 1:
            g[:, 1:] = self.refine_groups[:, None]
        return g

    def valid(self) -> torch.Tensor:
        """[B, K] bool: trajectory b has a turn k (trajectories may have fewer turns than K)."""
        return torch.stack([(self.turn_ids == k).any(1) for k in range(self.n_turns)], 1)


def register(name: str, needs: tuple[str, ...] = ()):
    def deco(fn):
        fn.needs = frozenset(needs)
        return _register(name)(fn)

    return deco


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards, values, mask: [B, T] -> (advantages [B, T], returns [B, T]); zero where mask = 0.

    delta_t = r_t + gamma * V(next action token) - V_t ;  A_t = delta_t + gamma * lam * A_next
    """
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    next_v = torch.zeros(B, dtype=rewards.dtype)
    next_a = torch.zeros(B, dtype=rewards.dtype)
    for t in range(T - 1, -1, -1):
        m = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        a = delta + gamma * lam * next_a
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
        next_v = torch.where(m, values[:, t], next_v)  # skipped tokens pass the successor through
        next_a = torch.where(m, a, next_a)
    returns = (adv + values) * mask
    return adv, returns


def turn_sums(rewards: torch.Tensor, turn_ids: torch.Tensor, n_turns: int) -> torch.Tensor:
    """rewards [B, T], turn_ids [B, T] (-1 off-turn) -> r [B, K]: the reward of each turn's tokens."""
    per_turn = torch.zeros(rewards.shape[0], n_turns, dtype=rewards.dtype)
    for k in range(n_turns):
        per_turn[:, k] = (rewards * (turn_ids == k)).sum(1)
    return per_turn


def turn_returns(rewards: torch.Tensor, turn_ids: torch.Tensor, n_turns: int, turn_gamma: float = 1.0) -> torch.Tensor:
    """rewards [B, T], turn_ids [B, T] (-1 off-turn) -> R [B, K]: R_k = r_k + turn_gamma * R_{k+1}."""
    r = turn_sums(rewards, turn_ids, n_turns)
    R = torch.zeros_like(r)
    later = torch.zeros(r.shape[0], dtype=r.dtype)
    for k in range(n_turns - 1, -1, -1):
        later = r[:, k] + turn_gamma * later
        R[:, k] = later
    return R


def _group_stats(R: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor, leave_one_out: bool):
    """Mean (optionally leave-one-out) and std of R [B, K] within rows sharing ``groups`` ([B], or
    [B, K]: a group per turn)."""
    mean = torch.zeros_like(R)
    std = torch.ones_like(R)
    per_turn = groups if groups.dim() == 2 else groups[:, None].expand(-1, R.shape[1])
    for k in range(R.shape[1]):
        for g in per_turn[:, k].unique():
            sel = (per_turn[:, k] == g) & valid[:, k]
            n = int(sel.sum())
            if n == 0:
                continue
            vals = R[sel, k]
            if leave_one_out:
                mean[sel, k] = (vals.sum() - vals) / (n - 1) if n > 1 else vals  # n = 1: no baseline, A = 0
            else:
                mean[sel, k] = vals.mean()
            std[sel, k] = vals.std(unbiased=False) if n > 1 else 1.0
    return mean, std


def grpo(R: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor, norm_std: bool = True,
         eps: float = 1e-6) -> torch.Tensor:
    """R [B, K], groups [B] or [B, K], valid [B, K] -> A [B, K] = (R - mean_group) / (std_group + eps)."""
    mean, std = _group_stats(R, groups, valid, leave_one_out=False)
    a = R - mean
    if norm_std:
        a = a / (std + eps)
    return a * valid


def rloo(R: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor, **_) -> torch.Tensor:
    """A_i = R_i - mean of the other group members' R (unbiased leave-one-out baseline)."""
    mean, _ = _group_stats(R, groups, valid, leave_one_out=True)
    return (R - mean) * valid


def reinforce(R: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor, baseline: bool = False,
              **_) -> torch.Tensor:
    """A = R (plain REINFORCE) or R - batch mean of R at the same turn (baseline=True)."""
    if not baseline:
        return R * valid
    b = (R * valid).sum(0) / valid.sum(0).clamp(min=1)
    return (R - b) * valid


def broadcast_turns(A: torch.Tensor, turn_ids: torch.Tensor) -> torch.Tensor:
    """A [B, K], turn_ids [B, T] -> per-token advantages [B, T] (0 off-turn)."""
    idx = turn_ids.clamp(min=0)
    return A.gather(1, idx) * (turn_ids >= 0)


# ---------------------------------------------------------------- the registry, one signature


@register("gae", needs=(VALUES,))
def gae_estimator(x: AdvantageInputs, gamma: float = 1.0, lam: float = 0.95, **_):
    return gae(x.rewards, x.values, x.mask, gamma, lam)


def _per_turn(x: AdvantageInputs, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # turn-level estimators have no critic: the return target is the advantage itself
    adv = broadcast_turns(A, x.turn_ids)
    return adv, adv


@register("grpo")
def grpo_estimator(x: AdvantageInputs, norm_std: bool = True, turn_gamma: float = 1.0, **_):
    R = turn_returns(x.rewards, x.turn_ids, x.n_turns, turn_gamma)
    return _per_turn(x, grpo(R, x.turn_groups(), x.valid(), norm_std=norm_std))


@register("rloo")
def rloo_estimator(x: AdvantageInputs, turn_gamma: float = 1.0, **_):
    return _per_turn(x, rloo(turn_returns(x.rewards, x.turn_ids, x.n_turns, turn_gamma), x.turn_groups(),
                             x.valid()))


@register("reinforce")
def reinforce_estimator(x: AdvantageInputs, baseline: bool = False, turn_gamma: float = 1.0, **_):
    return _per_turn(x, reinforce(turn_returns(x.rewards, x.turn_ids, x.n_turns, turn_gamma), x.groups, x.valid(),
                                  baseline=baseline))


def archer(q: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """q, v [B, K, 2], valid [B, K] -> A_k = min Q - min V per turn [B, K] (pessimistic on both)."""
    return (q.min(-1).values - v.min(-1).values) * valid


@register("archer", needs=(CRITIC,))
def archer_estimator(x: AdvantageInputs, **_):
    return _per_turn(x, archer(x.q, x.v, x.valid().float()))
