"""Strategy-level transitions from logged episodes.

One transition per writer turn (feedback round k = 1..K of an episode):

* state s_k   = the writer's prompt up to ``state_len``: problem, attempts, earlier feedback;
* action a_k  = the logged strategy index, with mu(a_k | s_k) and mu(. | s_k) from collection;
* reward r_k  = ``final``: r_final at the last round, 0 before it; ``improvement``:
  r(attempt k) - r(attempt k-1), which sums to r_final - r1 over the rounds; or
  ``counterfactual``: r(attempt k) - r(attempt k written without g_k); ``gold_prob``:
  p_gold(attempt k) - p_gold(attempt k-1), the solver's probability of the gold answer at each
  attempt's answer slot (rollout/gold.py), which moves where 0/1 outcomes do not; minus
  ``break_penalty`` when round k turns a correct attempt wrong, and minus
  ``episode.leak_penalty`` when g_k gives the gold answer away (tosca_mlmt/leak.py);
* next state  = the writer state of round k + 1 (an index into the same list), terminal
  after the last round; G_k = r_k + gamma * G_{k+1} is the logged return-to-go.

The writer's full prompt (state + strategy instruction + generation prompt) and its
feedback tokens are kept for the text loss (which skips fixed feedback: nothing was written). No model is involved here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tosca_mlmt.records import Episode
from tosca_mlmt.errors import SnapshotError
from tosca_mlmt.leak import episode_leaks
from tosca_mlmt.seeds import torch_stream


@dataclass
class Transition:
    snapshot_id: str
    episode_id: str
    round: int  # 1-based feedback round
    task_type: str  # e.g. "arith/L2": the report groups by it
    prompt_ids: list[int]  # the writer prompt as the engine got it; prompt_ids[:state_len] is the state s
    state_len: int
    response_ids: list[int]  # the logged feedback tokens (the only tokens the text loss sees)
    action: int
    behaviour_prob: float
    behaviour_probs: list[float]
    reward: float
    done: bool
    next_index: int  # index of the next round's transition, -1 when done
    ret: float  # discounted return-to-go G_k
    episode_return: float  # G of the episode's first decision (for off-policy evaluation)
    signal: int = 0  # o(s): what episode.writer_sees told the writer about the last attempt (0 = nothing)
    written: bool = True  # False: the feedback was a fixed sentence (finish_reason "fixed"), no text to clone

    @property
    def state_ids(self) -> list[int]:
        return self.prompt_ids[: self.state_len]


def task_type(ep: Episode) -> str:
    """Group key for the preference report: task name plus a difficulty tag when the problem has one."""
    meta = ep.problem.meta or {}
    for key in ("level", "difficulty", "type", "subject"):
        if key in meta:
            v = meta[key]
            return f"{ep.problem.task}/L{v}" if key == "level" and isinstance(v, int) else f"{ep.problem.task}/{v}"
    return ep.problem.task


def round_rewards(solver_rewards: list[float], solver_correct: list[bool], mode: str,
                  break_penalty: float, counterfactual: list[float | None] | None = None,
                  leaked: list[bool | None] | None = None, leak_penalty: float = 0.0,
                  gold_probs: list[float | None] | None = None) -> list[float]:
    """Per-round rewards r_1..r_K from the K + 1 solver attempts' rewards (pure).

    ``counterfactual[k - 1]`` is the reward of the refine the same solver wrote at round k with
    the feedback cut out of its context (mode ``counterfactual``): r_k = r(y_k) - r(y_k without g_k),
    the part of the outcome the feedback itself caused. ``leaked[k - 1]`` is True when g_k gave
    the gold answer away: that decision's reward loses ``leak_penalty``, whatever the outcome,
    because a refine that copied the answer says nothing about the strategy (None = not measured).
    ``gold_probs[k]`` is attempt k's p_gold (mode ``gold_prob``), one per solver attempt."""
    K = len(solver_rewards) - 1
    out = []
    for k in range(1, K + 1):
        if mode == "final":
            r = solver_rewards[-1] if k == K else 0.0
        elif mode == "improvement":
            r = solver_rewards[k] - solver_rewards[k - 1]
        elif mode == "counterfactual":
            if counterfactual is None or counterfactual[k - 1] is None:
                raise ValueError("upper.reward=counterfactual needs refines scored without their feedback: "
                                 "collect with episode.counterfactual=true")
            r = solver_rewards[k] - counterfactual[k - 1]
        elif mode == "gold_prob":
            if gold_probs is None or gold_probs[k] is None or gold_probs[k - 1] is None:
                raise ValueError("upper.reward=gold_prob needs every attempt's gold-answer probability: "
                                 "collect with episode.gold_prob=true")
            r = gold_probs[k] - gold_probs[k - 1]
        else:
            raise ValueError(f"unknown reward mode {mode!r}")
        if solver_correct[k - 1] and not solver_correct[k]:
            r -= break_penalty
        if leaked is not None and leaked[k - 1]:
            r -= leak_penalty
        out.append(float(r))
    return out


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """G_k = r_k + gamma * G_{k+1}, G_{K+1} = 0 (pure)."""
    out, g = [0.0] * len(rewards), 0.0
    for k in reversed(range(len(rewards))):
        g = rewards[k] + gamma * g
        out[k] = g
    return out


def episode_transitions(ep: Episode, snapshot_id: str, reward_mode: str, break_penalty: float,
                        gamma: float, offset: int, leak_penalty: float = 0.0) -> list[Transition]:
    """Transitions of one episode; ``offset`` is the index its first transition will get."""
    writer = [t for t in ep.turns if t.role == "writer" and t.kind == "feedback"]
    solver = ep.solver_turns
    if not writer:
        return []
    if len(solver) != len(writer) + 1:
        raise SnapshotError(f"{snapshot_id}: episode {ep.episode_id} has {len(writer)} feedback turns but "
                            f"{len(solver)} solver turns (expected one more)")
    for t in writer:
        if t.strategy is None or t.state_len is None or t.behaviour_probs is None:
            raise SnapshotError(f"{snapshot_id}: episode {ep.episode_id} round {t.round} lacks the logged strategy "
                                "decision (strategy, state_len, behaviour_probs); re-collect with this version")
    cf = [t.info.get("counterfactual_reward") for t in solver[1:]]
    leaked = episode_leaks(ep) if leak_penalty else None  # measured from the texts: old snapshots work too
    try:
        rewards = round_rewards([float(s.reward or 0.0) for s in solver], [bool(s.correct) for s in solver],
                                reward_mode, break_penalty, cf, leaked, leak_penalty,
                                [s.info.get("gold_prob") for s in solver])
    except ValueError as e:
        raise SnapshotError(f"{snapshot_id}: episode {ep.episode_id}: {e}") from None
    returns = discounted_returns(rewards, gamma)
    K = len(writer)
    out = []
    for k, t in enumerate(writer):
        out.append(Transition(
            snapshot_id=snapshot_id, episode_id=ep.episode_id, round=k + 1, task_type=task_type(ep),
            prompt_ids=list(t.prompt_ids), state_len=int(t.state_len), response_ids=list(t.response_ids),
            action=int(t.strategy), behaviour_prob=float(t.behaviour_prob),
            behaviour_probs=[float(p) for p in t.behaviour_probs], reward=rewards[k], done=k == K - 1,
            next_index=offset + k + 1 if k < K - 1 else -1, ret=returns[k], episode_return=returns[0],
            signal=int((t.info or {}).get("writer_signal", 0)), written=t.finish_reason != "fixed"))
    return out


def build_transitions(sources: list[tuple[str, list[Episode]]], reward_mode: str = "final",
                      break_penalty: float = 0.0, gamma: float = 1.0, leak_penalty: float = 0.0) -> list[Transition]:
    """All transitions of several snapshots, ``sources`` = [(snapshot id, episodes)], in order."""
    out: list[Transition] = []
    for sid, episodes in sources:
        for ep in episodes:
            out += episode_transitions(ep, sid, reward_mode, break_penalty, gamma, offset=len(out),
                                       leak_penalty=leak_penalty)
    return out


def check_strategies(manifests: list[dict]) -> list[dict]:
    """The snapshots must share one strategy list (same names, same order): action a means the
    same strategy everywhere. Returns it."""
    first = manifests[0].get("strategies")
    if not first:
        raise SnapshotError(f"snapshot {manifests[0].get('id')} records no strategy list")
    names = [s["name"] for s in first]
    for m in manifests[1:]:
        other = [s["name"] for s in (m.get("strategies") or [])]
        if other != names:
            raise SnapshotError(f"snapshots {manifests[0].get('id')} and {m.get('id')} use different strategy sets "
                                f"({names} vs {other}); train on snapshots collected with one strategy set")
    return [dict(s) for s in first]


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Transition indices of optimiser step ``step`` (1-based): consecutive slices of a stream
    of seeded permutations, one per pass over the data. A pure function of (seed, step), so a
    resumed run draws exactly the batches the uninterrupted run would have drawn."""
    out = []
    for p in range((step - 1) * batch_size, step * batch_size):
        epoch, pos = divmod(p, n)
        out.append(_permutation(n, seed, epoch)[pos])
    return out


@functools.lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    return tuple(torch.randperm(n, generator=torch_stream(seed, "decisions", epoch)).tolist())


def eval_sample(transitions: list[Transition], at_least: int, seed: int) -> list[int]:
    """Indices (ascending) of the decisions of a seeded random set of whole episodes holding at
    least ``at_least`` decisions; every index when ``at_least`` is 0 or covers them all. Whole
    episodes, so an off-policy estimate over the sample still sees each episode's every round."""
    if at_least <= 0 or at_least >= len(transitions):
        return list(range(len(transitions)))
    episodes: dict[tuple[str, str], list[int]] = {}
    for i, t in enumerate(transitions):
        episodes.setdefault((t.snapshot_id, t.episode_id), []).append(i)
    keys = list(episodes)
    order = torch.randperm(len(keys), generator=torch_stream(seed, "upper_eval")).tolist()
    chosen: list[int] = []
    for k in order:
        if len(chosen) >= at_least:
            break
        chosen += episodes[keys[k]]
    return sorted(chosen)
