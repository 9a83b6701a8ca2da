"""One optimiser step of the upper level, its evaluation of Q, and the learner's full state for
checkpoints.

Per step, for a batch of logged decisions:

1. features: one writer forward gives h(s) (and, once the text loss is on, the feedback
   tokens' log-probs); s' features come from a no-grad forward (target adapter for
   q_source=logits, the online trunk + target head for q_source=head);
2. Q losses (``objective.critic_loss``) + text_coef * AWR / filtered-BC loss;
3. one AdamW step over the writer adapter and the heads, then the target update.

Nothing here reads global RNG state except LoRA dropout (when > 0), and the batch of a
step is a pure function of (seed, step): restoring the tensors below plus the RNG state
resumes a run bit-for-bit.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import torch

from tosca_mlmt import parallel as dist
from tosca_mlmt.config import Config
from tosca_mlmt.errors import ConfigError
from tosca_mlmt.models.policies import PolicyPair
from tosca_mlmt.train.distributed import Trainer
from tosca_mlmt.upper.critic import StrategyCritic, strategy_token_ids
from tosca_mlmt.upper.dataset import Transition, batch_indices, eval_sample
from tosca_mlmt.upper.objective import (DecisionBatch, PolicySpec, advantage_stats, advantages, bc_threshold,
                                        critic_loss, text_loss, text_weights, weight_stats)
from tosca_mlmt.upper.report import QEvaluation, evaluate_q, preference_table
from tosca_mlmt.upper.trunk import TargetAdapter, WriterTrunk


class UpperLearner:
    def __init__(self, cfg: Config, policies: PolicyPair, transitions: list[Transition], strategies: list[dict],
                 resuming: bool = False):
        """``resuming``: a checkpoint will be loaded next, and with it the head's feature stats, so
        the forward over every logged state that fixes them for a fresh head is skipped."""
        self.cfg, self.uc = cfg, cfg.upper
        self.policies, self.transitions, self.strategies = policies, transitions, strategies
        self.trunk = WriterTrunk(policies)
        A = len(strategies)
        rows = bias = None
        if self.uc.q_source == "logits":
            ids = strategy_token_ids(policies.tokenizer("writer"), A)
            rows = self.trunk.lm_head.weight[ids]
            bias = self.trunk.lm_head.bias[ids] if getattr(self.trunk.lm_head, "bias", None) is not None else None
        init = policies.q_head if (policies.q_head is not None and policies.q_head.proj.out_features == A) else None
        self.critic = StrategyCritic(self.uc, self.trunk.hidden_size, A, rows, bias, init_head=init)
        if not resuming and self.critic.needs_feature_stats():  # before the trainer: ZeRO-3 would partition the trunk first
            self.critic.set_feature_stats(self.features_all())
        self.target_adapter = (TargetAdapter(self.trunk, self.uc.target_update, self.uc.target_tau,
                                             self.uc.target_sync_every) if self.uc.q_source == "logits" else None)
        groups = [{"params": list(self.trunk.params.values()), "lr": self.uc.lr}]
        if self.critic.head_parameters():
            groups.append({"params": self.critic.head_parameters(), "lr": self.uc.head_lr})
        if self.critic.table_parameters():
            groups.append({"params": self.critic.table_parameters(), "lr": self.uc.signal_lr})
        optimizer = torch.optim.AdamW(groups, weight_decay=self.uc.weight_decay)
        mbs = self.uc.micro_batch_size or self.uc.batch_size
        model = self.trunk.model
        for n, p in model.named_parameters():  # the trainer must register exactly the writer's tensors
            p.requires_grad_(n in self.trunk.params)
        # find_unused: the adapter gets no gradient while the text loss warms up (q_trunk_grad off).
        self.trainer = Trainer(cfg.distributed, {"writer": model, "critic": self.critic}, optimizer, None,
                               slots=-(-self.uc.batch_size // mbs), micro_size=mbs,
                               max_grad_norm=self.uc.max_grad_norm, what="upper.micro_batch_size",
                               find_unused=True)
        for p in self.trunk.params.values():
            p.requires_grad_(False)  # trainable only inside trunk.training()
        if self.trainer.zero_stage == 3 and self.uc.q_source == "logits":
            raise ConfigError("invalid value for field 'upper.q_source': 'logits' keeps a target copy of the "
                              "writer adapter that ZeRO-3 cannot partition; use q_source=head or ZeRO-1/2")
        self.policy = PolicySpec(cfg.episode.strategy_selection, cfg.episode.strategy_temperature, cfg.episode.epsilon)
        self.all_returns = torch.tensor([t.ret for t in transitions], dtype=torch.float32)
        self.bc_cut = (bc_threshold(self.all_returns, self.uc.bc_top_frac) if self.uc.text_loss == "filtered_bc"
                       else None)
        # upper.eval_states: the periodic evaluation and the report read these (whole episodes, so the
        # off-policy estimate still sees every round of each); every h(s) is a writer forward
        self.eval_idx = eval_sample(transitions, self.uc.eval_states, cfg.seed)
        self.eval_transitions = [transitions[i] for i in self.eval_idx]
        self.skip_unweighted_text = True  # tests turn it off to compare against reading every decision
        self.step = 0

    # ------------------------------------------------------------------ one update
    def _batch(self, idx: list[int]) -> DecisionBatch:
        trs = [self.transitions[i] for i in idx]
        table = bool(self.critic.table_parameters())
        return DecisionBatch(actions=torch.tensor([t.action for t in trs], dtype=torch.long),
                             rewards=torch.tensor([t.reward for t in trs], dtype=torch.float32),
                             dones=torch.tensor([float(t.done) for t in trs]),
                             returns=torch.tensor([t.ret for t in trs], dtype=torch.float32),
                             signals=torch.tensor([t.signal for t in trs]) if table else None,
                             next_signals=torch.tensor([self.transitions[t.next_index].signal if t.next_index >= 0
                                                        else 0 for t in trs]) if table else None)

    def _next_features(self, idx: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(online h(s'), target h(s')) [B, H] with zero rows for terminal decisions; None if all terminal."""
        trs = [self.transitions[i] for i in idx]
        rows = [j for j, t in enumerate(trs) if t.next_index >= 0]
        if not rows:
            if self.trainer.zero_stage == 3:  # every rank must run the same forwards (gathers inside)
                with torch.no_grad():
                    self.trunk.states([trs[0].state_ids])
            return None, None
        states = [self.transitions[trs[j].next_index].state_ids for j in rows]
        with torch.no_grad():
            if self.uc.q_source == "logits" and self.uc.conservatism != "iql":
                f_online, f_target = None, self.target_adapter.features(states)
            else:  # head: target head on online features; iql: V(s') on online features
                f_online = self.trunk.states(states)
                f_target = f_online
        def scatter(f):
            if f is None:
                return None
            full = f.new_zeros(len(idx), f.shape[-1])
            full[rows] = f
            return full
        return scatter(f_online), scatter(f_target)

    def update(self) -> dict[str, float]:
        """One optimiser step on the next batch; returns scalar metrics (over all ranks)."""
        uc = self.uc
        self.step += 1
        t0 = time.perf_counter()
        idx = batch_indices(len(self.transitions), uc.batch_size, self.cfg.seed, self.step)
        mbs = uc.micro_batch_size or uc.batch_size
        slots = [idx[s:s + mbs] for s in range(0, len(idx), mbs)]
        local = slots[dist.rank() * self.trainer.local_slots:(dist.rank() + 1) * self.trainer.local_slots]
        text_on = uc.text_loss != "none" and self.step > uc.warmup_steps
        self.trainer.zero_grad()
        sums: dict[str, float] = defaultdict(float)
        vecs: dict[str, list[torch.Tensor]] = defaultdict(list)
        with self.trunk.training():
            for mb in local:
                loss, out = self.trainer(self._micro_loss, mb, text_on)
                self.trainer.backward(loss, len(mb) / len(idx))  # micro-batch means -> the batch mean
                sums["loss"] += float(loss.detach()) * len(mb)
                for k in ("td_loss", "cql_term", "v_loss", "text_loss", "text_nll"):
                    if k in out:
                        sums[k] += float(out[k]) * len(mb)
                for k in ("q_sa", "v", "target", "adv", "w"):
                    if k in out:
                        vecs[k].append(out[k].detach())
        grad_norm = self.trainer.step(at=f"step {self.step}")
        with dist.full_parameters(self.critic, modify=True):  # the target head is partitioned too
            self.critic.update_target(self.step)
        if self.target_adapter is not None:
            self.target_adapter.update(self.step)
        m = {k: v / len(idx) for k, v in dist.all_sum(sums).items()}
        cat = {k: torch.cat(dist.gather(torch.cat(v))) for k, v in vecs.items()}
        m.update(q_data=float(cat["q_sa"].mean()), v=float(cat["v"].mean()), td_target=float(cat["target"].mean()),
                 grad_norm=grad_norm, text_on=float(text_on))
        m.update(advantage_stats(cat["adv"]))
        if "w" in cat:
            m.update(weight_stats(cat["w"]))
        m["samples_per_s"] = len(idx) / (time.perf_counter() - t0)
        return m

    def _micro_loss(self, mb: list[int], text_on: bool):
        """Loss of one micro-batch (run inside the trainer's forward) and its diagnostics."""
        uc = self.uc
        trunk_q_grad = uc.q_source == "logits" or uc.q_trunk_grad
        trs = [self.transitions[i] for i in mb]
        b = self._batch(mb)
        # Which decisions' feedback the text loss reads. The BC weights are known before any forward,
        # and a decision of weight 0 adds nothing to it: only its state is read, a shorter forward
        # (improved_bc clones a few % of decisions). ZeRO-3 gathers inside each forward, so there
        # every rank keeps the same forwards.
        text_rows = list(range(len(mb))) if text_on else []
        written = torch.tensor([float(t.written) for t in trs])  # a fixed sentence has no text to clone
        if text_on and self.skip_unweighted_text and uc.text_loss != "awr" and self.trainer.zero_stage != 3:
            w0 = written * text_weights(uc.text_loss, None, b.returns, uc.awr_beta, uc.awr_max_weight, self.bc_cut,
                                        b.rewards)  # BC weights read no advantage
            text_rows = [j for j in range(len(mb)) if w0[j] > 0]
        state_rows = sorted(set(range(len(mb))) - set(text_rows))
        parts, order = [], text_rows + state_rows
        if text_rows:
            h_text, logp, mask = self.trunk.full([trs[j].prompt_ids for j in text_rows],
                                                 [trs[j].response_ids for j in text_rows],
                                                 [trs[j].state_len for j in text_rows])
            parts.append(h_text)
        if state_rows:
            with torch.set_grad_enabled(trunk_q_grad):
                parts.append(self.trunk.states([trs[j].state_ids for j in state_rows]))
        h = torch.cat(parts)[torch.tensor(order).argsort()]  # back to the batch's order
        h_q = h if trunk_q_grad else h.detach()
        h_bar = h.detach()
        if self.uc.q_source == "logits" and uc.conservatism == "iql":
            h_bar = self.target_adapter.features([t.state_ids for t in trs])
        h_next, h_next_bar = self._next_features(mb)
        loss, out = critic_loss(self.critic, b, h_q, h_bar, h_next, h_next_bar, uc.gamma, uc.cql_alpha,
                                uc.iql_tau, self.policy)
        out = dict(out)
        out["adv"] = advantages(out["q_sa"], out["v"], b.returns, uc.awr_advantage)
        if uc.text_loss != "none":
            out["w"] = written * text_weights(uc.text_loss, out["adv"], b.returns, uc.awr_beta, uc.awr_max_weight,
                                              self.bc_cut, b.rewards)
        if text_rows:
            # the mean over the whole micro-batch, as if every decision had been read
            lt, tout = text_loss(logp, mask, out["w"][text_rows], over=len(mb))
            loss = loss + uc.text_coef * lt
            out.update(text_loss=float(lt.detach()), text_nll=float(tout["text_nll"]))
        elif text_on:  # no decision here is cloned: the text loss is exactly 0
            out.update(text_loss=0.0)
        return loss, out

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> QEvaluation:
        """Q of the evaluated states with the current weights, and its metrics (``evaluate_q``)
        under the policy collect would run with it."""
        q = self.q_eval()
        return QEvaluation(q, evaluate_q(q, self.eval_transitions, self.strategies, self.policy))

    def preferences(self, evaluation: QEvaluation) -> dict[str, list[dict]]:
        """The report's table (``preference_table``) from an evaluation of this learner's Q."""
        return preference_table(evaluation.q, self.eval_transitions, self.strategies, self.policy)

    @torch.no_grad()
    def q_eval(self) -> torch.Tensor:
        """Q(s, .) [M, A] of the evaluated states (``eval_transitions``) with the current weights."""
        with dist.full_parameters(self.critic):
            return self.critic.q(self.features_all(self.eval_idx),
                                 torch.tensor([t.signal for t in self.eval_transitions]))

    @torch.no_grad()
    def features_all(self, idx: list[int] | None = None) -> torch.Tensor:
        """h(s) [N, H] of every logged state (or those at ``idx``) with the current writer weights,
        on every rank."""
        idx = list(range(len(self.transitions))) if idx is None else idx
        out = []
        bs = self.uc.eval_batch_size
        mine = [idx[i] for i in dist.shard(len(idx))]  # each rank computes a share; all get every row
        with self.policies.use("writer"), self.policies.full_weights():
            for s in range(0, len(mine), bs):
                out.append(self.trunk.states([self.transitions[i].state_ids for i in mine[s:s + bs]]))
        parts = [torch.cat(p) for p in dist.gather(out) if p]
        return torch.cat(parts)

    # ------------------------------------------------------------------ checkpoint state
    def save(self, folder: Path) -> None:
        """Collective (every rank calls it); rank 0 writes adapter and heads."""
        from safetensors.torch import save_file

        self.trainer.save(folder)
        with dist.full_parameters(self.trunk.model, self.critic):  # a collective under ZeRO-3
            trunk = self.trunk.state_dict()
            heads = {k: v.detach().clone().contiguous() for k, v in self.critic.state_dict().items()}
        if not dist.is_main():
            return
        save_file({k: v.contiguous() for k, v in trunk.items()}, folder / "writer_adapter.safetensors")
        if self.target_adapter is not None:
            heads.update({"target_adapter." + k: v.clone().contiguous() for k, v in self.target_adapter.params.items()})
        save_file(heads, folder / "heads.safetensors")

    def load(self, folder: Path, step: int) -> None:
        from safetensors.torch import load_file

        heads = load_file(folder / "heads.safetensors")
        if self.target_adapter is not None:
            for k in self.target_adapter.params:
                self.target_adapter.params[k] = heads.pop("target_adapter." + k)
        with dist.full_parameters(self.trunk.model, self.critic, modify=True):
            self.trunk.load_state_dict(load_file(folder / "writer_adapter.safetensors"))
            self.critic.load_state_dict(heads)
        self.trainer.load(folder)
        self.step = step

    def close(self) -> None:
        self.trainer.close()

    def export_writer(self, folder: Path) -> Path:
        """The trained writer (adapter + Q head + strategy list), loadable as model.writer_adapter."""
        with dist.full_parameters(self.critic):
            self.policies.q_head = self.critic.exported_head()
        self.policies.q_decisions = len(self.transitions)
        self.policies.strategies = [dict(s) for s in self.strategies]
        self.policies.save_role("writer", folder)
        dist.barrier()  # other ranks may read it next (train-joint's next step)
        return Path(folder)
