"""``upper:`` section: offline strategic Q-learning and AWR for the feedback writer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tosca_mlmt.config.knobs import ID_LIST, knob
from tosca_mlmt.config.section import Section, need


@dataclass
class UpperConfig(Section):
    snapshots: list = knob(dataclasses.MISSING, "Snapshot ids, or prefixes of exactly one id, to learn from "
                           "(train-upper --snapshot, repeatable; recorded as full ids).",
                           default_factory=list, rule=ID_LIST)
    snapshot_root: str = knob("", "Folder searched (recursively) for the snapshots (empty = collect.out).")
    # ---- optimisation
    steps: int = knob(200, "Gradient steps (each on one batch of strategy decisions).", min=1)
    batch_size: int = knob(16, "Strategy decisions (writer turns) per gradient step.", min=1)
    micro_batch_size: int = knob(0, "Decisions per forward pass (gradient accumulation); 0 = the whole batch.", min=0)
    lr: float = knob(1e-5, "AdamW learning rate of the writer's LoRA adapter (ArCHer's lm_lr).",
                     min=0.0, min_exclusive=True)
    head_lr: float = knob(1e-4, "AdamW learning rate of the Q and V heads. Adam moves each weight ~lr per step, so "
                                "Q moves ~lr * sum|h_i| (about 0.06 for smollm2's 576 features of size ~1).",
                          min=0.0, min_exclusive=True)
    weight_decay: float = knob(0.0, "AdamW weight decay.", min=0.0)
    max_grad_norm: float = knob(1.0, "Gradient clipping by global norm (adapter and heads together).",
                                min=0.0, min_exclusive=True)
    # ---- the strategy-level MDP
    reward: str = knob("improvement", "Reward of a decision: 'improvement' = each round's r_k - r_{k-1} (sums to "
                                      "r_final - r1); 'counterfactual' = r_k - r(the refine the same solver wrote "
                                      "without g_k) (needs episode.counterfactual); 'gold_prob' = p_gold(y_k) - "
                                      "p_gold(y_{k-1}), the rise in the solver's probability of the gold answer "
                                      "(needs episode.gold_prob; RLPR's reference likelihood as an improvement); "
                                      "'final' = correctness of the last attempt, mostly decided by whether z was "
                                      "right.",
                       choices=("improvement", "counterfactual", "gold_prob", "final"))
    break_penalty: float = knob(0.5, "Subtracted from a round's reward when it turns a correct attempt wrong.", min=0.0)
    gamma: float = knob(0.95, "Discount between feedback rounds (K > 1); ArCHer's 0.95. Unused when K = 1.",
                        min=0.0, max=1.0)
    # ---- the Q model
    q_source: str = knob("head", "Where Q(s, .) is read: 'head' = a linear Q head on the writer's last hidden "
                                 "state of s; 'logits' = ToSCA's LM logits of the strategy-index tokens '1'..'K' "
                                 "at the same position (trains the adapter; exported as an equivalent Q head).",
                         choices=("head", "logits"))
    q_trunk_grad: bool = knob(False, "head only: let TD gradients flow into the writer adapter. Off by default: the "
                                     "adapter is also the feedback-text policy, and a value loss should not drag it.")
    q_signal: bool = knob(False, "head only: add a table T[o, a] to Q over what episode.writer_sees told the writer "
                                 "about the last attempt (o: its level, e.g. verdict incorrect/correct; one row "
                                 "under writer_sees=none, where T is a per-strategy bias). A few hundred decisions "
                                 "fit 2-3 x A cells; they do not fit a direction in the hidden state. Learned at "
                                 "upper.signal_lr; saved in the writer's Q head.")
    signal_lr: float = knob(0.02, "AdamW learning rate of the Q head's signal table (upper.q_signal). Adam moves a "
                                  "cell ~lr per step it is in the batch, so 0.02 covers a reward of 1 in ~50 steps.",
                            min=0.0, min_exclusive=True)
    q_standardize: bool = knob(True, "Standardise h(s) per feature (mean and std over the logged states, fixed "
                                     "when the head is created and saved with it) before the linear Q head "
                                     "(q_source=head) and the IQL V head (either q_source). "
                                     "Raw hidden states are dominated by a few large features common to every "
                                     "state; what tells states apart (e.g. the verdict) is a small direction.")
    conservatism: str = knob("cql", "Offline over-estimation control. cql (default): the strategy is picked by "
                                    "softmax/argmax over Q at collect time, so Q of never-logged strategies must be "
                                    "held down exactly where it is read; iql backs up through an expectile V(s') and "
                                    "never queries unseen actions, but leaves their Q unconstrained at decision time.",
                             choices=("cql", "iql", "none"))
    cql_alpha: float = knob(0.5, "CQL weight alpha on logsumexp_a Q(s, a) - Q(s, a_data).", min=0.0)
    iql_tau: float = knob(0.7, "IQL expectile tau for V (0.5 = mean of Q over logged actions, -> 1 = max); ILQL's 0.7.",
                          min=0.0, max=1.0, min_exclusive=True, max_exclusive=True)
    target_update: str = knob("polyak", "Target network update: Polyak averaging every step, or a hard copy.",
                              choices=("polyak", "hard"))
    target_tau: float = knob(0.05, "Polyak rate: theta_bar <- (1 - tau) theta_bar + tau theta (a ~20-step memory, "
                                   "sized for runs of hundreds of steps).", min=0.0, max=1.0, min_exclusive=True)
    target_sync_every: int = knob(10, "Hard sync period in steps (ToSCA's target_update_steps).", min=1)
    # ---- the feedback text
    text_loss: str = knob("awr", "Fit the logged feedback tokens: awr = weights clip(exp(A / beta)); "
                                 "filtered_bc = weight 1 on the top-returning decisions only; improved_bc = weight 1 "
                                 "on decisions whose round reward is positive (the feedback fixed the answer); "
                                 "none = Q only.",
                          choices=("awr", "filtered_bc", "improved_bc", "none"))
    awr_advantage: str = knob("q_minus_v", "A for AWR: q_minus_v = Q(s, a) - V(s) (how good the strategy was); "
                                           "return_minus_q = G - Q(s, a) (how good this text was for its strategy).",
                              choices=("q_minus_v", "return_minus_q"))
    awr_beta: float = knob(0.5, "AWR temperature beta; rewards are in [0, 1], so A/beta spans about +-2.",
                           min=0.0, min_exclusive=True)
    awr_max_weight: float = knob(20.0, "Clip of exp(A / beta) (AWR's 20): bounds one decision's pull on the text.",
                                 min=1.0)
    bc_top_frac: float = knob(0.5, "filtered_bc: keep decisions whose return is in the top fraction (ties kept; "
                                   "never the lowest return when anything beats it).",
                              min=0.0, max=1.0, min_exclusive=True)
    text_coef: float = knob(1.0, "Weight of the feedback-text loss next to the Q losses.", min=0.0)
    warmup_steps: int = knob(50, "Q-only steps before the text loss starts (ArCHer's critic warm-up): "
                                 "advantages from an untrained Q are noise.", min=0)
    # ---- bookkeeping
    save_every: int = knob(50, "Checkpoint period in steps (the last step is always saved).", min=1)
    keep_checkpoints: int = knob(2, "Checkpoints kept on disk (oldest pruned).", min=1)
    log_every: int = knob(10, "Metrics period in steps.", min=1)
    eval_every: int = knob(50, "Full-dataset Q evaluation period (Q by strategy, importance-weighted policy value).",
                           min=1)
    eval_states: int = knob(0, "Logged decisions the periodic evaluation and the report read: a fixed seeded "
                               "sample of whole episodes with at least this many decisions; 0 = all. Each is a "
                               "writer forward, so over a growing replay (train-joint) the full evaluation costs "
                               "more than the update itself.", min=0)
    eval_batch_size: int = knob(16, "States per forward pass in evaluation and the report.", min=1)

    def check(self, prefix: str) -> None:
        need(not self.q_signal or self.q_source == "head", f"{prefix}q_signal",
             "needs q_source=head (the signal table is part of the Q head)")
        need(self.micro_batch_size <= self.batch_size, f"{prefix}micro_batch_size",
             f"must be at most {prefix}batch_size ({self.batch_size}); 0 = the whole batch")
