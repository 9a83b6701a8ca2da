"""Offline Q-learning math (tosca_mlmt.algos.qlearning) against hand-computed values."""

import math

import pytest
import torch

from tosca_mlmt.algos.qlearning import (BOOTSTRAPS, awr_weights, cql_penalty, effective_sample_size, expectile_loss,
                                        hard_update, importance_weighted_value, polyak_update, target_due, td_target)


def test_td_target_dqn_and_iql_bootstraps():
    q_next = torch.tensor([[0.1, 0.7, 0.3], [5.0, 1.0, 2.0]])
    boot = BOOTSTRAPS["max"](q_next_target=q_next)
    assert boot.tolist() == pytest.approx([0.7, 5.0])
    y = td_target(torch.tensor([1.0, 0.5]), torch.tensor([0.0, 1.0]), boot, gamma=0.9)
    assert y.tolist() == pytest.approx([1.0 + 0.9 * 0.7, 0.5])  # the terminal row ignores s'
    v = BOOTSTRAPS["value"](v_next=torch.tensor([0.25, 9.0]))
    assert td_target(torch.tensor([0.0, 0.0]), torch.tensor([0, 1]), v, 0.5).tolist() == [0.125, 0.0]
    assert not td_target(torch.zeros(1), torch.zeros(1), torch.ones(1, requires_grad=True), 1.0).requires_grad


def test_expectile_loss_weights_sides_asymmetrically():
    u = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0])
    assert expectile_loss(u, 0.7).tolist() == pytest.approx([0.3 * 4, 0.3 * 1, 0.0, 0.7 * 1, 0.7 * 4])
    # tau = 0.5 is half the squared error; the minimiser over a constant is the tau-expectile
    assert expectile_loss(u, 0.5).tolist() == pytest.approx((0.5 * u ** 2).tolist())
    x = torch.tensor([0.0, 0.0, 1.0])
    v = torch.zeros((), requires_grad=True)
    opt = torch.optim.SGD([v], lr=0.1)
    for _ in range(500):
        opt.zero_grad(); expectile_loss(x - v, 0.9).mean().backward(); opt.step()  # noqa: E702
    # 0.9 * (1 - v) = 0.1 * 2 v  ->  v = 0.9 / 1.1
    assert float(v.detach()) == pytest.approx(0.9 / 1.1, abs=1e-4)


def test_cql_penalty_hand_case():
    q = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]])
    pen = cql_penalty(q, torch.tensor([1, 0]))
    assert pen.tolist() == pytest.approx([math.log(4.0) - math.log(3.0), math.log(2.0)])
    q = torch.tensor([[0.5, 0.1, -0.2]], requires_grad=True)
    cql_penalty(q, torch.tensor([1])).sum().backward()
    # d/dQ = softmax(Q) - onehot(a_data): the logged action goes up, the others down
    assert q.grad[0, 1] < 0 and q.grad[0, 0] > 0 and q.grad[0, 2] > 0
    assert float(q.grad.sum()) == pytest.approx(0.0, abs=1e-6)


def test_polyak_and_hard_updates():
    target, online = [torch.tensor([0.0, 10.0])], [torch.tensor([1.0, 0.0])]
    polyak_update(target, online, tau=0.1)
    assert target[0].tolist() == pytest.approx([0.1, 9.0])
    polyak_update(target, online, tau=1.0)
    assert target[0].tolist() == [1.0, 0.0]
    t2 = [torch.zeros(3)]
    hard_update(t2, [torch.arange(3.0)])
    assert t2[0].tolist() == [0.0, 1.0, 2.0]
    assert [target_due(s, "hard", 3) for s in range(1, 8)] == [False, False, True, False, False, True, False]
    assert all(target_due(s, "polyak", 3) for s in range(1, 5))


def test_awr_weights_and_ess_hand_case():
    w = awr_weights(torch.tensor([-1.0, 0.0, 1.0, 10.0]), beta=0.5, max_weight=20.0)
    assert w.tolist() == pytest.approx([math.exp(-2), 1.0, math.exp(2), 20.0], rel=1e-6)
    ess = effective_sample_size(w)
    assert float(ess) == pytest.approx(float(w.sum() ** 2 / (w ** 2).sum()))
    assert float(effective_sample_size(torch.ones(8))) == pytest.approx(8.0)
    assert float(effective_sample_size(torch.tensor([1.0, 0.0, 0.0]))) == pytest.approx(1.0)
    assert torch.isfinite(awr_weights(torch.tensor([1e6]), 0.01, 20.0)).all()  # no overflow before the clip


def test_importance_weighted_value_hand_case_and_bandit():
    out = importance_weighted_value(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]))
    assert float(out["value"]) == 1.0 and float(out["behaviour_value"]) == 0.5
    assert float(out["ess"]) == pytest.approx(1.0)
    # two decisions per episode: ratios multiply; the masked second decision of episode 1 is ignored
    out = importance_weighted_value(torch.tensor([1.0, 0.0]), torch.tensor([[0.5, 0.5], [0.25, 9.0]]),
                                    torch.tensor([[0.25, 0.25], [0.25, 1.0]]),
                                    mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    assert float(out["value"]) == pytest.approx(4.0 / 5.0)
    # a logged 3-armed bandit under a uniform behaviour: the estimate finds the target policy's true value
    g = torch.Generator().manual_seed(0)
    n, p_arm = 20000, torch.tensor([0.2, 0.5, 0.9])
    a = torch.randint(0, 3, (n,), generator=g)
    r = (torch.rand(n, generator=g) < p_arm[a]).double()
    pi = torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64)
    est = importance_weighted_value(r, pi[a], torch.full((n,), 1 / 3, dtype=torch.float64))
    assert float(est["value"]) == pytest.approx(float((pi * p_arm).sum()), abs=0.02)
    assert 0.5 < float(est["ess_frac"]) < 1.0
