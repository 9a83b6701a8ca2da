"""PPO's objective for the solver: token rewards, the context bonus on refines, one micro-batch's loss.

Per action token t of a solver turn (CleanRL-style names):
    rho_t = pi(a_t | s_t) / pi_old(a_t | s_t)
    L_pi  = -min(rho_t A_t, clip(rho_t, 1 - eps_lo, 1 + eps_hi) A_t)         (policy loss registry)
    L_V   = 0.5 max((V - R)^2, (V_old + clip(V - V_old) - R)^2)              (estimators needing values)
    L     = L_pi + vf_coef L_V [+ L_critic (archer)] [+ beta KL(pi || pi_ref) when kl_mode = loss]
Token rewards: turn rewards on each turn's last token (SCoRe shaping optional) and
-beta KL(pi_old || pi_ref) per token when kl_mode = reward. The context-dependency bonus
(algos/bonus.py) is added to each refine's advantages after the estimator, so it never
changes a group's normalization, the critic's return target, or turn 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tosca_mlmt.algos.advantages import ADVANTAGES, AdvantageInputs
from tosca_mlmt.algos.bonus import GATES, context_bonus
from tosca_mlmt.algos.losses import POLICY_LOSSES, kl_estimate, value_loss
from tosca_mlmt.lower import archer
from tosca_mlmt.lower.scoring import Forward, RefineScores, Scores
from tosca_mlmt.lower.trajectory import SolverTrajectory, TrajectoryTensors, shaped_turn_rewards
from tosca_mlmt.tensors import masked_mean

if TYPE_CHECKING:
    from tosca_mlmt.config import ContextBonus, LowerConfig


@dataclass
class TokenRewards:
    rewards: torch.Tensor  # [B, T] on action tokens only
    kl: torch.Tensor  # [B, T] estimate of KL(pi_old || pi_ref) per action token; 0 without a reference
    # and in rows whose pi_old pass was skipped (Scores.old_current: only where the reward holds no KL)
    kl_weight: torch.Tensor  # [B, T] beta of each token's turn (SCoRe gives turns different betas)
    stage: int  # SCoRe stage, 0 when off


def token_rewards(trajs: list[SolverTrajectory], tt: TrajectoryTensors, scores: Scores, lo: "LowerConfig",
                  step: int) -> TokenRewards:
    turn_r, kl_w, stage = shaped_turn_rewards(trajs, lo, step)
    old_lp, ref_lp = scores.old_logprobs, scores.ref_logprobs
    rewards = torch.zeros(tt.mask.shape)
    kl = (kl_estimate(old_lp, ref_lp, lo.kl_estimator) * scores.scored_mask(tt.mask) if ref_lp is not None
          else torch.zeros_like(rewards))
    kl_weight = torch.zeros_like(rewards)
    for b, t in enumerate(trajs):
        for k, (s, e) in enumerate(t.turn_spans):
            rewards[b, e - 1] += turn_r[b][k]
            kl_weight[b, s:e] = kl_w[b][k]
    if lo.kl_mode == "reward":
        rewards -= kl_weight * kl
    rewards *= tt.mask
    return TokenRewards(rewards, kl, kl_weight, stage)


def estimate(lo: "LowerConfig", x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [B, T], returns [B, T]) of the estimator ``lower.advantage`` with its knobs."""
    return ADVANTAGES[lo.advantage](x, gamma=lo.gamma, lam=lo.lam, norm_std=lo.grpo_norm_std,
                                    baseline=lo.reinforce_baseline, turn_gamma=lo.turn_gamma)


@dataclass
class BonusTerms:
    """Per refine [N], kept for the statistics."""
    raw: torch.Tensor  # the unclipped term
    clipped: torch.Tensor  # share of clipped terms
    total: torch.Tensor  # the bonus summed over the refine's tokens
    gate: torch.Tensor
    r_prev: torch.Tensor  # reward of the turn the feedback answered
    r_this: torch.Tensor  # reward of the refine
    where: list[tuple[int, int]]  # (row, solver turn) of each refine


def refine_bonus(trajs: list[SolverTrajectory], lp_with: torch.Tensor, refine: RefineScores, adv: torch.Tensor,
                 bo: "ContextBonus") -> tuple[torch.Tensor, BonusTerms]:
    """Bonus [B, T] on refine tokens. ``lp_with`` [B, T] are log pi(y | x, z, g) from the scorer
    ``lower.bonus.model`` names; ``adv`` [B, T] the estimator's advantages (the gate may read them)."""
    where = refine.where
    N, L = len(where), max(len(x) for x in refine.logprobs)
    w, wo, m = torch.zeros(N, L), torch.zeros(N, L), torch.zeros(N, L)
    r_prev, r_this, a_turn = torch.zeros(N), torch.zeros(N), torch.zeros(N)
    for i, (b, k) in enumerate(where):
        s, e = trajs[b].turn_spans[k]
        w[i, : e - s], wo[i, : e - s], m[i, : e - s] = lp_with[b, s:e], refine.logprobs[i][: e - s], 1.0
        r_prev[i], r_this[i] = trajs[b].turn_rewards[k - 1], trajs[b].turn_rewards[k]
        a_turn[i] = adv[b, s:e].mean()
    gate = GATES[bo.gate](r_prev, r_this, a_turn)
    bonus, st = context_bonus(w, wo, m, gate, bo.coef, bo.clip, bo.level, bo.reduce)
    out = torch.zeros_like(lp_with)
    for i, (b, k) in enumerate(where):
        s, e = trajs[b].turn_spans[k]
        out[b, s:e] = bonus[i, : e - s]
    return out, BonusTerms(st["raw"], st["clipped"], st["total"], gate, r_prev, r_this, list(where))


@dataclass
class UpdateBatch:
    """What the losses of one update read, fixed before its first step; ``select`` takes rows."""
    tt: TrajectoryTensors
    old_logprobs: torch.Tensor | None  # [B, T]; None = pi_theta detached at the loss (scoring skipped)
    old_values: torch.Tensor | None  # [B, T]; present exactly when the value head trains
    ref_logprobs: torch.Tensor | None  # [B, T]
    advantages: torch.Tensor  # [B, T] estimator + bonus
    returns: torch.Tensor  # [B, T] the value head's target
    kl_weight: torch.Tensor  # [B, T]
    critic: archer.CriticTargets | None  # present exactly when the utterance critic trains
    old_current: torch.Tensor | None = None  # [B] rows whose pi_old is pi_theta detached (Scores.old_current)

    def __len__(self) -> int:
        return self.tt.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> "UpdateBatch":
        """The rows, cut to the longest of them: the batch is right-padded to its longest row, and
        pads past a micro-batch's own longest sequence change nothing a causal model computes
        there, but each costs a forward and backward position."""
        width = int(self.tt.attention_mask[rows].sum(1).max())

        def take(x):
            return None if x is None else x[rows, :width]

        return UpdateBatch(self.tt.select(rows, width), take(self.old_logprobs), take(self.old_values), take(self.ref_logprobs),
                           take(self.advantages), take(self.returns), take(self.kl_weight),
                           None if self.critic is None else self.critic.select(rows),
                           None if self.old_current is None else self.old_current[rows])


@dataclass(frozen=True)
class Share:
    """A micro-batch's part of its minibatch: of the action tokens and of the rows. Its losses are
    means over its own tokens (rows); scaled by these they sum, over the minibatch's micro-batches,
    to the minibatch's own means: a token-mean weighs every token of the minibatch alike whatever
    lower.grad_accum cuts it into (a mean of micro-batch means would weigh a token of a short
    micro-batch more)."""
    tokens: float
    rows: float


WHOLE = Share(1.0, 1.0)


def ppo_loss(lo: "LowerConfig", fwd: Forward, mb: UpdateBatch, critic: archer.UtteranceCritic,
             share: Share = WHOLE) -> tuple[torch.Tensor, dict]:
    """(loss, diagnostics) of a micro-batch from the training forward ``fwd`` of its rows; the loss is
    scaled by ``share`` (the policy loss by the unit lower.loss_agg averages over, the token-mean value
    and KL terms by tokens, the critic's by rows), the diagnostics are the micro-batch's own means."""
    m = mb.tt.mask
    # no pi_old pass: this forward runs with the weights that sampled, so pi_old is its own detached value
    old = mb.old_logprobs if mb.old_logprobs is not None else fwd.logprobs.detach()
    if mb.old_current is not None:  # the first minibatch's rows: the same, row by row
        old = torch.where(mb.old_current[:, None], fwd.logprobs.detach(), old)
    pg, info = POLICY_LOSSES[lo.policy_loss](fwd.logprobs, old, mb.advantages, m, agg=lo.loss_agg,
                                             clip_low=lo.clip_low, clip_high=lo.clip_high)
    loss = pg * (share.rows if lo.loss_agg == "seq-mean-token-mean" else share.tokens)
    info = {"policy_loss": float(pg.detach()), **info}
    if fwd.entropy is not None:  # the skipped pass's diagnostic, from this forward (mean over micro-batches)
        info["entropy"] = float(masked_mean(fwd.entropy, m))
    if fwd.values is not None:
        vl, vinfo = value_loss(fwd.values, mb.old_values, mb.returns, m, lo.value_clip)
        loss = loss + lo.vf_coef * vl * share.tokens
        info.update(value_loss=float(vl.detach()), **vinfo)
    if mb.critic is not None:
        cl = archer.loss_on(critic, fwd.hidden, mb.critic, mb.tt.n_turns)
        loss = loss + cl * share.rows
        info["critic_loss"] = float(cl.detach())
    if lo.kl_mode == "loss" and mb.ref_logprobs is not None:
        kl = masked_mean(mb.kl_weight * kl_estimate(fwd.logprobs, mb.ref_logprobs, lo.kl_estimator), m)
        loss = loss + kl * share.tokens
        info["kl_loss"] = float(kl.detach())
    return loss, info
