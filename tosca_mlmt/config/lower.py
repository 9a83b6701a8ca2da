"""``lower:`` section: PPO for the solver with the context-dependency bonus."""

from __future__ import annotations

from dataclasses import dataclass, field

from tosca_mlmt.config.knobs import Rule, knob
from tosca_mlmt.config.section import Section, advise, need

# The allowed values of lower.advantage, lower.policy_loss and lower.bonus.gate are the names
# of the algos/ registries (ADVANTAGES, POLICY_LOSSES, GATES). They cannot be read from there:
# config/ imports only the ground floor (tests/properties/test_architecture.py), algos/ takes knobs as
# arguments and never a config, and algos/ loads torch, while a config error or `mlmt config`
# should answer before torch is loaded. So the names are listed once here, each registry files
# its functions under the same names, and tests/unit/config/test_config.py fails when the two sets differ.
ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce", "archer")
POLICY_LOSSES = ("ppo_clip", "reinforce")
BONUS_GATES = ("none", "improvement", "advantage_sign")
OR_EPISODE = "-1 (episode's own value) or "
STRATEGY_TEMPERATURE = Rule(OR_EPISODE + "> 0", lambda v: v == -1 or v > 0)
STRATEGY_EPSILON = Rule(OR_EPISODE + "in [0, 1]", lambda v: v == -1 or 0 <= v <= 1)


@dataclass
class ScoreShaping(Section):
    enabled: bool = knob(False, "SCoRe-style two-stage shaping (stage I anchors turn 1, stage II adds a progress bonus).")
    stage1_steps: int = knob(10, "Iterations in stage I before stage II starts.", min=0)
    alpha: float = knob(10.0, "Stage II progress bonus alpha * (r_final - r1) on the final turn.", min=0.0)
    beta1: float = knob(0.01, "Stage II KL weight on every solver turn.", min=0.0)
    beta2: float = knob(0.1, "Stage I KL weight on turn 1 (keeps the first attempt near the base).", min=0.0)


@dataclass
class ContextBonus(Section):
    coef: float = knob(0.1, "lambda: weight of the KL-maximization bonus (0 turns it off).", min=0.0)
    clip: float = knob(1.0, "c: each bonus term is clipped to [-c, c] before weighting (the clip rate is logged "
                            "as bonus/clip_rate; a warning says when it exceeds 50%).", min=0.0, min_exclusive=True)
    level: str = knob("sequence", "One term per refine, spread over its tokens, or one per token.",
                      choices=("token", "sequence"))
    reduce: str = knob("mean", "sequence level: the per-token log-ratios of a refine are averaged (length-normalised) "
                               "or summed.", choices=("mean", "sum"))
    gate: str = knob("improvement", "Sign of the bonus: none = ungated (rewards any departure from z, kept for the "
                                    "ablation); improvement = times r(refine) - r(previous turn); advantage_sign = "
                                    "times the sign of the refine's advantage.",
                     choices=BONUS_GATES)
    model: str = knob("policy", "Who scores log pi(y | x, z) without the feedback: the current policy (no grad) or "
                                "the frozen reference (adapter off).", choices=("policy", "reference"))
    scorer: str = knob("auto", "Who computes the bonus's two log-probs: trainer = no-grad forwards of the "
                               "training model (pi_old of the batch, and the refines with g cut out); engine = "
                               "the rollout engine: log pi(y | x, z, g) is its logged sampling log-prob and "
                               "log pi(y | x, z) one prefill (vLLM prompt log-probs), so no trainer forward runs "
                               "before the update (with lower.old_logprobs=auto and one optimizer step per "
                               "batch, none at all). Same weights (pi_old), other kernels: equal to float "
                               "rounding in fp32 and to bf16 rounding in bf16, as the trainer's own bf16 forwards "
                               "are. engine: online "
                               "train-lower only (snapshots bring no engine), bonus.model=policy only. auto = "
                               "engine where it is faster and allowed (a vLLM engine sampled the batch, "
                               "bonus.model=policy), else trainer; logged per iteration as "
                               "lower/bonus/engine_scored (0 where no bonus is computed: coef 0 or "
                               "train_refine=false).",
                       choices=("auto", "trainer", "engine"))

    def check(self, prefix: str) -> None:
        # the engine serves the policy's weights; the adapter-off reference is only in the trainer
        need(self.scorer != "engine" or self.model == "policy", f"{prefix}scorer",
             f"engine scores the policy the engine serves; {prefix}model=reference needs {prefix}scorer=trainer or auto")


@dataclass
class LowerConfig(Section):
    iterations: int = knob(4, "PPO iterations (each: collect a batch, score, update).", min=1)
    problems_per_iteration: int = knob(4, "Problems per iteration (x episode.n_samples episodes, x lower.refine_samples "
                                          "under refine groups); from snapshots, that many problems' logged "
                                          "episode groups, never split.", min=1)
    strategy_temperature: float = knob(-1.0, "Softmax temperature over the writer's Q when train-lower's batches "
                                             "choose strategies; -1 = episode.strategy_temperature. Low: the solver "
                                             "learns to answer the strategies the trained writer gives (mlmt eval "
                                             "picks by Q), not collect's near-uniform exploration, under which "
                                             "'confirm' goes to wrong attempts as often as to right ones.",
                                     rule=STRATEGY_TEMPERATURE)
    strategy_epsilon: float = knob(-1.0, "Uniform share of train-lower's strategy choice; -1 = episode.epsilon.",
                                   rule=STRATEGY_EPSILON)
    advantage: str = knob("grpo", "Advantage estimator; archer = ArCHer's utterance-level double Q/V critic with "
                                  "target networks.", choices=ADVANTAGE_ESTIMATORS)
    archer_tau: float = knob(0.1, "archer: Polyak rate of the target critic (ArCHer's 0.1).",
                             min=0.0, max=1.0, min_exclusive=True)
    critic_lr: float = knob(1e-3, "archer: learning rate of the utterance-level Q/V heads.",
                            min=0.0, min_exclusive=True)
    policy_loss: str = knob("ppo_clip", "Policy loss.", choices=POLICY_LOSSES)
    loss_agg: str = knob("token-mean", "How token losses are averaged.", choices=("token-mean", "seq-mean-token-mean"))
    grpo_norm_std: bool = knob(True, "grpo: divide by the group std (off = Dr. GRPO style).")
    reinforce_baseline: bool = knob(True, "reinforce: subtract the batch-mean return per turn.")
    gamma: float = knob(1.0, "Discount for gae (tokens) and archer (turns); grpo/rloo/reinforce use turn_gamma.", min=0.0, max=1.0)
    lam: float = knob(0.95, "GAE lambda.", min=0.0, max=1.0)
    turn_gamma: float = knob(1.0, "grpo/rloo/reinforce: weight of later turns' rewards in a turn's return, "
                                  "R_k = r_k + turn_gamma R_{k+1}. 1 = reward-to-go (a right first answer "
                                  "that a refine breaks scores like a wrong one it fixes); 0 = each turn "
                                  "by its own reward (turn 1 then learns exactly as single-turn GRPO; "
                                  "MT-GRPO's turn advantage). gae and archer discount with gamma.",
                          min=0.0, max=1.0)
    clip_low: float = knob(0.2, "PPO clip epsilon below 1.", min=0.0, max=1.0, min_exclusive=True, max_exclusive=True)
    clip_high: float = knob(0.2, "PPO clip epsilon above 1 (raise for 'clip-higher').", min=0.0, min_exclusive=True)
    value_clip: float = knob(0.2, "Value-loss clip range.", min=0.0, min_exclusive=True)
    vf_coef: float = knob(0.5, "Value-loss weight (gae only; other estimators train no critic). The value head "
                               "reads the solver's last hidden states undetached, so the value loss also moves "
                               "the solver's adapter, as in TRL's value-head models (ArCHer's critic reads "
                               "detached features).", min=0.0)
    lr: float = knob(1e-4, "Learning rate of the solver adapter (LoRA).", min=0.0, min_exclusive=True)
    value_lr: float = knob(1e-3, "Learning rate of the value head.", min=0.0, min_exclusive=True)
    weight_decay: float = knob(0.0, "AdamW weight decay.", min=0.0)
    warmup_steps: int = knob(0, "Linear learning-rate warm-up, in optimizer steps.", min=0)
    epochs: int = knob(1, "PPO epochs over each batch.", min=1)
    minibatch_size: int = knob(4, "Trajectories per optimizer step (after accumulation).", min=1)
    grad_accum: int = knob(1, "Micro-batches per mini-batch (minibatch_size must divide by it).", min=1)
    max_grad_norm: float = knob(1.0, "Gradient clipping by global norm.", min=0.0, min_exclusive=True)
    kl_coef: float = knob(0.0, "beta: KL(pi || pi_ref) weight (reference = base with the adapter off).", min=0.0)
    kl_estimator: str = knob("k3", "Per-token KL estimator.", choices=("k1", "k3"))
    kl_mode: str = knob("reward", "KL as a per-token reward penalty or as a loss term. With grpo and grpo_norm_std "
                                  "use loss: as a reward, the std division turns the penalties' tiny spread in a "
                                  "group whose task rewards tie into +-1 advantages for short answers (a warning "
                                  "when the config loads).", choices=("reward", "loss"))
    turn_rewards: str = knob("each", "Reward every solver turn by its own correctness, or only the final one.",
                             choices=("each", "final"))
    score: ScoreShaping = field(default_factory=ScoreShaping)
    bonus: ContextBonus = field(default_factory=ContextBonus)
    mask_truncated: bool = knob(False, "Leave solver turns that ran into solver_sampling.max_new_tokens (finish_reason "
                                       "'length') out of the PPO loss, as TRL's mask_truncated_completions and DAPO's "
                                       "overlong filtering do: a cut turn never wrote its answer, so its reward says "
                                       "nothing about the tokens it did write. Its reward still enters the advantage "
                                       "estimate (the group's baseline) and its tokens stay in the context of later "
                                       "turns; the policy, value and KL-loss terms skip them, and the turns masked are "
                                       "logged (lower/truncated_turns, lower/loss_tokens).")
    train_refine: bool = knob(True, "Train the solver on its refines too (the method). false = the masked-refine "
                                    "control: every refine's tokens leave the PPO loss (policy, value and KL-loss "
                                    "terms), so only turn 1 is trained, and the refines are still sampled, rewarded "
                                    "and in the advantage estimate. It asks whether training the refine interferes "
                                    "with turn 1 (configs/mlmt-masked-refine.yaml). The context bonus, which moves "
                                    "only refine tokens, is then not computed; lower/loss_tokens logs what is left.")
    refine_samples: int = knob(1, "Refines sampled per (x, z, g) in train-lower's online batches: 1 = one refine "
                                      "per attempt (the method as published). k > 1 = refine groups: every attempt "
                                      "and its feedback are refined k times, and a group-relative estimator (grpo, "
                                      "rloo) compares a refine only with the other refines of the same attempt and "
                                      "feedback, so what a refine is credited for is what it did with that feedback, "
                                      "not which attempt it started from. Turn 1 still groups by problem and is "
                                      "trained once per attempt. Costs k refines per attempt in generation and in the "
                                      "update; needs episode.rounds 1 and solver_sampling.temperature > 0.", min=1)
    old_logprobs: str = knob("auto", "PPO's pi_old: recompute = a no-grad forward with the weights that sampled "
                                     "(on-policy); auto = the same, but the forward is skipped for the rows where "
                                     "pi_old is exactly pi_theta at the loss, with epochs 1 the first minibatch's "
                                     "(a batch of one minibatch: all, as TRL does with num_iterations 1), where "
                                     "nothing else reads it before the update (no value head, critic, KL in the "
                                     "reward, or trainer-scored bonus on refines; a one-minibatch batch also no "
                                     "reference). lower/old_pass logs the share of rows scored, and the pre-update "
                                     "kl and entropy diagnostics are over those rows; "
                                     "behaviour = the engine's logged sampling logprobs (needed for off-policy "
                                     "snapshots).",
                             choices=("auto", "recompute", "behaviour"))
    logprob_temperature: str = knob(
        "raw", "The distribution PPO's ratio, the KL and the context bonus score the solver's tokens under. raw = "
               "the model's own (temperature 1): what the engines log, so lower.old_logprobs=behaviour and "
               "lower.bonus.scorer=engine can reuse their log-probs; the PPO batches are drawn at "
               "solver_sampling.temperature, so the ratio's gradient is not the sampling policy's. sampling = "
               "softmax(logits / solver_sampling.temperature), the distribution the batches were drawn from, as "
               "verl and TRL score it: the first minibatch's ratio is the sampling policy's exactly (top_p / top_k "
               "truncation is not modelled, as there). Every "
               "log-prob then comes from the trainer (the engines log raw ones): it needs old_logprobs auto or "
               "recompute and a bonus scorer other than engine.", choices=("raw", "sampling"))
    logprob_chunk: int = knob(256, "Positions per row in one LM-head chunk: at most rows x chunk positions' fp32 logits "
                               "exist at a time (memory ~ chunk x vocab per row, not length x vocab). The head runs only "
                               "on the positions the loss reads (the action tokens).", min=1)
    score_batch: int = knob(4, "Rows per no-grad scoring forward (old/ref/bonus log-probs); 0 = a rank's whole "
                                  "share at once. Bounds memory (the whole share's activations and hidden states "
                                  "at once lift a CPU run's peak by GiBs), and with a value that divides every rank's share "
                                  "the forwards have the same shapes at any world size (bf16 results depend on "
                                  "shapes; fp32 ones only at ~1e-7).", min=0)
    autocast: str = knob("auto", "bf16 autocast for forward/backward: auto = when the hardware has bf16.",
                         choices=("auto", "bf16", "none"))
    gradient_checkpointing: bool = knob(False, "Recompute activations in backward (less memory, more compute).")
    save_every: int = knob(2, "Checkpoint every N iterations (and always at the end).", min=1)
    keep_checkpoints: int = knob(2, "How many checkpoints to keep.", min=1)
    keep_snapshots: bool = knob(True, "Write each online iteration's batch as a snapshot under <run>/snapshots.")

    @property
    def bonus_on(self) -> bool:
        """Whether an update computes the context bonus: it lands on refine tokens only, so neither a zero
        coefficient nor the masked-refine control (train_refine=false, refines out of the loss) computes it."""
        return self.bonus.coef > 0 and self.train_refine

    def check(self, prefix: str) -> None:
        # the engines log raw (temperature-1) log-probs, which are not the tempered distribution's
        tempered = self.logprob_temperature == "sampling"
        need(not tempered or self.old_logprobs != "behaviour", f"{prefix}old_logprobs",
             f"behaviour reads the engine's raw log-probs; {prefix}logprob_temperature=sampling needs auto or recompute")
        need(not tempered or self.bonus.scorer != "engine", f"{prefix}bonus.scorer",
             f"the engine scores raw log-probs; {prefix}logprob_temperature=sampling needs trainer or auto")
        # Accumulation splits each mini-batch into equal micro-batches.
        need(self.minibatch_size % self.grad_accum == 0, f"{prefix}grad_accum",
             f"must divide {prefix}minibatch_size ({self.minibatch_size})")
        # gae and archer bootstrap through values and discount with gamma; a silent no-op knob would
        # let a user believe turn 1 was credited by its own reward
        need(self.turn_gamma == 1.0 or self.advantage in ("grpo", "rloo", "reinforce"), f"{prefix}turn_gamma",
             f"applies to the turn-level estimators (grpo, rloo, reinforce), not {prefix}advantage={self.advantage}; "
             f"use {prefix}gamma")


def kl_reward_collapse(lo: LowerConfig, prefix: str = "lower.") -> str | None:
    """Why ``lo`` is the combination a benchmark saw collapse a solver, or None: a KL penalty in the
    reward (kl_coef > 0, or SCoRe's own KL terms) under grpo's division by the group std."""
    if not (lo.kl_mode == "reward" and (lo.kl_coef > 0 or lo.score.enabled) and lo.advantage == "grpo"
            and lo.grpo_norm_std):
        return None
    kl = f"{prefix}kl_coef={lo.kl_coef}" if lo.kl_coef > 0 else f"{prefix}score.enabled (its KL terms)"
    return (f"{prefix}kl_mode=reward ({kl}) with {prefix}advantage=grpo and {prefix}grpo_norm_std=true: in a group "
            "whose task rewards tie (most groups while accuracy is low), dividing by the group std blows the "
            "per-token KL penalties' tiny spread up to +-1 advantages that favour short answers (benchmarks: a "
            f"solver collapsed to 6 % Acc@t1). Use {prefix}kl_mode=loss (GRPO's form) or {prefix}grpo_norm_std=false")


def warn_kl_reward_collapse(lo: LowerConfig, prefix: str = "lower.") -> None:
    """A :class:`~tosca_mlmt.config.section.ConfigWarning` for :func:`kl_reward_collapse`. The loader
    says it (Config.check, once the whole config is valid); LowerLearner calls it again for configs
    built or replace-d in code. Said once per section object."""
    message = kl_reward_collapse(lo, prefix)
    if message:
        advise(lo, message)
