"""One PPO update of the solver, and the learner's state for checkpoints.

Per update, for a batch of trajectories:

1. score (scoring.py): old log-probs, entropy, values or critic features, reference
   log-probs, each rank scoring its share of the rows;
2. token rewards, then the registered advantage estimator ``lower.advantage`` (algos/),
   then the context bonus on refine tokens (objective.py, algos/bonus.py);
3. epochs of minibatches, each ``grad_accum`` micro-batch slots over the ranks
   (``Trainer``), and the target critic's Polyak step after each optimiser step.

Only the solver's adapter and the heads its estimator needs train: base weights and the
writer's adapter stay frozen.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tosca_mlmt import parallel as dist
from tosca_mlmt.algos.advantages import ADVANTAGES, CRITIC, VALUES, AdvantageInputs, turn_sums
from tosca_mlmt.algos.qlearning import polyak_update
from tosca_mlmt.config import Config
from tosca_mlmt.config.lower import LowerConfig, warn_kl_reward_collapse
from tosca_mlmt.errors import MlmtError
from tosca_mlmt.lower import archer, objective, stats
from tosca_mlmt.lower.objective import UpdateBatch
from tosca_mlmt.lower.scoring import Scores, SolverScorer
from tosca_mlmt.lower.trajectory import (SolverTrajectory, TrajectoryTensors, first_turn_only, to_tensors,
                                         without_cut_turns)
from tosca_mlmt.metrics import StageTimer
from tosca_mlmt.models.policies import PolicyPair
from tosca_mlmt.seeds import seeded, stream
from tosca_mlmt.train.distributed import Trainer

VALUE_HEAD_FILE = "value_head.safetensors"


def bonus_scored_by_engine(lo: LowerConfig, engine) -> bool:
    """lower.bonus.scorer resolved for one update: False where no bonus is computed (lo.bonus_on), so
    lower/bonus/engine_scored never claims a bonus that was not. auto picks the engine only where that is
    faster and reads the same model: a vLLM engine (one prefill per refine instead of a trainer
    forward, and with it the pi_old pass can go) that sampled this batch (online) and serves the
    policy the bonus reads (bonus.model=policy). An HF engine's scoring is the trainer's forward
    again, so auto keeps the trainer there."""
    bo = lo.bonus
    if not lo.bonus_on:
        return False
    if bo.scorer == "auto":  # the engine scores raw log-probs only
        return engine is not None and engine.name == "vllm" and bo.model == "policy" and lo.logprob_temperature == "raw"
    return bo.scorer == "engine"


class LowerLearner:
    def __init__(self, cfg: Config, policies: PolicyPair):
        self.cfg, self.lo, self.policies = cfg, cfg.lower, policies
        self.estimator = ADVANTAGES[self.lo.advantage]
        self.model = policies.model("solver")
        self.params = [p for n, p in self.model.named_parameters() if ".solver." in n]
        for n, p in self.model.named_parameters():
            p.requires_grad_(".solver." in n)
        hidden = self.model.get_base_model().config.hidden_size
        # the heads' initial weights depend on the seed alone, and drawing them leaves the process's RNG as it was
        with seeded(self.cfg.seed + 1):
            self.value_head = nn.Linear(hidden, 1)
            nn.init.normal_(self.value_head.weight, std=1e-3)
            nn.init.zeros_(self.value_head.bias)
            self.critic = archer.UtteranceCritic(hidden)
        self.critic_target = archer.make_target(self.critic)
        # Heads the estimator does not read stay frozen: DDP rejects trainable parameters without gradients.
        lo, needs = self.lo, self.estimator.needs
        groups = [{"params": self.params, "lr": lo.lr}]
        for module, used, lr in ((self.value_head, VALUES in needs, lo.value_lr),
                                 (self.critic, CRITIC in needs, lo.critic_lr)):
            module.requires_grad_(used)
            if used:
                groups.append({"params": list(module.parameters()), "lr": lr})
        optimizer = torch.optim.AdamW(groups, weight_decay=lo.weight_decay)
        warm = max(1, lo.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))
        if lo.gradient_checkpointing:
            self.model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.enable_input_require_grads()
        self.trainer = Trainer(cfg.distributed, {"policy": self.model, "value_head": self.value_head,
                                                 "critic": self.critic}, optimizer, scheduler,
                               slots=lo.grad_accum, micro_size=lo.minibatch_size // lo.grad_accum,
                               max_grad_norm=lo.max_grad_norm, what="lower.grad_accum")
        # lower.logprob_temperature: score the distribution the PPO batches were drawn from, or the raw one
        tempered = lo.logprob_temperature == "sampling"
        self.scorer = SolverScorer(lo, policies, self.value_head,
                                   temperature=cfg.solver_sampling.temperature if tempered else 1.0)
        self.optimizer_steps = 0
        self._warned_clip = False
        # the known collapse (KL in the reward under grpo's std division): the loader warned about a loaded
        # config already (said once per section); this covers configs built or replace-d in code
        warn_kl_reward_collapse(lo)

    @property
    def scheduler(self):
        return self.trainer.scheduler

    @property
    def pad_id(self) -> int:
        return self.scorer.pad_id

    def close(self) -> None:
        self.trainer.close()

    def update(self, trajs: list[SolverTrajectory], step: int, timer: StageTimer | None = None,
               engine=None) -> stats.UpdateStats:
        """``engine``: the rollout engine that sampled ``trajs``, still holding those weights; read
        only when it scores the bonus (lower.bonus.scorer, see engine_scores_bonus)."""
        lo, needs = self.lo, self.estimator.needs
        timer = timer or StageTimer()
        tt = to_tensors(trajs, self.pad_id)
        by_engine = self.engine_scores_bonus(engine)
        self.model.eval()  # LoRA dropout is 0; eval keeps old/new log-probs comparable
        # ZeRO-3: weights whole for the scoring block, so ranks may run different forwards
        with torch.no_grad(), self.policies.full_weights(), dist.full_parameters(self.value_head, self.critic):
            with timer("old_ref_logprobs"):
                current = self.current_rows(step, len(trajs), tt.n_turns, needs, by_engine)
                scores = self.scorer.score(tt, trajs, values=VALUES in needs, features=CRITIC in needs,
                                           current=current)
            with timer("advantages"):
                rewards = objective.token_rewards(trajs, tt, scores, lo, step)
                adv, returns, critic_targets = self._advantages(trajs, tt, rewards, scores)
            with timer("bonus"):
                with_g = tt.behaviour_logprobs if by_engine else scores.trainer_logprobs
                bonus, terms = self._bonus(trajs, with_g, scores.ref_logprobs, adv, engine if by_engine else None)
                bstats = stats.bonus_stats(terms)
                adv = adv + bonus
                self._warn_if_mostly_clipped(bstats)
        # a cut turn's reward stays in the estimate above (its group's baseline); only the loss drops its tokens
        loss_tt, masked = without_cut_turns(trajs, tt) if lo.mask_truncated else (tt, 0)
        if not lo.train_refine:  # the masked-refine control: the refines shape the advantages above, nothing else
            loss_tt = first_turn_only(loss_tt)
        batch = UpdateBatch(loss_tt, scores.old_logprobs, scores.old_values, scores.ref_logprobs, adv, returns,
                            rewards.kl_weight, critic_targets, scores.old_current)
        with timer("update"):
            upd = self._epochs(batch, step)
        cuts = {"truncated_turns": sum(map(sum, (t.cut for t in trajs))), "truncated_turns_masked": masked,
                "loss_tokens": int(loss_tt.mask.sum())}
        # old_pass: the share of rows a pi_old forward scored (lower.old_logprobs=auto skips the rows where
        # pi_old = pi_theta at the loss: 0 for a batch of one minibatch, 1 - minibatch/batch for more)
        metrics = {**stats.iteration_stats(tt, rewards, scores, adv, returns, self.scorer.temperature == 1.0),
                   **bstats, **upd, **cuts,
                   "old_pass": 1.0 - len(current) / len(trajs), "bonus/engine_scored": float(by_engine)}
        return stats.UpdateStats(metrics, skipped_old=len(current) == len(trajs),
                                 refine_bonus=tuple(stats.refine_bonus_rows(terms)))

    def engine_scores_bonus(self, engine) -> bool:
        """lower.bonus.scorer resolved for one update (bonus_scored_by_engine)."""
        return bonus_scored_by_engine(self.lo, engine)

    def current_rows(self, step: int, rows: int, n_turns: int, needs, engine_scored_bonus: bool) -> list[int]:
        """The rows whose pi_old pass can be skipped (lower.old_logprobs=auto): with one epoch, the
        first minibatch's loss forward runs with the very weights that sampled, so pi_old is that
        forward detached, exactly, for its rows; later minibatches follow an optimizer step and
        keep the pass. Skipped only where nothing reads pi_old of every row before the update: no
        trainer-scored bonus of the policy on refines, value head, critic features or KL in the reward;
        and a batch of one minibatch keeps the pass where the reference runs (the pre-update
        KL diagnostics need some scored rows), as before partial skips."""
        lo = self.lo
        bonus_reads_it = (lo.bonus_on and n_turns > 1 and lo.bonus.model == "policy"
                          and not engine_scored_bonus)  # bonus.model=reference reads the reference pass
        kl_in_reward = lo.kl_mode == "reward" and (lo.kl_coef > 0 or lo.score.enabled)
        if (lo.old_logprobs != "auto" or lo.epochs != 1 or bonus_reads_it or kl_in_reward
                or VALUES in needs or CRITIC in needs):
            return []
        first = self.minibatch_order(step, 0, rows)[: lo.minibatch_size]
        if len(first) == rows and self.scorer.needs_reference():
            return []
        return sorted(int(i) for i in first)

    def minibatch_order(self, step: int, epoch: int, rows: int) -> np.ndarray:
        """The rows of update ``step``'s epoch in the order its minibatches take them."""
        return stream(self.cfg.seed, "minibatch", step, epoch).permutation(rows)

    def _advantages(self, trajs, tt: TrajectoryTensors, rewards: objective.TokenRewards, scores: Scores):
        """(advantages [B, T], returns [B, T], the critic's targets when it trains)."""
        x = AdvantageInputs(rewards.rewards, tt.mask, tt.turn_ids, tt.groups, tt.n_turns, values=scores.old_values,
                            refine_groups=tt.refine_groups)
        targets = None
        if CRITIC in self.estimator.needs:
            x.q, x.v, targets = archer.evaluate(self.critic, self.critic_target, scores.turn_features,
                                                turn_sums(rewards.rewards, tt.turn_ids, tt.n_turns),
                                                x.valid().float(), [t.turn_spans for t in trajs], self.lo.gamma)
        adv, returns = objective.estimate(self.lo, x)
        return adv, returns, targets

    @torch.no_grad()
    def context_bonus(self, trajs: list[SolverTrajectory], lp_with: torch.Tensor, ref_with: torch.Tensor | None,
                      adv: torch.Tensor, engine=None) -> tuple[torch.Tensor, dict]:
        """Bonus [B, T] for the advantages ``adv`` [B, T], and its statistics. ``lp_with`` are the
        old policy's log-probs (the engine's sampling ones where the engine scores the bonus),
        ``ref_with`` the reference's; ``lower.bonus.model`` picks one."""
        bonus, terms = self._bonus(trajs, lp_with, ref_with, adv, engine if self.engine_scores_bonus(engine) else None)
        return bonus, stats.bonus_stats(terms)

    def _bonus(self, trajs, lp_with, ref_with, adv, engine=None) -> tuple[torch.Tensor, objective.BonusTerms | None]:
        """Bonus [B, T] and its per-refine terms; None when none was computed (coefficient 0, refines
        out of the loss (lower.train_refine=false), or no refine with its feedback intact)."""
        bo = self.lo.bonus
        if not self.lo.bonus_on:
            return torch.zeros_like(adv), None
        if bo.scorer == "engine" and engine is None:
            raise MlmtError("lower.bonus.scorer=engine: the bonus is scored by the rollout engine, and this update "
                            "has none (training from snapshots?); set lower.bonus.scorer=trainer")
        reference = bo.model == "reference"
        refine = self.scorer.without_feedback(trajs, reference=reference, engine=engine)
        if not refine.where:
            return torch.zeros_like(adv), None
        return objective.refine_bonus(trajs, ref_with if reference else lp_with, refine, adv, bo)

    def _warn_if_mostly_clipped(self, bstats: dict) -> None:
        if bstats["bonus/clip_rate"] > 0.5 and not self._warned_clip:
            self._warned_clip = True
            warnings.warn(f"lower.bonus.clip={self.lo.bonus.clip} clips {bstats['bonus/clip_rate']:.0%} of the "
                          "bonus terms: the bonus is mostly +-clip; raise the clip or use reduce=mean")

    def _epochs(self, batch: UpdateBatch, step: int) -> dict:
        """Minibatches of a shared permutation; each is ``grad_accum`` micro-batch slots of
        minibatch_size / grad_accum rows, spread over the ranks. Slots past the end of a short
        last minibatch run a zero-weight forward so every rank steps in lockstep. Each micro-batch's
        losses are scaled by its share of the minibatch (objective.Share), so the step's gradient
        is the minibatch's own mean at any grad_accum or world size."""
        lo, trainer = self.lo, self.trainer
        micro = lo.minibatch_size // lo.grad_accum
        mine = range(dist.rank() * trainer.local_slots, (dist.rank() + 1) * trainer.local_slots)
        means, norms = stats.LossMeans(), []
        self.model.train()
        for epoch in range(lo.epochs):
            order = self.minibatch_order(step, epoch, len(batch))
            for mb_start in range(0, len(batch), lo.minibatch_size):
                mb = order[mb_start: mb_start + lo.minibatch_size]
                tokens = float(batch.tt.mask[torch.as_tensor(mb)].sum())
                trainer.zero_grad()
                for slot in mine:
                    rows = torch.as_tensor(mb[slot * micro: (slot + 1) * micro])
                    weight = 1.0
                    if len(rows) == 0:
                        rows, weight = torch.as_tensor(mb[:1]), 0.0
                    part = batch.select(rows)
                    share = objective.Share(float(part.tt.mask.sum()) / max(tokens, 1.0), len(rows) / len(mb))
                    loss, info = trainer(self.loss, part, share)
                    trainer.backward(loss, weight)
                    means.add(info, real=weight > 0)
                norms.append(trainer.step(at=f"iteration {step + 1}, optimizer step {self.optimizer_steps + 1}"))
                self.optimizer_steps += 1
                if batch.critic is not None:
                    with dist.full_parameters(self.critic):
                        polyak_update(self.critic_target.parameters(), self.critic.parameters(), lo.archer_tau)
        self.model.eval()
        out = means.means()
        out["grad_norm"] = float(np.mean(norms))  # already global: the trainer clips over all ranks
        out["lr"] = self.scheduler.get_last_lr()[0]
        out["optimizer_steps"] = self.optimizer_steps
        return out

    def loss(self, mb: UpdateBatch, share: objective.Share = objective.WHOLE) -> tuple[torch.Tensor, dict]:
        """One micro-batch's loss; runs inside the trainer's wrapper, so DDP sees the forward."""
        keep = mb.tt.mask
        if not keep.any():  # every turn cut (lower.mask_truncated): the loss is 0, but its graph must still
            keep = (mb.tt.turn_ids >= 0).float()  # reach the adapter, so DDP/ZeRO ranks reduce in lockstep
        fwd = self.scorer.forward(mb.tt.input_ids, mb.tt.attention_mask, values=mb.old_values is not None,
                                  entropy=mb.old_logprobs is None, keep=keep)
        return objective.ppo_loss(self.lo, fwd, mb, self.critic, share)

    def save(self, folder: Path) -> None:
        """Collective (every rank calls it); rank 0 writes the adapter and value head."""
        from safetensors.torch import save_file

        self.policies.save_role("solver", folder / "solver")
        with dist.full_parameters(self.value_head):
            if dist.is_main():
                save_file({k: v.detach().clone().contiguous() for k, v in self.value_head.state_dict().items()},
                          folder / VALUE_HEAD_FILE)
        with dist.full_parameters(self.critic):
            critic = {k: v.detach().clone() for k, v in self.critic.state_dict().items()}
        self.trainer.save(folder, {"optimizer_steps": self.optimizer_steps, "critic": critic,
                                  "critic_target": self.critic_target.state_dict()})

    def load(self, folder: Path) -> None:
        self.policies.load_role("solver", folder / "solver")
        self.load_trainer_state(folder)

    def load_trainer_state(self, folder: Path) -> None:
        """Value head, critic, optimizer and scheduler (the adapter comes from elsewhere)."""
        from safetensors.torch import load_file

        with torch.no_grad(), dist.full_parameters(self.value_head, modify=True):
            self.value_head.load_state_dict(load_file(folder / VALUE_HEAD_FILE))
        st = self.trainer.load(folder)
        self.optimizer_steps = st["optimizer_steps"]
        with dist.full_parameters(self.critic, modify=True):
            self.critic.load_state_dict(st["critic"])
        self.critic_target.load_state_dict(st["critic_target"])
