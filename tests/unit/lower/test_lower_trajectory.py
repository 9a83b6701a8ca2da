"""Episodes to trainable sequences (lower/trajectory.py): loss masks, cut and truncated turns, SCoRe's
reward shaping. No model."""

from dataclasses import replace

import torch

from factories import cut_first_attempt, make_episodes
from tosca_mlmt.lower.trajectory import (episode_to_trajectory, no_feedback_sequences, shaped_turn_rewards, to_tensors,
                                         without_cut_turns)
from tosca_mlmt.records import FeedbackSpan


def test_loss_mask_covers_exactly_the_solver_generated_tokens():
    ep = make_episodes(1)[0]
    # make the refine prompt extend the solve turn token-exactly, with feedback ids at a known span
    solve, fb, ref = ep.turns
    ctx = solve.prompt_ids + solve.response_ids
    ref.prompt_ids = ctx + [4, 4] + fb.response_ids[:-1] + [5, 5]
    ref.feedback_span = FeedbackSpan(len(ctx) + 2, len(ctx) + 2 + len(fb.response_ids) - 1)
    traj = episode_to_trajectory(ep)
    tt = to_tensors([traj], pad_id=0)
    seq = tt.input_ids[0].tolist()
    on = [i for i, m in enumerate(tt.mask[0].tolist()) if m > 0]
    want = list(range(len(solve.prompt_ids), len(ctx))) + list(range(len(ref.prompt_ids), len(ref.prompt_ids) + 2))
    assert on == want
    assert [seq[i] for i in on] == solve.response_ids + ref.response_ids
    a, b = ref.feedback_span.start, ref.feedback_span.end
    assert tt.mask[0, a:b].sum() == 0 and tt.mask[0, : len(solve.prompt_ids)].sum() == 0
    assert tt.turn_ids[0, on].tolist() == [0] * len(solve.response_ids) + [1, 1]
    # the bonus context is the same sequence with only g cut out
    prompts, responses, where = no_feedback_sequences([traj])
    assert where == [(0, 1)] and responses == [ref.response_ids]
    assert prompts[0] == ref.prompt_ids[:a] + ref.prompt_ids[b:]


def test_truncated_prompt_is_not_trained_on():
    ep = make_episodes(1)[0]
    ep.turns[2].prompt_ids = [9] + ep.turns[2].prompt_ids[1:]  # prefix property broken
    assert episode_to_trajectory(ep) is None
    ep = make_episodes(1)[0]
    assert episode_to_trajectory(ep) is not None
    ep.turns[2].truncated = True  # cut by the runner: the engine's log-probs are of another context
    assert episode_to_trajectory(ep) is None


def test_a_turn_cut_at_max_new_tokens_leaves_the_loss_mask_and_nothing_else():
    trajs = cut_first_attempt()
    assert trajs[0].cut == [True, False] and trajs[1].cut == [False, False]
    tt = to_tensors(trajs, pad_id=0)
    kept, n = without_cut_turns(trajs, tt)
    s, e = trajs[0].turn_spans[0]
    want = tt.mask.clone()
    want[0, s:e] = 0.0
    assert n == 1 and e > s and torch.equal(kept.mask, want)
    assert tt.mask[0, s:e].sum() == e - s  # the estimator's mask is not touched
    for f in ("input_ids", "attention_mask", "turn_ids", "behaviour_logprobs", "groups"):
        assert torch.equal(getattr(kept, f), getattr(tt, f)), f


def test_score_shaping_stages():
    from tosca_mlmt.config import load_config

    trajs = [episode_to_trajectory(e) for e in make_episodes(2)]  # r1 = 0, r_final = 1
    lo = load_config(overrides={"lower.score.enabled": True, "lower.score.stage1_steps": 3,
                                "lower.score.alpha": 10, "lower.kl_coef": 0.01}).lower
    r, w, stage = shaped_turn_rewards(trajs, lo, step=0)
    assert stage == 1 and r[0] == [0.0, 1.0] and w[0] == [lo.score.beta2, 0.01]
    r, w, stage = shaped_turn_rewards(trajs, lo, step=3)
    assert stage == 2 and r[0] == [0.0, 1.0 + 10 * (1.0 - 0.0)] and w[0] == [lo.score.beta1] * 2
    r, _, stage = shaped_turn_rewards(trajs, replace(lo, score=replace(lo.score, enabled=False)), step=0)
    assert stage == 0 and r[0] == [0.0, 1.0]


def _branched(eps, k):
    """Each episode's k refines, as the runner's refine groups record them (rollout/runner.branch_episodes)."""
    from tosca_mlmt.rollout.runner import branch_episodes

    out = branch_episodes(eps, k)
    for i, ep in enumerate(out):
        ep.turns[-1].response_ids = [5, 2 + i]
        ep.turns[-1].info["branch"] = i % k
    return out


def test_refine_groups_train_turn_1_once_per_attempt_and_group_refines_by_attempt():
    eps = _branched(make_episodes(2), 3)
    trajs = [episode_to_trajectory(e) for e in eps]
    assert [t.branch for t in trajs] == [0, 1, 2, 0, 1, 2]
    tt = to_tensors(trajs, pad_id=0)
    (s1, e1), (s2, e2) = trajs[0].turn_spans
    # turn 1 is an action of each attempt's first trajectory only; every refine is one
    assert tt.mask[:, s1:e1].sum(1).tolist() == [e1 - s1, 0, 0, e1 - s1, 0, 0]
    assert (tt.turn_ids[[1, 2, 4, 5], s1:e1] == -1).all() and (tt.turn_ids[:, s2:e2] == 1).all()
    assert tt.mask[:, s2:e2].sum().item() == 6 * (e2 - s2)
    assert tt.groups.tolist() == [0, 0, 0, 1, 1, 1] and tt.refine_groups.tolist() == [0, 0, 0, 1, 1, 1]
    # a minibatch keeps each row's refine group
    assert tt.select(torch.tensor([4, 0])).refine_groups.tolist() == [1, 0]
    # without branches nothing changes: no refine groups, turn 1 trained in every trajectory
    plain = to_tensors([episode_to_trajectory(e) for e in make_episodes(2)], pad_id=0)
    assert plain.refine_groups is None and plain.mask[:, s1:e1].sum().item() == 2 * (e1 - s1)


def test_a_cut_turn_1_shared_by_branches_is_counted_once():
    eps = make_episodes(1)
    eps[0].turns[0].finish_reason = "length"
    trajs = [episode_to_trajectory(e) for e in _branched(eps, 2)]
    kept, n = without_cut_turns(trajs, to_tensors(trajs, pad_id=0))
    s, e = trajs[0].turn_spans[0]
    assert n == 1 and kept.mask[:, s:e].sum() == 0
