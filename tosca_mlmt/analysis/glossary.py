"""What every logged metric means: the source of the docs' metrics glossary (docs/reference/metrics.md).

A key written to ``metrics.jsonl`` that matches no entry here fails the tiny train-joint test, so a new
metric arrives with its meaning. ``<name>`` in a key stands for a part that varies (a stage, a strategy, a
turn index); it matches one or more characters. Episode summaries (``summarize``) appear under several
prefixes (``collect/``, ``eval/``, ``lower/``, ``joint/collect/``), so they are written once, under
``<prefix>/``, and PREFIXES says where each prefix comes from. Pure data: imports nothing.
"""

from __future__ import annotations

import re

PREFIXES = {
    "collect/": "`mlmt collect` and each collect of `train-joint` (the writer's training batch, sampled).",
    "eval/": "`mlmt eval` and the held-out eval of each `train-joint` round (greedy unless configured).",
    "lower/": "each PPO iteration of `train-lower` (its batch of episodes, sampled, and its update).",
    "joint/collect/": "`train-joint`'s copy of its round's collect summary on the joint timeline.",
    "upper/": "each optimizer step of `train-upper` (and its periodic evaluation of Q on every logged state).",
    "joint/": "`train-joint`'s own bookkeeping: rounds, stage seconds and peaks.",
}

# Episode summaries (tosca_mlmt/metrics.py: summarize), under each prefix of PREFIXES but upper/ and joint/.
SUMMARY = {
    "acc_t1": "Acc@t1: share of episodes whose first solver answer z is correct.",
    "acc_final": "Acc@final: share of episodes whose last refine ŷ is correct.",
    "delta": "Acc@final − Acc@t1: what the feedback rounds changed (= wrong_to_right − right_to_wrong).",
    "wrong_to_right": "Share of all episodes whose first answer was wrong and final answer right (SCoRe's Δi→c).",
    "right_to_wrong": "Share of all episodes whose first answer was right and final answer wrong (Δc→i).",
    "environment": "What the writer saw: `honest`, or `privileged:<what>` (a sanity check, never a result).",
    "episodes": "Number of episodes summarised.",
    "format_lost_t1": "Share of first answers without an answer line the verifier could read.",
    "format_lost_final": "Share of final answers without an answer line the verifier could read.",
    "wrong_number_t1": "Share of first answers with a readable but wrong answer.",
    "wrong_number_final": "Share of final answers with a readable but wrong answer.",
    "reward_mean_t1": "Mean verifier reward of the first answer z over episodes: partial credit counts here, not "
                      "in Acc@t1 (reward ≥ 1).",
    "reward_mean_final": "Mean verifier reward of the final answer over episodes (partial credit included).",
    "reward_std_t1": "Spread (population std over episodes) of the first answer's reward; unlike `lower/reward_std`, "
                     "not within groups.",
    "reward_std_final": "Spread (population std over episodes) of the final answer's reward.",
    "frac_reward_zero_std_t1": "Share of the problems with several samples whose samples' first answers all got the "
                               "same reward: no spread, so no GRPO signal (absent with one sample per problem).",
    "frac_reward_zero_std_final": "The same share for the final answers' rewards (absent with one sample per "
                                  "problem).",
    "finish_<reason>/<role>": "Share of `<role>` turns (solve, feedback, refine) that ended for `<reason>` "
                              "(`stop`: a stop string or the answer line; `length`: the token limit).",
    "len_<role>": "Mean length in tokens of the `<role>` turns (solve, feedback, refine).",
    "leak_rate": "Share of feedback turns that state the gold answer (absent where not measurable, e.g. code).",
    "reward/<metric>": "Mean of the extra metric `<metric>` that the `task.reward` function logged "
                       "(`context.log_metric`) over the solver turns that logged it (docs/guides/own-task.md).",
    "strategy_count/<strategy>": "Feedback turns that used `<strategy>`.",
    "strategy_share/<strategy>/after_<right|wrong>": "Share of the feedback after a right (wrong) attempt that "
                                                     "used `<strategy>`: equal shares say the choice ignores "
                                                     "correctness.",
}

# Keys of collect and eval runs besides the summary, under collect/ and eval/.
COLLECT = {
    "gen_seconds": "Seconds spent generating all turns.",
    "gen_tokens": "Tokens generated over all turns.",
    "tokens_per_s": "Generated tokens per second of generation.",
    "score_seconds": "Seconds spent verifying turns.",
    "processes": "Processes that collected (one shard of the problems each).",
    "truncated_prompts": "Prompts cut from the left to fit the context window.",
    "prefix_hit_rate": "Share of prompt tokens vLLM served from its prefix cache.",
    "reward_calls": "Calls of a user reward function (`task.reward`).",
    "reward_errors": "Reward calls that raised or returned no number (each scored 0).",
    "time/<step>": "Seconds of a named collect step (load_task, load_models, start_engine, episodes, "
                           "write_snapshot).",
}

LOWER = {
    "lower/iteration": "PPO iteration index.",
    "lower/step": "The stage's global step on its timeline.",
    "lower/stage": "Which stage of the PPO iteration wrote the record.",
    "lower/snapshot": "Id of the snapshot holding this iteration's batch of episodes.",
    "lower/iteration_seconds": "Wall seconds of the whole iteration.",
    "lower/time/<step>": "Seconds of a named step of the iteration (generate, score, snapshot, old_ref_logprobs, "
                         "advantages, bonus, update, weight_sync, engine_sync_total).",
    "lower/gen_tokens_per_s": "Generated tokens per second of the rollout step.",
    "lower/train_tokens_per_s": "Trained (loss) tokens per second of the update step.",
    "lower/train_tokens": "Action tokens in the batch (the loss mask's sum before truncation masking).",
    "lower/loss_tokens": "Tokens the loss was taken over.",
    "lower/truncated_turns": "Solver turns cut at the token limit in the batch.",
    "lower/truncated_turns_masked": "Cut turns left out of the loss (`lower.mask_truncated`).",
    "lower/reward_mean": "Mean episode return of the batch (sum of its turns' verifier rewards).",
    "lower/reward_std": "Mean within-group spread of returns (TRL's reward_std).",
    "lower/frac_reward_zero_std": "Share of groups whose returns are all equal: they carry no GRPO gradient.",
    "lower/refine_group_reward_std": "Refine groups (`lower.refine_samples` > 1): mean spread of the refines' "
                                     "rewards within an attempt's group.",
    "lower/refine_group_frac_reward_zero_std": "Refine groups: share of attempts whose sampled refines all got the "
                                               "same reward (no refine gradient from them).",
    "lower/reward_turn<k>": "Mean verifier reward of solver turn k (0: the first answer, 1: the first refine).",
    "lower/reward_errors": "Reward calls in this iteration that failed (each scored 0).",
    "lower/kl": "Mean per-token KL(π_old ‖ π_ref) estimate over scored action tokens.",
    "lower/kl/turn<k>": "The same KL over solver turn k's tokens only.",
    "lower/entropy": "Mean per-token entropy of π_old over scored action tokens.",
    "lower/adv_mean": "Mean advantage over action tokens.",
    "lower/adv_std": "Standard deviation of advantages over action tokens.",
    "lower/token_reward_sum": "Sum of per-token rewards (verifier, KL in the reward, bonus) per trajectory.",
    "lower/explained_variance": "Explained variance of the returns by the value head (GAE only).",
    "lower/old_pass": "Share of rows whose π_old forward was skipped because they equal the current policy.",
    "lower/policy_loss": "Clipped PPO surrogate loss (mean over micro-batches).",
    "lower/value_loss": "Value head loss (GAE only).",
    "lower/vf_clipfrac": "Share of value predictions clipped (GAE only).",
    "lower/clipfrac": "Share of tokens whose probability ratio was clipped.",
    "lower/approx_kl": "Approximate KL(π_old ‖ π) over the update (k3 estimator).",
    "lower/ratio_mean": "Mean probability ratio π/π_old over action tokens.",
    "lower/grad_norm": "Gradient norm before clipping.",
    "lower/lr": "Learning rate of the last optimizer step.",
    "lower/optimizer_steps": "Optimizer steps taken so far.",
    "lower/peak_rss_gib": "Peak resident memory of the process so far, GiB.",
    "lower/peak_gpu_gib": "Peak GPU memory torch's allocator held so far, GiB (CUDA runs only).",
    "lower/prefix_hit_rate": "Share of prompt tokens the rollout engine served from its prefix cache.",
    "lower/sync_route": "How the post-update weight sync reached vLLM (file, direct, shared, bytes).",
    "lower/engine_logprob_gap_mean": "Mean |engine − trainer| log-prob of the sampled tokens: a weight-sync check.",
    "lower/engine_logprob_gap_max": "Largest |engine − trainer| log-prob of a sampled token.",
    "lower/engine_kl": "KL(engine ‖ trainer) on the engine's own samples (k3 estimator).",
    "lower/bonus/mean": "Mean context-dependency bonus added to a refine (after clip and gate).",
    "lower/bonus/raw_logratio_mean": "Mean raw log π(ŷ|x,z,g) − log π(ŷ|x,z) before clip and gate.",
    "lower/bonus/clip_rate": "Share of refines whose bonus was clipped.",
    "lower/bonus/gate_mean": "Mean gate value (`lower.bonus_gate`) over refines.",
    "lower/bonus/corr_correct": "Correlation of the bonus with the refine's correctness.",
    "lower/bonus/engine_scored": "1 when the bonus's no-feedback log-probs came from the rollout engine, 0 from the trainer "
                                 "or when no bonus was computed (coef 0, lower.train_refine false).",
    "lower/bonus/<transition>/count": "Refines of a transition (right_to_right, right_to_wrong, wrong_to_right, "
                                      "wrong_to_wrong) in the batch.",
    "lower/bonus/<transition>/mean": "Mean bonus of the transition's refines.",
    "lower/bonus/<transition>/raw_mean": "Mean raw log-ratio of the transition's refines.",
}

UPPER = {
    "upper/step": "Optimizer step of the writer.",
    "upper/loss": "Total loss of the step (TD + CQL + value + text terms).",
    "upper/td_loss": "Temporal-difference loss of Q against its target.",
    "upper/td_target": "Mean TD target.",
    "upper/cql_term": "Conservative Q-learning penalty (`upper.cql_alpha` > 0).",
    "upper/v_loss": "Expectile value loss (IQL-style objectives).",
    "upper/text_loss": "Weighted negative log-likelihood of the feedback text (`upper.text_loss`).",
    "upper/text_nll": "Unweighted mean negative log-likelihood of the feedback text.",
    "upper/text_on": "1 when the text loss was on at this step (after warm-up), else 0.",
    "upper/q_data": "Mean Q of the logged (state, strategy) pairs in the batch.",
    "upper/v": "Mean state value in the batch.",
    "upper/adv_mean": "Mean advantage Q − V of the logged strategies in the batch.",
    "upper/adv_std": "Standard deviation of those advantages.",
    "upper/adv_min": "Smallest advantage in the batch.",
    "upper/adv_max": "Largest advantage in the batch.",
    "upper/w_mean": "Mean weight of the text loss (advantage-weighted regression).",
    "upper/w_max": "Largest text-loss weight.",
    "upper/w_ess_frac": "Effective sample size of the text-loss weights as a share of the batch.",
    "upper/grad_norm": "Gradient norm before clipping.",
    "upper/samples_per_s": "Transitions trained per second.",
    "upper/q/<strategy>": "Mean Q of `<strategy>` over every logged state (evaluation steps).",
    "upper/v_mean": "Mean value of the writer's policy over every logged state.",
    "upper/greedy_agrees_with_data": "Share of logged states where argmax Q is the logged strategy.",
    "upper/ope/value": "Importance-weighted estimate of the writer policy's return on the logged episodes.",
    "upper/ope/behaviour_value": "Mean logged return (the behaviour policy's value).",
    "upper/ope/ess": "Effective sample size of the importance weights.",
    "upper/ope/ess_frac": "That size as a share of the logged episodes.",
    "upper/ope/max_rho": "Largest importance weight.",
    "upper/ope/greedy_<stat>": "The same estimates for the greedy (argmax Q) policy.",
    "upper/time/<step>": "Seconds of a named step of train-upper (load_snapshots, load_models, build_dataset, "
                         "restore, update, eval, checkpoint, save_writer, report).",
}

JOINT = {
    "joint/round": "Round index of the record.",
    "joint/samples": "Episodes collected in the round.",
    "joint/time/<stage>": "Seconds of the round's stage (collect, upper, lower, eval).",
    "joint/peak_rss_gib/<stage>": "Peak resident memory after the round's stage, GiB.",
    "joint/peak_gpu_gib/<stage>": "Peak GPU memory after the round's stage, GiB (CUDA runs only).",
}

RECORD = {
    "step": "Global step of the record on its run's timeline.",
    "time": "Unix time the record was written.",
    "snapshot_id": "The snapshot a collect or eval record describes.",
}


def _expand() -> dict[str, str]:
    out = dict(RECORD)
    for prefix in ("collect/", "eval/", "lower/", "joint/collect/"):
        out.update({f"{prefix}{k}": v for k, v in SUMMARY.items()})
    for prefix in ("collect/", "eval/"):
        out.update({f"{prefix}{k}": v for k, v in COLLECT.items()})
    # train-joint copies its collect's seconds onto the timeline (pipelines/train_joint.py: _collect)
    out.update({f"joint/collect/{k}": COLLECT[k] for k in ("gen_seconds", "score_seconds", "time/<step>")})
    return {**out, **LOWER, **UPPER, **JOINT}


GLOSSARY: dict[str, str] = dict(sorted(_expand().items()))


def _pattern(key: str) -> re.Pattern:
    parts = re.split(r"<[^>]+>", key)
    return re.compile("^" + ".+".join(re.escape(p) for p in parts) + "$")


_PATTERNS = [_pattern(k) for k in GLOSSARY]


def undocumented(keys) -> list[str]:
    """The keys no glossary entry matches."""
    return sorted(k for k in set(keys) if not any(p.match(k) for p in _PATTERNS))
