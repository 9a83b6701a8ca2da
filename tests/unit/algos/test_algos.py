"""Estimators and losses against hand-computed or independently computed references."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from tosca_mlmt.algos.advantages import (ADVANTAGES, AdvantageInputs, broadcast_turns, gae, grpo, reinforce, rloo,
                                         turn_returns)
from tosca_mlmt.algos.losses import POLICY_LOSSES, explained_variance, kl_estimate, ppo_clip, value_loss


def _gae_reference(r, v, gamma, lam):
    """Textbook GAE on a plain list of action steps (no masking involved)."""
    adv, last = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        nv = v[t + 1] if t + 1 < len(r) else 0.0
        delta = r[t] + gamma * nv - v[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


def test_gae_skips_non_action_tokens_like_a_compacted_sequence():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(3, 12, generator=g)
    values = torch.randn(3, 12, generator=g)
    mask = torch.zeros(3, 12)
    mask[0, 2:5] = 1; mask[0, 8:11] = 1  # two turns with feedback tokens in between  # noqa: E702
    mask[1, 0:12] = 1
    mask[2, 5:6] = 1
    rewards = rewards * mask  # rewards only ever sit on action tokens
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    for b in range(3):
        idx = mask[b].nonzero().squeeze(-1)
        ref = _gae_reference(rewards[b, idx].tolist(), values[b, idx].tolist(), 0.9, 0.8)
        np.testing.assert_allclose(adv[b, idx].numpy(), ref, rtol=1e-5, atol=1e-6)
        assert torch.all(adv[b][mask[b] == 0] == 0)
        np.testing.assert_allclose(ret[b, idx].numpy(), (adv[b, idx] + values[b, idx]).numpy(), rtol=1e-6)


def test_gae_hand_case():
    # two action tokens, reward 1 at the end, gamma = lam = 1: A = R - V
    adv, ret = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 9.0, 0.25]]), torch.tensor([[1.0, 0.0, 1.0]]), 1.0, 1.0)
    assert adv.tolist() == [[0.5, 0.0, 0.75]] and ret.tolist() == [[1.0, 0.0, 1.0]]


def test_turn_returns_and_broadcast():
    rewards = torch.tensor([[0.0, -0.1, 0.0, 0.0, 1.0, 0.5]])
    turn_ids = torch.tensor([[-1, 0, -1, -1, 1, 1]])
    R = turn_returns(rewards, turn_ids, 2)
    assert torch.allclose(R, torch.tensor([[1.4, 1.5]]))
    assert torch.allclose(broadcast_turns(R, turn_ids), torch.tensor([[0.0, 1.4, 0.0, 0.0, 1.5, 1.5]]))


def test_turn_gamma_discounts_only_later_turns():
    rewards = torch.tensor([[0.0, -0.1, 0.0, 0.0, 1.0, 0.5]])
    turn_ids = torch.tensor([[-1, 0, -1, -1, 1, 1]])
    assert torch.allclose(turn_returns(rewards, turn_ids, 2, turn_gamma=0.0), torch.tensor([[-0.1, 1.5]]))
    assert torch.allclose(turn_returns(rewards, turn_ids, 2, turn_gamma=0.5), torch.tensor([[0.65, 1.5]]))
    # three turns rewarded 1, 0, 1: R = [1 + g (0 + g 1), 0 + g 1, 1]
    three = torch.tensor([[1.0, 0.0, 1.0]])
    ids3 = torch.tensor([[0, 1, 2]])
    assert torch.allclose(turn_returns(three, ids3, 3, turn_gamma=0.5), torch.tensor([[1.25, 0.5, 1.0]]))
    assert torch.allclose(turn_returns(three, ids3, 3), torch.tensor([[2.0, 1.0, 1.0]]))


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce"])
def test_turn_gamma_zero_credits_turn_one_as_single_turn_training(name):
    """With turn_gamma = 0 turn 1's advantages are those of the same samples trained without a
    refine (the refine's tokens cut away); with 1 a refine that breaks or fixes an answer moves them."""
    # one group of 4 samples, 2 tokens per turn: r1 = 1, 0, 1, 0 and r_final = 0, 1, 1, 0
    r1, rf = [1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]
    rewards = torch.tensor([[0.0, a, 0.0, b] for a, b in zip(r1, rf)])
    turn_ids = torch.tensor([[0, 0, 1, 1]] * 4)
    groups = torch.zeros(4, dtype=torch.long)
    two = AdvantageInputs(rewards, (turn_ids >= 0).float(), turn_ids, groups, 2)
    cut = turn_ids.masked_fill(turn_ids == 1, -1)
    one = AdvantageInputs(rewards * (cut >= 0), (cut >= 0).float(), cut, groups, 1)
    t1 = turn_ids == 0
    single, _ = ADVANTAGES[name](one, baseline=True)
    own, _ = ADVANTAGES[name](two, turn_gamma=0.0, baseline=True)
    to_go, _ = ADVANTAGES[name](two, turn_gamma=1.0, baseline=True)
    torch.testing.assert_close(own[t1], single[t1], atol=0, rtol=0)
    assert not torch.allclose(to_go[t1], single[t1])
    # the refine's own advantage does not depend on turn_gamma (nothing comes after it)
    torch.testing.assert_close(own[~t1], to_go[~t1], atol=0, rtol=0)


def test_std_normalised_grpo_turns_kl_penalty_noise_into_unit_advantages():
    """Why LowerLearner warns about kl_mode=reward with grpo_norm_std: in a group whose task rewards
    tie, the returns differ only by the per-token KL penalties (~1e-4 here), and dividing by their
    std makes those differences +-1 advantages: the longer answer (more penalised tokens) is pushed
    down as hard as a wrong answer would be. Without the penalty in the rewards, the group gives 0."""
    turn_ids = torch.tensor([[0] * 6] * 4)
    mask = torch.ones(4, 6)
    groups = torch.zeros(4, dtype=torch.long)
    lengths = torch.tensor([2, 3, 5, 6])  # every answer wrong: task reward 0
    penalty = -0.01 * 0.01 * (torch.arange(6)[None, :] < lengths[:, None]).float()  # beta * KL per token
    in_reward, _ = ADVANTAGES["grpo"](AdvantageInputs(penalty, mask, turn_ids, groups, 1))
    a = in_reward[:, 0]
    assert a.abs().min() > 0.5 and torch.equal(a.argsort(), torch.tensor([3, 2, 1, 0]))  # shortest highest
    task_only, _ = ADVANTAGES["grpo"](AdvantageInputs(torch.zeros(4, 6), mask, turn_ids, groups, 1))
    assert task_only.abs().max() == 0


def test_grpo_rloo_reinforce_hand_values():
    R = torch.tensor([[1.0], [0.0], [0.0], [3.0], [5.0]])
    groups = torch.tensor([0, 0, 0, 1, 1])
    valid = torch.ones(5, 1, dtype=torch.bool)
    mean0, std0 = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 3)
    a = grpo(R, groups, valid, norm_std=True, eps=0.0)
    np.testing.assert_allclose(a[:, 0].numpy(), [(1 - mean0) / std0, -mean0 / std0, -mean0 / std0, -1.0, 1.0], rtol=1e-5)
    np.testing.assert_allclose(grpo(R, groups, valid, norm_std=False)[:, 0].numpy(), [2 / 3, -1 / 3, -1 / 3, -1, 1], rtol=1e-6)
    np.testing.assert_allclose(rloo(R, groups, valid)[:, 0].numpy(), [1.0, -0.5, -0.5, -2.0, 2.0], rtol=1e-6)
    np.testing.assert_allclose(reinforce(R, groups, valid)[:, 0].numpy(), R[:, 0].numpy())
    np.testing.assert_allclose(reinforce(R, groups, valid, baseline=True)[:, 0].numpy(), (R[:, 0] - 1.8).numpy(), rtol=1e-6)
    assert set(ADVANTAGES) == {"gae", "grpo", "rloo", "reinforce", "archer"}


def test_all_equal_group_gives_zero_advantage_not_nan():
    R = torch.ones(4, 2)
    a = grpo(R, torch.zeros(4, dtype=torch.long), torch.ones(4, 2, dtype=torch.bool))
    assert torch.all(a == 0)


def test_ppo_clip_golden():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.0]]))
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, 2.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, info = ppo_clip(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # per token: -min(1.5, 1.2) = -1.2 ; -min(-0.5, -0.8) = 0.8 ; -min(2.2, 2.2) = -2.2 ; masked
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.2) / 3, rel=1e-6)
    assert info["clipfrac"] == pytest.approx(2 / 3)
    assert set(POLICY_LOSSES) >= {"ppo_clip", "reinforce"}


def test_ppo_clip_gradient_vanishes_outside_the_trust_region():
    logp = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    loss, _ = ppo_clip(logp, torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2))
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0


def test_value_loss_clipping_and_kl_estimators_and_ev():
    v = torch.tensor([[2.0, 0.0]]); old = torch.tensor([[0.0, 0.0]]); ret = torch.tensor([[1.0, 1.0]])  # noqa: E702
    loss, _ = value_loss(v, old, ret, torch.ones(1, 2), clip=0.5)
    # token 0: max((2-1)^2, (0.5-1)^2) = 1 ; token 1: max(1, 1) = 1 -> 0.5 * mean = 0.5
    assert loss.item() == pytest.approx(0.5)
    lp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-0.5, -1.0])
    assert torch.allclose(kl_estimate(lp, ref, "k1"), torch.tensor([0.5, 0.0]))
    assert torch.allclose(kl_estimate(lp, ref, "k3"), torch.tensor([math.exp(-0.5) - 1 + 0.5, 0.0]))
    # k3 is an unbiased estimate of KL: check against the exact KL of two categoricals
    p = torch.tensor([0.7, 0.2, 0.1]); q = torch.tensor([0.5, 0.3, 0.2])  # noqa: E702
    exact = (p * (p / q).log()).sum()
    est = (p * kl_estimate(p.log(), q.log(), "k3")).sum()
    assert est.item() == pytest.approx(exact.item(), rel=1e-5)
    assert explained_variance(torch.tensor([[2.0, 2.0]]), torch.tensor([[1.0, 3.0]]), torch.ones(1, 2)) == pytest.approx(0.0)
    assert explained_variance(torch.tensor([[1.0, 3.0]]), torch.tensor([[1.0, 3.0]]), torch.ones(1, 2)) == pytest.approx(1.0)


def test_archer_targets_and_advantages_hand_case():
    from tosca_mlmt.algos.advantages import archer as advantages
    from tosca_mlmt.lower.archer import critic_loss, critic_targets

    # two turns; target critic: V-bar(s1) = min(0.5, 0.7) = 0.5; Q-bar(s0,a0) = min(0.2, 0.4) = 0.2
    r = torch.tensor([[0.0, 1.0]])
    valid = torch.ones(1, 2)
    q_bar = torch.tensor([[[0.2, 0.4], [0.9, 0.8]]])
    v_bar = torch.tensor([[[0.3, 0.6], [0.5, 0.7]]])
    y_q, y_v = critic_targets(r, valid, q_bar, v_bar, gamma=0.9)
    assert torch.allclose(y_q, torch.tensor([[0.9 * 0.5, 1.0]]))  # last turn is terminal
    assert torch.allclose(y_v, torch.tensor([[0.2, 0.8]]))
    q = torch.tensor([[[1.0, 0.5], [0.0, 0.2]]])
    v = torch.tensor([[[0.1, 0.3], [0.4, -0.1]]])
    assert torch.allclose(advantages(q, v, valid), torch.tensor([[0.5 - 0.1, 0.0 + 0.1]]))
    # a padded (invalid) second turn: no bootstrap from it, zero advantage there
    y_q, _ = critic_targets(r * torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]]), q_bar, v_bar, 0.9)
    assert torch.allclose(y_q, torch.zeros(1, 2))
    # mean over the two Q heads plus mean over the two V heads, on the one valid turn
    assert critic_loss(q, v, y_q, y_v, torch.tensor([[1.0, 0.0]])).item() == pytest.approx(
        ((1.0 - 0) ** 2 + (0.5 - 0) ** 2) / 2 + ((0.1 - 0.2) ** 2 + (0.3 - 0.2) ** 2) / 2)


def test_refine_groups_compare_a_refine_only_with_the_refines_of_its_own_attempt():
    # two attempts of one problem (rows 0-2: attempt A, rows 3-5: attempt B), three refines each; turn 1
    # is an action of each attempt's first row only (the copies' turn-1 tokens carry turn id -1)
    r1, r2 = [0.0, 0.0, 0.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    turn_ids = torch.tensor([[0, 1], [-1, 1], [-1, 1], [0, 1], [-1, 1], [-1, 1]])
    rewards = torch.zeros(6, 2)
    rewards[:, 0] = torch.tensor(r1) * (turn_ids[:, 0] == 0)
    rewards[:, 1] = torch.tensor(r2)
    x = AdvantageInputs(rewards, (turn_ids >= 0).float(), turn_ids, torch.zeros(6, dtype=torch.long), 2,
                        refine_groups=torch.tensor([0, 0, 0, 1, 1, 1]))
    adv, _ = ADVANTAGES["grpo"](x, norm_std=False, turn_gamma=0.0)
    # turn 1: the two owners only, mean 0.5; the refines: within each attempt (means 1/3 and 2/3)
    np.testing.assert_allclose(adv[:, 0].numpy(), [-0.5, 0, 0, 0.5, 0, 0], atol=1e-6)
    np.testing.assert_allclose(adv[:, 1].numpy(), [2 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -2 / 3], atol=1e-6)
    # by problem (no refine groups) the same refines are compared across attempts: mean 1/2
    by_problem, _ = ADVANTAGES["grpo"](replace(x, refine_groups=None), norm_std=False, turn_gamma=0.0)
    np.testing.assert_allclose(by_problem[:, 1].numpy(), [0.5, -0.5, -0.5, 0.5, 0.5, -0.5], atol=1e-6)
    loo, _ = ADVANTAGES["rloo"](x, turn_gamma=0.0)
    np.testing.assert_allclose(loo[:, 1].numpy(), [1.0, -0.5, -0.5, 0.5, 0.5, -1.0], atol=1e-6)
