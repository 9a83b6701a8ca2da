"""From logged episodes to the solver's training sequences and per-token rewards.

All of an episode's solver turns live in one token sequence: the last refine's prompt
plus its response. Because every prompt was built by appending ids (see prompts.py),
each earlier turn's response sits verbatim at a known span of that sequence, so one
forward pass scores every solver turn, and the loss mask is exactly those spans.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tosca_mlmt.config import LowerConfig
from tosca_mlmt.records import Episode
from tosca_mlmt.tensors import pad_batch


@dataclass
class SolverTrajectory:
    episode_id: str
    problem_id: str
    ids: list[int]  # the whole context after the last solver turn
    turn_spans: list[tuple[int, int]]  # [start, end) of each solver response in ids
    turn_rewards: list[float]  # verifier reward of each solver turn
    behaviour_logprobs: list[list[float]]  # the engine's sampling logprobs per turn
    feedback_spans: list[tuple[int, int] | None]  # g_k inside ids, for refine turns (None for turn 1)
    cut: list[bool] = field(default_factory=list)  # turn k ran into max_new_tokens (finish_reason "length")
    # lower.refine_samples > 1: the attempt's key (problem, turn-1 sample) and which of its sampled refines
    # this is; None: the one refine of its attempt
    branch: int | None = None
    sample: int = 0

    @property
    def attempt(self) -> tuple[str, int]:
        return self.problem_id, self.sample

    @property
    def r1(self) -> float:
        return self.turn_rewards[0]

    @property
    def r_final(self) -> float:
        return self.turn_rewards[-1]


def episode_to_trajectory(ep: Episode) -> SolverTrajectory | None:
    """None when a prompt was truncated or does not extend the earlier turns (the prefix property
    no longer holds, and the engine's log-probs were taken in another context than this sequence)."""
    turns = ep.solver_turns
    if any(t.truncated for t in turns):
        return None
    last = turns[-1]
    ids = list(last.prompt_ids) + list(last.response_ids)
    spans, fbs = [], []
    for t in turns:
        start = len(t.prompt_ids)
        if ids[:start] != list(t.prompt_ids) or ids[start:start + len(t.response_ids)] != list(t.response_ids):
            return None
        spans.append((start, start + len(t.response_ids)))
        fb = t.feedback_span
        fbs.append(None if fb is None else (fb.start, fb.end))
    return SolverTrajectory(ep.episode_id, ep.problem.id, ids, spans, [float(t.reward) for t in turns],
                            [list(t.logprobs) for t in turns], fbs, [t.finish_reason == "length" for t in turns],
                            branch=last.info.get("branch"), sample=ep.sample)


@dataclass
class TrajectoryTensors:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] 1.0 on solver-generated tokens only
    turn_ids: torch.Tensor  # [B, T] index of the solver turn a token belongs to, -1 elsewhere
    behaviour_logprobs: torch.Tensor  # [B, T] engine logprobs on action tokens, 0 elsewhere
    groups: torch.Tensor  # [B] problem index, for group-relative estimators
    n_turns: int
    refine_groups: torch.Tensor | None = None  # [B] the group of the refines: attempt index under refine groups

    def turn_valid(self) -> torch.Tensor:
        """[B, K] bool: trajectory b has a turn k (trajectories may have fewer turns than K)."""
        return torch.stack([(self.turn_ids == k).any(1) for k in range(self.n_turns)], 1)

    def select(self, rows: torch.Tensor, width: int | None = None) -> "TrajectoryTensors":
        """The rows, and with ``width`` only their first ``width`` positions."""
        cols = slice(None, width)
        return TrajectoryTensors(self.input_ids[rows, cols], self.attention_mask[rows, cols], self.mask[rows, cols],
                                 self.turn_ids[rows, cols], self.behaviour_logprobs[rows, cols], self.groups[rows],
                                 self.n_turns, None if self.refine_groups is None else self.refine_groups[rows])


def to_tensors(trajs: list[SolverTrajectory], pad_id: int) -> TrajectoryTensors:
    """Under refine groups (trajectories with a ``branch``) the k trajectories of one attempt share its
    turn 1, which is an action of the first of them only (mask and turn id), so turn 1 is trained,
    and compared within its problem, once per attempt; their refines form the attempt's group."""
    ids, attn = pad_batch([t.ids for t in trajs], pad_id)
    n_turns = max(len(t.turn_spans) for t in trajs)
    B, width = ids.shape
    mask = torch.zeros(B, width)
    turn_ids = torch.full((B, width), -1, dtype=torch.long)
    blp = torch.zeros(B, width)
    group_of = {pid: i for i, pid in enumerate(dict.fromkeys(t.problem_id for t in trajs))}
    attempt_of = {a: i for i, a in enumerate(dict.fromkeys(t.attempt for t in trajs))}
    owners = {a: b for b, a in reversed(list(enumerate(t.attempt for t in trajs)))}  # an attempt's first row
    branched = any(t.branch is not None for t in trajs)
    for b, t in enumerate(trajs):
        for k, (s, e) in enumerate(t.turn_spans):
            if branched and k == 0 and owners[t.attempt] != b:
                continue
            mask[b, s:e] = 1.0
            turn_ids[b, s:e] = k
            blp[b, s:e] = torch.tensor(t.behaviour_logprobs[k][: e - s])
    groups = torch.tensor([group_of[t.problem_id] for t in trajs])
    refine_groups = torch.tensor([attempt_of[t.attempt] for t in trajs]) if branched else None
    return TrajectoryTensors(ids, attn, mask, turn_ids, blp, groups, n_turns, refine_groups)


def without_cut_turns(trajs: list[SolverTrajectory], tt: TrajectoryTensors) -> tuple[TrajectoryTensors, int]:
    """``tt`` with the mask [B, T] off on every turn that ran into max_new_tokens (lower.mask_truncated),
    and how many turns that took. Only the loss reads this mask: the advantages were estimated on the
    whole one, and the ids, turn ids and log-probs are untouched."""
    mask, cut = tt.mask.clone(), 0
    for b, t in enumerate(trajs):
        for (s, e), c in zip(t.turn_spans, t.cut):
            if c and mask[b, s:e].any():  # a branch's shared turn 1 is not its action (to_tensors)
                mask[b, s:e] = 0.0
                cut += 1
    return replace(tt, mask=mask), cut


def first_turn_only(tt: TrajectoryTensors) -> TrajectoryTensors:
    """``tt`` with the mask [B, T] off on every refine (lower.train_refine=false): only the loss reads
    it, so the refines' rewards still shape the advantages while their tokens take no gradient."""
    return replace(tt, mask=tt.mask * (tt.turn_ids <= 0))


def shaped_turn_rewards(trajs: list[SolverTrajectory], cfg: LowerConfig, step: int) -> tuple[list[list[float]], list[list[float]], int]:
    """Per-turn task rewards and per-turn KL weights under the configured shaping.

    Returns (rewards[b][k], kl_weights[b][k], stage). SCoRe stage I rewards only the final
    turn and pins turn 1 with beta2; stage II rewards turn 1 with r1 and the final turn
    with r_final + alpha * (r_final - r1), with beta1 on every turn.
    """
    sc = cfg.score
    stage = (1 if step < sc.stage1_steps else 2) if sc.enabled else 0
    rewards, klw = [], []
    for t in trajs:
        K = len(t.turn_rewards)
        if stage == 1:
            r = [0.0] * (K - 1) + [t.r_final]
            w = [sc.beta2] + [cfg.kl_coef] * (K - 1)
        elif stage == 2:
            r = [t.r1] + [0.0] * (K - 2) + [t.r_final + sc.alpha * (t.r_final - t.r1)] if K > 1 else [t.r1]
            w = [sc.beta1] * K
        else:
            r = list(t.turn_rewards) if cfg.turn_rewards == "each" else [0.0] * (K - 1) + [t.r_final]
            w = [cfg.kl_coef] * K
        rewards.append(r)
        klw.append(w)
    return rewards, klw, stage


def no_feedback_sequences(trajs: list[SolverTrajectory]) -> tuple[list[list[int]], list[list[int]], list[tuple[int, int]]]:
    """For every refine turn: (context with g_k removed, the refine's tokens, (row, turn)).

    The context is the exact sequence up to that refine with only the feedback ids cut
    out, so the two log-probs of the bonus differ in nothing but g."""
    prompts, responses, where = [], [], []
    for b, t in enumerate(trajs):
        for k, ((s, e), fb) in enumerate(zip(t.turn_spans, t.feedback_spans)):
            if fb is None:
                continue
            prompts.append(t.ids[: fb[0]] + t.ids[fb[1]: s])
            responses.append(t.ids[s:e])
            where.append((b, k))
    return prompts, responses, where
