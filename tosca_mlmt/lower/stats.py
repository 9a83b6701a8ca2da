"""What one lower-level update reports (train-lower logs it under ``lower/``), the
per-refine bonus it hands back for the batch snapshot, and the typed records train-lower's
metrics row is built from (``iteration_metrics``: records in, the row out, nothing read from
a stage or learner object)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tosca_mlmt import parallel as dist
from tosca_mlmt.algos.bonus import TRANSITIONS, transition_names
from tosca_mlmt.algos.losses import explained_variance
from tosca_mlmt.lower.objective import BonusTerms, TokenRewards
from tosca_mlmt.lower.scoring import Scores
from tosca_mlmt.lower.trajectory import TrajectoryTensors
from tosca_mlmt.tensors import masked_mean


@dataclass(frozen=True)
class UpdateStats:
    """What one ``LowerLearner.update`` reports. ``metrics``: the numbers train-lower logs under
    ``lower/`` (iteration_stats, bonus_stats, the losses' means, the cut-turn counts), kept as a
    mapping because their names follow the batch (``kl/turn<k>``) and the objective's loss terms."""

    metrics: dict
    skipped_old: bool  # the update ran without a pi_old pass (lower.old_logprobs=auto, every row)
    # (row, solver turn, raw term, value used) per refine (refine_bonus_rows): what train-lower
    # stores with each batch snapshot's refine turns (with_refine_bonus)
    refine_bonus: tuple[tuple[int, int, float, float], ...] = ()

    @property
    def stage(self) -> int:
        return self.metrics.get("stage", 0)

    @property
    def train_tokens(self) -> int:
        return self.metrics["train_tokens"]


@dataclass(frozen=True)
class LowerIteration:
    """One train-lower iteration, as its metrics row and checkpoint read it."""

    step: int  # 1-based: the iteration's number in the logs
    summary: dict  # metrics.summarize of the batch's episodes
    update: UpdateStats
    turn_rewards: tuple[tuple[float, ...], ...]  # per trained trajectory, its turns' verifier rewards
    problem_ids: tuple[str, ...]  # per trained trajectory, the problem it answered
    seconds: dict[str, float]  # per timed step of the iteration
    wall_seconds: float
    gen_tokens: int  # sampled over all ranks (0 from snapshots)
    snapshot: str | None = None  # the batch snapshot's id, when one was written
    batch: tuple = ()  # the snapshot's episodes, each refine with the bonus it was trained with
    prefix_hit_rate: float | None = None  # vLLM: prompt tokens of the rollout its prefix cache served
    sync_route: str | None = None  # vLLM: how the post-update weight sync travelled
    reward_errors: int | None = None  # task.reward: failed calls, scored 0
    peak_rss_gib: float = 0.0  # the process's peak so far: where it rises, this iteration set it
    peak_gpu_gib: dict = field(default_factory=dict)
    attempts: tuple = ()  # refine groups (lower.refine_samples > 1): per trained trajectory, its attempt's key


def iteration_metrics(rec: LowerIteration) -> dict:
    """The ``lower/`` metrics row of one iteration (docs/reference/metrics.md names them)."""
    row = {**rec.summary, **rec.update.metrics}
    row.update(group_reward_stats([sum(r) for r in rec.turn_rewards], rec.problem_ids))
    if rec.attempts:  # the refines' own groups: an attempt whose k refines all tie teaches the refine nothing
        refines = group_reward_stats([r[-1] for r in rec.turn_rewards], rec.attempts)
        row.update({f"refine_group_{k}": v for k, v in refines.items() if k != "reward_mean"})
    for k in range(max(map(len, rec.turn_rewards))):
        row[f"reward_turn{k}"] = float(np.mean([r[k] for r in rec.turn_rewards if k < len(r)]))
    optional = {"prefix_hit_rate": rec.prefix_hit_rate, "sync_route": rec.sync_route or None,
                "reward_errors": rec.reward_errors}
    row.update({k: v for k, v in optional.items() if v is not None})
    row.update({f"time/{k}": round(v, 4) for k, v in rec.seconds.items()})
    row.update({"iteration": rec.step,
                "gen_tokens_per_s": rec.gen_tokens / max(rec.seconds.get("generate", 0), 1e-9),
                "train_tokens_per_s": rec.update.train_tokens / max(rec.seconds.get("update", 0), 1e-9),
                "iteration_seconds": rec.wall_seconds, "snapshot": rec.snapshot,
                "peak_rss_gib": rec.peak_rss_gib, **rec.peak_gpu_gib})
    return {f"lower/{k}": v for k, v in row.items()}


def iteration_stats(tt: TrajectoryTensors, rewards: TokenRewards, scores: Scores, adv: torch.Tensor,
                    returns: torch.Tensor, raw_logprobs: bool) -> dict:
    """``raw_logprobs``: the trainer scored raw log pi, as the engines log it (lower.logprob_temperature
    raw), so the two can be compared (engine_mismatch)."""
    # pi_old's diagnostics (kl, entropy) are over the rows its pass scored: the first minibatch's
    # rows may have skipped it (Scores.old_current), and they are a random share of the batch
    m, ms = tt.mask, scores.scored_mask(tt.mask)
    out = {
        "stage": rewards.stage, "kl": float(masked_mean(rewards.kl, ms)),
        "adv_mean": float(masked_mean(adv, m)), "adv_std": float(adv[m > 0].std()) if m.sum() > 1 else 0.0,
        "token_reward_sum": float(rewards.rewards.sum() / len(m)), "train_tokens": int(m.sum()),
    }
    if scores.entropy is not None:  # else the update's forward logs it
        out["entropy"] = float(masked_mean(scores.entropy, ms))
    for k in range(tt.n_turns):
        out[f"kl/turn{k}"] = float(masked_mean(rewards.kl, ms * (tt.turn_ids == k)))
    if scores.old_values is not None:
        out["explained_variance"] = explained_variance(scores.old_values, returns, m)
    if scores.trainer_logprobs is not None and raw_logprobs:
        out.update(engine_mismatch(tt.behaviour_logprobs, scores.trainer_logprobs, ms))
    return out


def engine_mismatch(behaviour: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> dict:
    """How far the rollout engine's sampling log-probs are from the trainer's forward with the weights
    that sampled (verl's rollout_probs_diff): ~1e-5 in fp32, more in bf16; a jump says the engine
    served other weights than the trainer holds (a weight sync gone wrong) or scored other tokens.
    ``behaviour``, ``trainer``, ``mask``: [B, T] (raw log pi of each action token; the rows pi_old
    scored). ``engine_kl`` is KL(engine || trainer) by Schulman's k3 estimator on the engine's own
    samples: mean of (r - 1) - log r, r = pi_trainer / pi_engine, never negative."""
    if mask.sum() == 0:
        return {}
    d = (trainer - behaviour)[mask > 0].double()  # log r per action token
    return {"engine_logprob_gap_mean": float(d.abs().mean()), "engine_logprob_gap_max": float(d.abs().max()),
            "engine_kl": float((torch.expm1(d) - d).mean())}


def group_reward_stats(rewards, groups) -> dict:
    """TRL/verl-style group statistics of one batch: ``rewards`` [N] (an episode's return, the
    sum of its turns' verifier rewards), ``groups`` [N] (the problem each episode answered).

    ``reward_mean`` is over all episodes; ``reward_std`` is the mean within-group spread (TRL's
    ``reward_std``; population std, so a group of one has 0); ``frac_reward_zero_std`` is the share
    of groups whose rewards are all equal: GRPO's advantages are 0 there, so such a group carries
    no gradient, and a value near 1 says the batch teaches (almost) nothing."""
    r = np.asarray(rewards, dtype=float)
    if r.size == 0:
        return {}
    by: dict = {}
    for g, x in zip(groups, r):
        by.setdefault(g, []).append(x)
    stds = np.array([np.std(v) for v in by.values()])
    return {"reward_mean": float(r.mean()), "reward_std": float(stds.mean()),
            "frac_reward_zero_std": float(np.mean(stds <= 1e-12))}


def bonus_stats(terms: BonusTerms | None) -> dict:
    """Bonus size, clipping, and how it splits over the four kinds of correction a refine made;
    ``terms`` is None when no bonus was computed (coefficient 0 or no refines)."""
    stats = {"bonus/mean": 0.0, "bonus/clip_rate": 0.0, "bonus/corr_correct": float("nan")}
    if terms is None:
        return stats
    total = terms.total.numpy()
    stats["bonus/mean"] = float(total.mean())
    stats["bonus/raw_logratio_mean"] = float(terms.raw.mean())
    stats["bonus/clip_rate"] = float(terms.clipped.mean())
    stats["bonus/gate_mean"] = float(terms.gate.mean())
    names = transition_names(terms.r_prev, terms.r_this)
    for name in TRANSITIONS.values():
        sel = [i for i, n in enumerate(names) if n == name]
        stats[f"bonus/{name}/count"] = float(len(sel))
        stats[f"bonus/{name}/mean"] = float(total[sel].mean()) if sel else float("nan")
        stats[f"bonus/{name}/raw_mean"] = float(terms.raw[sel].mean()) if sel else float("nan")
    if total.std() > 0 and terms.r_this.std() > 0:
        stats["bonus/corr_correct"] = float(np.corrcoef(total, terms.r_this.numpy())[0, 1])
    return stats


def refine_bonus_rows(terms: BonusTerms | None) -> list[tuple[int, int, float, float]]:
    """(row, solver turn, raw term, value used) per refine: the raw term is the unclipped
    log-ratio (``bonus/raw_logratio_mean`` averages it), the value is the bonus added to the
    refine's advantages summed over its tokens (``bonus/mean`` averages it)."""
    if terms is None:
        return []
    return [(b, k, float(r), float(v)) for (b, k), r, v in zip(terms.where, terms.raw.tolist(), terms.total.tolist())]


def with_refine_bonus(episodes: list, rows: list[int], refine: list[tuple[int, int, float, float]]) -> list:
    """``episodes`` with each refine turn's bonus in its ``info`` (``bonus``: the value used,
    ``bonus_raw``: the raw term; see refine_bonus_rows). ``rows[b]`` is the index in
    ``episodes`` of trajectory row b, whose solver turn k is the episode's k-th solver turn.
    Turns without a bonus (no PPO update saw them) are left as they are; nothing is mutated."""
    by: dict[int, dict[int, dict]] = {}
    for b, k, raw, value in refine:
        by.setdefault(rows[b], {})[k] = {"bonus": value, "bonus_raw": raw}
    out = []
    for i, ep in enumerate(episodes):
        add = by.get(i)
        if not add:
            out.append(ep)
            continue
        turns, k = [], -1
        for t in ep.turns:
            k += t.role == "solver"
            turns.append(replace(t, info={**t.info, **add[k]}) if t.role == "solver" and k in add else t)
        out.append(replace(ep, turns=turns))
    return out


class LossMeans:
    """Loss diagnostics averaged over every rank's real micro-batches. A zero-weight padding
    slot adds its keys with 0, so all ranks reduce the same keys in the same order."""

    def __init__(self):
        self.sums: dict[str, float] = {"n": 0.0}

    def add(self, info: dict, real: bool) -> None:
        w = float(real)
        self.sums["n"] += w
        for k, v in info.items():
            self.sums[k] = self.sums.get(k, 0.0) + w * v

    def means(self) -> dict:
        """Collective: every rank calls it."""
        sums = dist.all_sum(self.sums)
        n = sums.pop("n")
        return {k: v / n for k, v in sums.items()}
