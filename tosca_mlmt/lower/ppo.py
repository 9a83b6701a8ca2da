"""PPO for the solver (LL): one ``update`` = old/ref log-probs -> rewards -> advantages -> epochs.

Objective per action token t of a solver turn (CleanRL-style names):
    rho_t = pi(a_t | s_t) / pi_old(a_t | s_t)
    L_pi  = -min(rho_t A_t, clip(rho_t, 1 - eps_lo, 1 + eps_hi) A_t)         (policy loss registry)
    L_V   = 0.5 max((V - R)^2, (V_old + clip(V - V_old) - R)^2)              (gae only)
    L     = L_pi + vf_coef L_V [+ beta KL(pi || pi_ref) when kl_mode = loss]
Token rewards: turn rewards on each turn's last token (SCoRe shaping optional) and
-beta KL(pi_old || pi_ref) per token when kl_mode = reward. The context-dependency bonus
b = lambda gate clip(log pi(y | x, z, g) - log pi(y | x, z), -c, c) (algos/bonus.py) is added
to each refine's advantages after the estimator, so it never reaches turn 1.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tosca_mlmt.algos import bonus as bonus_algo
from tosca_mlmt.algos.advantages import ADVANTAGES, broadcast_turns, turn_returns
from tosca_mlmt.algos.losses import POLICY_LOSSES, explained_variance, kl_estimate, value_loss
from tosca_mlmt.algos.qlearning import polyak_update
from tosca_mlmt.config import Config
from tosca_mlmt.lower import archer
from tosca_mlmt.lower.trajectory import SolverTrajectory, no_feedback_sequences, shaped_turn_rewards, to_tensors
from tosca_mlmt.metrics import StageTimer
from tosca_mlmt.models.policies import PolicyPair
from tosca_mlmt.precision import use_bf16_autocast
from tosca_mlmt.train import distributed as dist
from tosca_mlmt.train.batching import build_batch, masked_mean, token_logprobs_from_hidden
from tosca_mlmt.train.distributed import TrainEngine

VALUE_HEAD_FILE = "value_head.safetensors"


def _cat_parts(parts: list[tuple], i: int) -> torch.Tensor | None:
    return None if parts[0][i] is None else torch.cat([q[i] for q in parts])


class PPOTrainer:
    def __init__(self, cfg: Config, policies: PolicyPair):
        self.cfg, self.lo, self.policies = cfg, cfg.lower, policies
        self.model = policies.model("solver")
        # Train exactly the solver adapter: base weights and the writer's adapter stay frozen.
        self.params = [p for n, p in self.model.named_parameters() if ".solver." in n]
        for n, p in self.model.named_parameters():
            p.requires_grad_(".solver." in n)
        hidden = self.model.get_base_model().config.hidden_size
        torch.manual_seed(cfg.seed + 1)
        self.value_head = nn.Linear(hidden, 1)
        nn.init.normal_(self.value_head.weight, std=1e-3)
        nn.init.zeros_(self.value_head.bias)
        self.critic = archer.UtteranceCritic(hidden)
        self.critic_target = archer.make_target(self.critic)
        # Heads the estimator does not use stay frozen: DDP rejects trainable parameters without gradients.
        groups = [{"params": self.params, "lr": self.lo.lr}]
        for module, used, lr in ((self.value_head, self.lo.advantage == "gae", self.lo.value_lr),
                                 (self.critic, self.lo.advantage == "archer", self.lo.critic_lr)):
            module.requires_grad_(used)
            if used:
                groups.append({"params": list(module.parameters()), "lr": lr})
        optimizer = torch.optim.AdamW(groups, weight_decay=self.lo.weight_decay)
        warm = max(1, self.lo.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))
        if self.lo.gradient_checkpointing:
            self.model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.enable_input_require_grads()
        self.engine = TrainEngine(cfg.distributed, {"policy": self.model, "value_head": self.value_head,
                                                    "critic": self.critic}, optimizer, scheduler,
                                  slots=self.lo.grad_accum, micro_size=self.lo.minibatch_size // self.lo.grad_accum,
                                  max_grad_norm=self.lo.max_grad_norm, what="lower.grad_accum")
        self.use_bf16 = use_bf16_autocast(self.lo.autocast)
        self.pad_id = policies.tokenizer("solver").pad_token_id or 0
        self.optimizer_steps = 0
        self._warned_clip = False

    @property
    def scheduler(self):
        return self.engine.scheduler

    def close(self) -> None:
        self.engine.close()

    # ------------------------------------------------------------------ forward passes
    def _autocast(self):
        if not self.use_bf16:
            return contextlib.nullcontext()
        return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)

    def _forward(self, ids, attn, values: bool = False, reference: bool = False, entropy: bool = False,
                 keep_hidden: bool = False):
        """(logprobs [B, T], values [B, T] | None, entropy [B, T] | None) under the solver (or the
        reference = the same base with every adapter disabled); ``keep_hidden`` stores the last
        hidden states [B, T, H] in ``self.last_hidden`` (the ArCHer critic reads them)."""
        ctx = self.model.disable_adapter() if reference else self.policies.use("solver")
        with ctx, self._autocast():
            out = self.model(input_ids=ids, attention_mask=attn, output_hidden_states=True, logits_to_keep=1)
            hidden = out.hidden_states[-1]
            head = self.model.get_base_model().get_output_embeddings()
            res = token_logprobs_from_hidden(hidden, head, ids, self.lo.logprob_chunk, with_entropy=entropy)
        lp, ent = res if entropy else (res, None)
        self.last_hidden = hidden if keep_hidden else None
        v = None
        if values:
            # V for action token t is read from the state before it, i.e. hidden position t - 1
            v = self.value_head(hidden[:, :-1].float()).squeeze(-1)
            v = torch.cat([torch.zeros_like(v[:, :1]), v], dim=1)
        return lp, v, ent

    def _score_chunks(self, rows: list[int]) -> list[list[int]]:
        n = self.lo.score_batch or len(rows)
        return [rows[i: i + n] for i in range(0, len(rows), n)]

    @torch.no_grad()
    def _sharded_forward(self, tt, trajs, values=False, reference=False, entropy=False, archer_feats=False):
        """``_forward`` over the whole batch with each rank scoring its shard of rows, gathered:
        (logprobs [B, T], values | None, entropy | None, (h_state, h_action) [B, K, H] | None)."""
        rows = dist.shard(tt.input_ids.shape[0])
        chunks = []  # (lp, v, ent, h_state, h_action) per scoring chunk of this rank's rows
        for c in self._score_chunks(rows):
            lp, v, ent = self._forward(tt.input_ids[c], tt.attention_mask[c], values=values,
                                       reference=reference, entropy=entropy, keep_hidden=archer_feats)
            hs, ha = (archer.turn_features(self.last_hidden, [trajs[i].turn_spans for i in c], tt.n_turns)
                      if archer_feats else (None, None))
            self.last_hidden = None
            chunks.append((lp, v, ent, hs, ha))
        part = tuple(_cat_parts(chunks, i) for i in range(5)) if chunks else None
        parts = [q for q in dist.gather(part) if q is not None]
        out = [_cat_parts(parts, i) for i in range(5)]
        return out[0], out[1], out[2], (out[3], out[4]) if archer_feats else None

    @torch.no_grad()
    def context_bonus(self, trajs: list[SolverTrajectory], lp_with: torch.Tensor, ref_with: torch.Tensor | None,
                      adv: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Per-token bonus [B, T] on refine tokens, to add to the advantages ``adv`` [B, T] (which
        the ``advantage_sign`` gate reads), plus stats. ``lp_with`` are log pi(y | x, z, g) from the
        scorer chosen by ``lower.bonus.model`` (old policy or reference): see algos/bonus.py."""
        bo = self.lo.bonus
        out = torch.zeros_like(lp_with)
        prompts, responses, where = no_feedback_sequences(trajs)
        stats = {"bonus/mean": 0.0, "bonus/clip_rate": 0.0, "bonus/corr_correct": float("nan")}
        if bo.coef == 0 or not where:
            return out, stats
        # log pi(y | x, z) of each refine, scored on this rank's share of the refines and gathered
        local = []
        for c in self._score_chunks(dist.shard(len(where))):
            batch = build_batch([prompts[i] for i in c], [responses[i] for i in c], self.pad_id)
            lp_local, _, _ = self._forward(batch.input_ids, batch.attention_mask, reference=bo.model == "reference")
            local += [lp_local[j, p: p + len(responses[i])] for j, (i, p) in enumerate(zip(c, batch.prompt_lens))]
        lp_wo = dist.gather_sharded(local, len(where))
        with_src = ref_with if bo.model == "reference" else lp_with
        N, L = len(where), max(len(r) for r in responses)
        w, wo, m = torch.zeros(N, L), torch.zeros(N, L), torch.zeros(N, L)
        r_prev, r_this, a_turn = torch.zeros(N), torch.zeros(N), torch.zeros(N)
        for i, (b, k) in enumerate(where):
            s, e = trajs[b].turn_spans[k]
            w[i, : e - s], wo[i, : e - s], m[i, : e - s] = with_src[b, s:e], lp_wo[i][: e - s], 1.0
            r_prev[i], r_this[i] = trajs[b].turn_rewards[k - 1], trajs[b].turn_rewards[k]
            a_turn[i] = adv[b, s:e].mean()
        gate = bonus_algo.GATES[bo.gate](r_prev, r_this, a_turn)
        bonus, st = bonus_algo.context_bonus(w, wo, m, gate, bo.coef, bo.clip, bo.level, bo.reduce)
        for i, (b, k) in enumerate(where):
            s, e = trajs[b].turn_spans[k]
            out[b, s:e] = bonus[i, : e - s]
        total = st["total"].numpy()
        stats["bonus/mean"] = float(total.mean())
        stats["bonus/raw_logratio_mean"] = float(st["raw"].mean())
        stats["bonus/clip_rate"] = float(st["clipped"].mean())
        stats["bonus/gate_mean"] = float(gate.mean())
        names = bonus_algo.transition_names(r_prev, r_this)
        for name in bonus_algo.TRANSITIONS.values():
            sel = [i for i, n in enumerate(names) if n == name]
            stats[f"bonus/{name}/count"] = float(len(sel))
            stats[f"bonus/{name}/mean"] = float(total[sel].mean()) if sel else float("nan")
            stats[f"bonus/{name}/raw_mean"] = float(st["raw"][sel].mean()) if sel else float("nan")
        if total.std() > 0 and r_this.std() > 0:
            stats["bonus/corr_correct"] = float(np.corrcoef(total, r_this.numpy())[0, 1])
        return out, stats

    # ------------------------------------------------------------------ one PPO update
    def update(self, trajs: list[SolverTrajectory], step: int, timer: StageTimer | None = None) -> dict:
        lo = self.lo
        timer = timer or StageTimer()
        tt = to_tensors(trajs, self.pad_id)
        use_critic = lo.advantage == "gae"
        self.model.eval()  # LoRA dropout is 0; eval keeps old/new log-probs comparable
        # ZeRO-3: weights whole for the scoring block, so ranks may run different forwards
        with torch.no_grad(), self.policies.full_weights(), dist.full_parameters(self.value_head, self.critic):
            with timer("old_ref_logprobs"):
                use_archer = lo.advantage == "archer"
                old_lp, old_v, ent, feats = self._sharded_forward(tt, trajs, values=use_critic, entropy=True,
                                                                  archer_feats=use_archer)
                if lo.old_logprobs == "behaviour":
                    old_lp = torch.where(tt.mask > 0, tt.behaviour_logprobs, old_lp)
                need_ref = lo.kl_coef > 0 or lo.score.enabled or lo.bonus.model == "reference"
                ref_lp = self._sharded_forward(tt, trajs, reference=True)[0] if need_ref else None
            with timer("advantages"):
                turn_r, kl_w, stage = shaped_turn_rewards(trajs, lo, step)
                rewards = torch.zeros_like(old_lp)
                kl_tok = kl_estimate(old_lp, ref_lp, lo.kl_estimator) * tt.mask if ref_lp is not None else torch.zeros_like(old_lp)
                klw_tok = torch.zeros_like(old_lp)
                for b, t in enumerate(trajs):
                    for k, (s, e) in enumerate(t.turn_spans):
                        rewards[b, e - 1] += turn_r[b][k]
                        klw_tok[b, s:e] = kl_w[b][k]
                if lo.kl_mode == "reward":
                    rewards -= klw_tok * kl_tok
                rewards *= tt.mask
                self.critic_batch = None
                if use_critic:
                    adv, returns = ADVANTAGES["gae"](rewards, old_v, tt.mask, lo.gamma, lo.lam)
                elif use_archer:
                    adv, returns = self._archer_advantages(trajs, tt, rewards, feats)
                else:
                    R = turn_returns(rewards, tt.turn_ids, tt.n_turns)
                    valid = tt.turn_valid()
                    kw = {"norm_std": lo.grpo_norm_std} if lo.advantage == "grpo" else (
                        {"baseline": lo.reinforce_baseline} if lo.advantage == "reinforce" else {})
                    adv = broadcast_turns(ADVANTAGES[lo.advantage](R, tt.groups, valid, **kw), tt.turn_ids)
                    returns = adv
            with timer("bonus"):
                # after the estimator: the bonus shifts refine advantages only, never a group's
                # normalization, turn 1, or the critic's return target
                bonus, bstats = self.context_bonus(trajs, old_lp, ref_lp, adv)
                adv = adv + bonus
                if bstats["bonus/clip_rate"] > 0.5 and not self._warned_clip:
                    self._warned_clip = True
                    warnings.warn(f"lower.bonus.clip={lo.bonus.clip} clips {bstats['bonus/clip_rate']:.0%} of the "
                                  "bonus terms: the bonus is mostly +-clip; raise the clip or use reduce=mean")
        with timer("update"):
            upd = self._epochs(tt, old_lp, old_v, ref_lp, adv, returns, klw_tok, step)
        m = tt.mask
        metrics = {
            "stage": stage, "kl": float(masked_mean(kl_tok, m)), "entropy": float(masked_mean(ent, m)),
            "adv_mean": float(masked_mean(adv, m)), "adv_std": float(adv[m > 0].std()) if m.sum() > 1 else 0.0,
            "token_reward_sum": float(rewards.sum() / len(trajs)), "train_tokens": int(m.sum()),
            **bstats, **upd,
        }
        for k in range(tt.n_turns):
            metrics[f"kl/turn{k}"] = float(masked_mean(kl_tok, m * (tt.turn_ids == k)))
        if use_critic:
            metrics["explained_variance"] = explained_variance(old_v, returns, m)
        return metrics

    def _archer_advantages(self, trajs, tt, rewards, feats):
        """Per-turn A = min Q - min V from the critic; stores the critic's TD targets for the update."""
        per_turn = torch.stack([(rewards * (tt.turn_ids == k)).sum(1) for k in range(tt.n_turns)], 1)  # r_k [B, K]
        valid = tt.turn_valid().float()
        spans = [t.turn_spans for t in trajs]
        hs, ha = feats
        q, v = self.critic(hs, ha)
        q_bar, v_bar = self.critic_target(hs, ha)
        y_q, y_v = archer.critic_targets(per_turn, valid, q_bar, v_bar, self.lo.gamma)
        self.critic_batch = (spans, y_q, y_v, valid)
        adv = broadcast_turns(archer.advantages(q, v, valid), tt.turn_ids)
        return adv, adv

    def _epochs(self, tt, old_lp, old_v, ref_lp, adv, returns, klw_tok, step: int) -> dict:
        """Minibatches of a shared permutation; each is ``grad_accum`` micro-batch slots of
        minibatch_size / grad_accum rows, spread over the ranks (``TrainEngine``). Slots past the
        end of a short last minibatch run a zero-weight forward so every rank steps in lockstep."""
        lo, eng = self.lo, self.engine
        B = tt.input_ids.shape[0]
        micro = lo.minibatch_size // lo.grad_accum
        mine = range(dist.rank() * eng.local_slots, (dist.rank() + 1) * eng.local_slots)
        # Loss diagnostics summed over every rank's real micro-batches (a zero-weight slot adds
        # its keys with 0, so all ranks reduce the same keys); the grad norm is already global.
        sums: dict[str, float] = {"n": 0.0}
        norms: list[float] = []
        self.model.train()
        for epoch in range(lo.epochs):
            order = np.random.default_rng([self.cfg.seed, step, epoch]).permutation(B)
            for mb_start in range(0, B, lo.minibatch_size):
                mb = order[mb_start: mb_start + lo.minibatch_size]
                n_micro = (len(mb) + micro - 1) // micro
                eng.zero_grad()
                for slot in mine:
                    rows = torch.as_tensor(mb[slot * micro: (slot + 1) * micro])
                    weight = 1.0 / n_micro
                    if len(rows) == 0:
                        rows, weight = torch.as_tensor(mb[:1]), 0.0
                    loss, info = eng(self._loss, tt.select(rows), old_lp[rows], None if old_v is None else old_v[rows],
                                     None if ref_lp is None else ref_lp[rows], adv[rows], returns[rows],
                                     klw_tok[rows], rows)
                    eng.backward(loss, weight)
                    real = float(weight > 0)
                    sums["n"] += real
                    for k, v in info.items():
                        sums[k] = sums.get(k, 0.0) + real * v
                norms.append(eng.step(at=f"iteration {step + 1}, optimizer step {self.optimizer_steps + 1}"))
                self.optimizer_steps += 1
                if self.critic_batch is not None:
                    with dist.full_parameters(self.critic):
                        polyak_update(self.critic_target.parameters(), self.critic.parameters(), lo.archer_tau)
        self.model.eval()
        sums = dist.all_sum(sums)
        n = sums.pop("n")
        out = {k: v / n for k, v in sums.items()}
        out["grad_norm"] = float(np.mean(norms))
        out["lr"] = self.scheduler.get_last_lr()[0]
        out["optimizer_steps"] = self.optimizer_steps
        return out

    def _loss(self, tt, old_lp, old_v, ref_lp, adv, returns, klw_tok, rows=None):
        lo = self.lo
        lp, v, _ = self._forward(tt.input_ids, tt.attention_mask, values=old_v is not None,
                                 keep_hidden=self.critic_batch is not None)
        m = tt.mask
        kw = {"clip_low": lo.clip_low, "clip_high": lo.clip_high} if lo.policy_loss == "ppo_clip" else {}
        pg, info = POLICY_LOSSES[lo.policy_loss](lp, old_lp, adv, m, agg=lo.loss_agg, **kw)
        loss = pg
        info = {"policy_loss": float(pg.detach()), **info}
        if v is not None:
            vl, vinfo = value_loss(v, old_v, returns, m, lo.value_clip)
            loss = loss + lo.vf_coef * vl
            info.update(value_loss=float(vl.detach()), **vinfo)
        if self.critic_batch is not None:
            spans, y_q, y_v, valid = self.critic_batch
            idx = rows.tolist()
            # detached features: the critic learns on the actor's representation without moving it
            hs, ha = archer.turn_features(self.last_hidden.detach(), [spans[i] for i in idx], tt.n_turns)
            q, v_u = self.critic(hs, ha)
            cl = archer.critic_loss(q, v_u, y_q[rows], y_v[rows], valid[rows])
            loss = loss + cl
            info["critic_loss"] = float(cl.detach())
        if lo.kl_mode == "loss" and ref_lp is not None:
            kl = masked_mean(klw_tok * kl_estimate(lp, ref_lp, lo.kl_estimator), m)
            loss = loss + kl
            info["kl_loss"] = float(kl.detach())
        return loss, info

    # ------------------------------------------------------------------ checkpoints
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
        self.engine.save(folder, {"optimizer_steps": self.optimizer_steps, "critic": critic,
                                  "critic_target": self.critic_target.state_dict()})

    def load(self, folder: Path) -> None:
        self.policies.load_role("solver", folder / "solver")
        self.load_trainer_state(folder)

    def load_trainer_state(self, folder: Path) -> None:
        """Value head, critic, optimizer and scheduler (the adapter comes from elsewhere)."""
        from safetensors.torch import load_file

        with torch.no_grad(), dist.full_parameters(self.value_head, modify=True):
            self.value_head.load_state_dict(load_file(folder / VALUE_HEAD_FILE))
        st = self.engine.load(folder)
        self.optimizer_steps = st["optimizer_steps"]
        with dist.full_parameters(self.critic, modify=True):
            self.critic.load_state_dict(st["critic"])
        self.critic_target.load_state_dict(st["critic_target"])
