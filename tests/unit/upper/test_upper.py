"""Upper level without a language model: transitions, the strategy critic on fixed features,
targets, text weights, config checks. (test_train_upper.py trains the real writer.)"""

import pytest
import torch

from factories import rewarded_episode
from tosca_mlmt.config import UpperConfig, load_config
from tosca_mlmt.errors import ConfigError, SnapshotError
from tosca_mlmt.upper.critic import StrategyCritic
from tosca_mlmt.upper.dataset import batch_indices, build_transitions, check_strategies, round_rewards
from tosca_mlmt.upper.objective import (DecisionBatch, PolicySpec, advantages, bc_threshold, critic_loss,
                                        text_loss, text_weights)

A = 4


# ------------------------------------------------------------------ transitions (factories.rewarded_episode)


def test_two_round_transitions_rewards_and_returns():
    ep = rewarded_episode("e", [0.0, 0.0, 1.0], actions=[0, 1])
    tr = build_transitions([("snap-a", [ep])], reward_mode="final", gamma=0.8)
    assert [t.round for t in tr] == [1, 2] and [t.action for t in tr] == [0, 1]
    assert [t.reward for t in tr] == [0.0, 1.0] and [t.done for t in tr] == [False, True]
    assert [t.next_index for t in tr] == [1, -1]
    assert [t.ret for t in tr] == pytest.approx([0.8, 1.0]) and tr[0].episode_return == pytest.approx(0.8)
    assert tr[0].state_ids == [1, 2, 3, 11] and tr[1].state_ids == [1, 2, 3, 12] and tr[0].response_ids == [51, 51]
    assert tr[0].task_type == "arith/L2"
    # indices stay global across episodes and snapshots
    tr2 = build_transitions([("snap-a", [ep]), ("snap-b", [rewarded_episode("f", [1.0, 1.0, 0.0], [2, 3])])], gamma=0.8)
    assert [t.next_index for t in tr2] == [1, -1, 3, -1] and tr2[2].snapshot_id == "snap-b"


def test_improvement_reward_and_break_penalty():
    assert round_rewards([1.0, 0.0, 1.0], [True, False, True], "improvement", 0.5) == [-1.5, 1.0]
    assert round_rewards([1.0, 0.0, 1.0], [True, False, True], "final", 0.5) == [-0.5, 1.0]
    assert sum(round_rewards([0.0, 1.0, 1.0, 0.0], [False, True, True, False], "improvement", 0.0)) == 0.0 - 0.0


def test_counterfactual_reward_credits_only_what_the_feedback_caused():
    # round 1: right -> right, but the solver was right without g too: the feedback earned 0;
    # round 2: wrong -> right where the solver without g stayed wrong: +1
    ep = rewarded_episode("e", [1.0, 1.0, 1.0], actions=[0, 1])
    ep.solver_turns[1].info["counterfactual_reward"] = 1.0
    ep.solver_turns[2].info["counterfactual_reward"] = 0.0
    tr = build_transitions([("snap-a", [ep])], reward_mode="counterfactual", gamma=1.0)
    assert [t.reward for t in tr] == [0.0, 1.0]
    # a refine that broke the answer the solver alone would have kept: -1 and the break penalty
    assert round_rewards([1.0, 0.0], [True, False], "counterfactual", 0.5, [1.0]) == [-1.5]
    with pytest.raises(SnapshotError, match="episode.counterfactual=true"):
        build_transitions([("snap-b", [rewarded_episode("f", [0.0, 1.0], [2])])], reward_mode="counterfactual")


def test_leak_penalty_changes_only_the_leaking_decision():
    # round 1's feedback gives the gold answer away; round 2's does not
    assert round_rewards([0.0, 1.0, 1.0], [False, True, True], "improvement", 0.5, None, [True, False], 0.3) == \
        pytest.approx([0.7, 0.0])
    # nothing leaked (or not measured): the penalty changes nothing
    assert round_rewards([0.0, 1.0], [False, True], "improvement", 0.5, None, [False], 0.3) == [1.0]
    assert round_rewards([0.0, 1.0], [False, True], "improvement", 0.5, None, [None], 0.3) == [1.0]
    ep = rewarded_episode("e", [0.0, 1.0, 1.0], actions=[0, 1])
    ep.turns[1].text = "The answer is 2."  # the problem asks 1 + 1
    assert [t.reward for t in build_transitions([("snap-a", [ep])], "improvement", leak_penalty=0.3)] == \
        pytest.approx([0.7, 0.0])
    assert [t.reward for t in build_transitions([("snap-a", [ep])], "improvement")] == [1.0, 0.0]  # default: 0


def test_improved_bc_clones_only_feedback_that_fixed_the_answer():
    rewards = torch.tensor([1.0, 0.0, -1.5, 0.5])
    w = text_weights("improved_bc", torch.zeros(4), torch.zeros(4), 1.0, 20.0, None, rewards)
    assert w.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_snapshots_must_share_the_strategy_set():
    s = [{"name": "a", "instruction": "x"}, {"name": "b", "instruction": "y"}]
    assert check_strategies([{"id": "1", "strategies": s}, {"id": "2", "strategies": s}]) == s
    with pytest.raises(SnapshotError, match="different strategy sets"):
        check_strategies([{"id": "1", "strategies": s}, {"id": "2", "strategies": s[::-1]}])


def test_batch_indices_are_a_pure_function_of_seed_and_step():
    n, b = 5, 3
    first_pass = sum((batch_indices(n, b, 7, s) for s in (1, 2)), [])[:n]
    assert sorted(first_pass) == list(range(n))  # every decision once per pass
    assert batch_indices(n, b, 7, 4) == batch_indices(n, b, 7, 4)
    assert [batch_indices(n, b, 7, s) for s in (1, 2)] != [batch_indices(n, b, 8, s) for s in (1, 2)]


# ------------------------------------------------------------------ the critic on fixed features


def _synthetic(seed: int, p: torch.Tensor, type_scale: float, unlogged: dict[int, list[int]], n_per: int = 200,
               hidden: int = 32):
    """Three state types with P(correct | type, strategy) = p; features = a shared direction (LLM
    states are highly correlated) + a type direction + noise. Behaviour: uniform over the
    strategies logged in that type."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(hidden, generator=g)
    u = 3.0 * u / u.norm()
    types = type_scale * torch.randn(3, hidden, generator=g)
    h, acts, rews, ty = [], [], [], []
    for t in range(3):
        allowed = [a for a in range(A) if a not in unlogged.get(t, [])]
        for _ in range(n_per):
            a = allowed[int(torch.randint(0, len(allowed), (1,), generator=g))]
            h.append(u + types[t] + 0.3 * torch.randn(hidden, generator=g))
            acts.append(a)
            rews.append(float(torch.rand(1, generator=g) < p[t, a]))
            ty.append(t)
    return torch.stack(h), torch.tensor(acts), torch.tensor(rews), torch.tensor(ty), p


def _fit(cfg: UpperConfig, h, acts, rews, dones=None, h_next=None, steps: int = 400, lr: float = 1e-2,
         signals=None):
    critic = StrategyCritic(cfg, h.shape[1], A)
    groups = [{"params": critic.head_parameters(), "lr": lr}]
    if critic.table_parameters():  # upper.q_signal: the table at its own rate, as the learner does
        groups.append({"params": critic.table_parameters(), "lr": cfg.signal_lr})
    opt = torch.optim.Adam(groups)
    dones = torch.ones(len(acts)) if dones is None else dones
    b = DecisionBatch(acts, rews, dones, rews, signals=signals,
                      next_signals=None if signals is None else torch.zeros_like(signals))
    for step in range(1, steps + 1):
        loss, _ = critic_loss(critic, b, h, h, h_next, h_next, cfg.gamma, cfg.cql_alpha, cfg.iql_tau, PolicySpec())
        opt.zero_grad()
        loss.backward()
        opt.step()
        critic.update_target(step)
    return critic


def _q_by_type(critic, h, ty):
    with torch.no_grad():
        q = critic.q(h)
    return torch.stack([q[ty == t].mean(0) for t in range(3)])


@pytest.mark.parametrize("conservatism", ["cql", "iql", "none"])
def test_learned_q_ranks_the_best_strategy_first_per_state_type(conservatism):
    p = torch.tensor([[0.8, 0.3, 0.2, 0.1], [0.2, 0.8, 0.3, 0.1], [0.3, 0.2, 0.1, 0.8]])
    h, acts, rews, ty, _ = _synthetic(0, p, type_scale=1.0, unlogged={})
    critic = _fit(UpperConfig(conservatism=conservatism), h, acts, rews)
    q = _q_by_type(critic, h, ty)
    best = p.argmax(1)  # a different best strategy per state type: 0, 1, 3
    for t in range(3):
        assert int(q[t].argmax()) == int(best[t]), (t, q[t].tolist())
        assert q[t, best[t]] - q[t][torch.arange(A) != best[t]].max() > 0.05


def test_cql_holds_never_logged_strategies_below_logged_ones_and_plain_td_overshoots():
    # strategy 3 is never logged in type 0 (its true success rate there is 0) but pays 0.9 elsewhere
    p = torch.tensor([[0.8, 0.3, 0.2, 0.0], [0.2, 0.8, 0.3, 0.9], [0.3, 0.2, 0.8, 0.9]])
    h, acts, rews, ty, _ = _synthetic(1, p, type_scale=0.3, unlogged={0: [3]})
    q_none = _q_by_type(_fit(UpperConfig(conservatism="none"), h, acts, rews), h, ty)[0]
    q_cql = _q_by_type(_fit(UpperConfig(conservatism="cql", cql_alpha=0.5), h, acts, rews), h, ty)[0]
    logged = [0, 1, 2]
    # without conservatism the unseen strategy borrows the value it has in other states:
    # far above its true 0 and above every logged strategy but the best
    assert q_none[3] > 0.4 and q_none[3] > sorted(q_none[logged].tolist())[-2]
    # with CQL it stays below every logged strategy of that state
    assert q_cql[3] < q_cql[logged].min() - 0.5
    assert q_none[3] - q_cql[3] > 1.0
    assert int(q_cql.argmax()) == 0  # and the best logged strategy still wins


@pytest.mark.parametrize("conservatism", ["none", "iql", "cql"])
def test_gamma_backup_across_two_rounds(conservatism):
    """Round 1 (state s1, strategy 0) earns nothing itself; round 2 (s2, strategy 1) ends correct.
    Q(s2, 1) -> 1 and Q(s1, 0) -> 0 + gamma * (max_a Q_bar(s2, a) or V(s2)) = gamma."""
    gamma = 0.8
    tr = build_transitions([("s", [rewarded_episode("e", [0.0, 0.0, 1.0], actions=[0, 1])])], gamma=gamma)
    h = torch.eye(2) * 2.0  # one-hot features of s1 and s2
    h_next = torch.stack([h[1], torch.zeros(2)])  # s' of round 1 is s2; round 2 is terminal
    acts = torch.tensor([t.action for t in tr])
    rews = torch.tensor([t.reward for t in tr])
    dones = torch.tensor([float(t.done) for t in tr])
    cfg = UpperConfig(conservatism=conservatism, gamma=gamma, target_update="polyak", target_tau=0.2,
                      cql_alpha=0.01, iql_tau=0.9)
    critic = _fit(cfg, h, acts, rews, dones=dones, h_next=h_next, steps=1500, lr=2e-2)
    with torch.no_grad():
        q = critic.q(h)
    assert float(q[1, 1]) == pytest.approx(1.0, abs=0.03)
    assert float(q[0, 0]) == pytest.approx(gamma, abs=0.03)
    assert tr[0].ret == pytest.approx(gamma)  # the logged return agrees with the backup


def test_target_head_follows_the_configured_rule():
    h = torch.randn(8, 5)
    b = DecisionBatch(torch.zeros(8, dtype=torch.long), torch.ones(8), torch.ones(8), torch.ones(8))
    for mode, tau, every in (("hard", 1.0, 3), ("polyak", 0.25, 1)):
        critic = StrategyCritic(UpperConfig(target_update=mode, target_tau=tau, target_sync_every=every), 5, 2)
        opt = torch.optim.SGD(critic.head_parameters(), lr=0.1)
        for step in range(1, 7):
            before = critic.q_target.proj.weight.clone()
            loss, _ = critic_loss(critic, b, h, h, None, None, 0.9, 0.5, 0.7, PolicySpec())
            opt.zero_grad()
            loss.backward()
            opt.step()
            moved = critic.update_target(step)
            online, target = critic.q.proj.weight, critic.q_target.proj.weight
            if mode == "hard":
                assert moved == (step % 3 == 0)
                assert torch.equal(target, online) if moved else torch.equal(target, before)
            else:
                assert moved and torch.allclose(target, 0.75 * before + 0.25 * online)
        assert not any(p.requires_grad for p in critic.q_target.parameters())


# ------------------------------------------------------------------ text weights


def test_awr_weights_from_q_minus_v_and_filtered_bc_cut():
    q_sa, v, g = torch.tensor([0.5, 0.2, 0.9]), torch.tensor([0.3, 0.4, 0.1]), torch.tensor([1.0, 0.0, 1.0])
    adv = advantages(q_sa, v, g, "q_minus_v")
    assert adv.tolist() == pytest.approx([0.2, -0.2, 0.8])
    w = text_weights("awr", adv, g, beta=0.5, max_weight=4.0)
    assert w.tolist() == pytest.approx([torch.exp(torch.tensor(0.4)).item(), torch.exp(torch.tensor(-0.4)).item(), 4.0])
    assert advantages(q_sa, v, g, "return_minus_q").tolist() == pytest.approx([0.5, -0.2, 0.1])
    # filtered BC: 0/1 returns with a 0.5 quantile at 0 must not keep the failures
    cut = bc_threshold(torch.tensor([0.0, 0.0, 0.0, 1.0]), 0.5)
    assert text_weights("filtered_bc", adv, torch.tensor([1.0, 0.0, 1.0]), 1.0, 1.0, cut).tolist() == [1.0, 0.0, 1.0]
    # the loss only reads feedback tokens: changing prompt log-probs changes nothing
    logp = torch.tensor([[-9.0, -1.0, -3.0], [-9.0, -2.0, -4.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    loss, _ = text_loss(logp, mask, torch.tensor([1.0, 0.5]))
    assert float(loss) == pytest.approx((2.0 * 1.0 + 4.0 * 0.5) / 2)
    logp[:, 0] = -100.0
    assert float(text_loss(logp, mask, torch.tensor([1.0, 0.5]))[0]) == pytest.approx(float(loss))


def test_upper_config_is_validated_at_load():
    cfg = load_config(overrides={"upper.conservatism": "iql", "upper.gamma": 0.5})
    assert cfg.upper.conservatism == "iql" and cfg.upper.gamma == 0.5 and cfg.upper.q_source == "head"
    with pytest.raises(ConfigError, match="upper.gamma"):
        load_config(overrides={"upper.gamma": 2})
    with pytest.raises(ConfigError, match="allowed: cql, iql, none"):
        load_config(overrides={"upper.conservatism": "bcq"})
    with pytest.raises(ConfigError, match="unknown config field 'upper.nope'"):
        load_config(overrides={"upper.nope": 1})


def test_the_signal_table_learns_what_the_hidden_state_does_not_show():
    """upper.q_signal: when the best strategy depends on what the writer was told (o = the state type)
    and h(s) carries none of it, Q(s, a) = w_a . h + T[o, a] ranks the best strategy first per o;
    the head alone cannot."""
    p = torch.tensor([[0.8, 0.3, 0.2, 0.1], [0.2, 0.8, 0.3, 0.1], [0.3, 0.2, 0.1, 0.8]])
    h, acts, rews, ty, _ = _synthetic(0, p, type_scale=0.0, unlogged={})  # h: the same distribution per type
    with_table = _fit(UpperConfig(q_signal=True), h, acts, rews, signals=ty)
    without = _fit(UpperConfig(q_signal=False), h, acts, rews, signals=ty)
    with torch.no_grad():
        q_t, q_h = with_table.q(h, ty), without.q(h, ty)
    for t in range(3):
        assert int(q_t[ty == t].mean(0).argmax()) == int(p[t].argmax()), (t, q_t[ty == t].mean(0).tolist())
    # without the table the three types look alike: whatever noise it fits, it cannot pick all three best
    assert [int(q_h[ty == t].mean(0).argmax()) for t in range(3)] != p.argmax(1).tolist()
    # the table is in the exported head, and a head without signals reads the features alone
    head = with_table.exported_head()
    assert torch.equal(head.signal_table, with_table.q.signal_table)
    assert torch.allclose(head(h, ty) - head(h), head.signal_table[ty])


def test_a_continued_head_keeps_its_table_and_a_head_without_one_gains_a_zero_table():
    from tosca_mlmt.models.q_head import QHead

    old = QHead(8, A)
    with torch.no_grad():
        old.proj.weight.normal_()
    grown = StrategyCritic(UpperConfig(q_signal=True), 8, A, init_head=old)
    assert grown.q.signal_table.abs().sum() == 0 and torch.equal(grown.q.proj.weight, old.proj.weight)
    with torch.no_grad():
        grown.q.signal_table.normal_()
    kept = StrategyCritic(UpperConfig(q_signal=False), 8, A, init_head=grown.exported_head())
    assert torch.equal(kept.q.signal_table, grown.q.signal_table) and kept.table_parameters()


def test_the_iql_v_head_is_standardised_whichever_head_q_is_read_from():
    """V(s) is a fresh linear head on h(s) in every run: it needs the feature standardisation a fresh
    Q head gets, also when Q is read from the LM logits or continued from a saved head (whose own
    stats must stay as they were fitted)."""
    from tosca_mlmt.models.q_head import QHead
    from tosca_mlmt.upper.critic import feature_stats

    g = torch.Generator().manual_seed(0)
    feats = 50.0 + 7.0 * torch.randn(32, 8, generator=g)  # raw hidden states: far from zero mean, unit scale
    mean, scale = feature_stats(feats)

    logits = StrategyCritic(UpperConfig(q_source="logits", conservatism="iql"), 8, A, lm_rows=torch.randn(A, 8))
    assert logits.needs_feature_stats()
    logits.set_feature_stats(feats)
    assert torch.equal(logits.v.mean, mean) and torch.equal(logits.v.scale, scale)
    with torch.no_grad():
        logits.v.proj.weight.zero_()
        logits.v.proj.weight[0, 3] = 1.0
    torch.testing.assert_close(logits.v(feats), (feats[:, 3] - mean[3]) / scale[3])

    old = QHead(8, A)
    old.set_feature_stats(torch.full((8,), 2.0), torch.full((8,), 3.0))
    cont = StrategyCritic(UpperConfig(conservatism="iql"), 8, A, init_head=old)
    assert cont.needs_feature_stats()
    cont.set_feature_stats(feats)
    assert torch.equal(cont.v.mean, mean) and torch.equal(cont.q.mean, torch.full((8,), 2.0))
    assert torch.equal(cont.q_target.scale, torch.full((8,), 3.0))

    off = StrategyCritic(UpperConfig(q_source="logits", conservatism="iql", q_standardize=False), 8, A,
                         lm_rows=torch.randn(A, 8))
    assert not off.needs_feature_stats()
    assert not StrategyCritic(UpperConfig(q_source="logits"), 8, A, lm_rows=torch.randn(A, 8)).needs_feature_stats()


def test_q_signal_needs_the_head():
    with pytest.raises(ConfigError, match="upper.q_signal"):
        load_config(overrides={"upper.q_signal": True, "upper.q_source": "logits"})


def test_gold_prob_reward_is_the_rise_in_the_gold_answers_probability():
    # attempt 1 right with p_gold 0.9; the refine kept it at 0.6 (the feedback shook it), then lost it (0.2)
    ep = rewarded_episode("e", [1.0, 1.0, 0.0], actions=[0, 1])
    for t, p in zip(ep.solver_turns, (0.9, 0.6, 0.2)):
        t.info["gold_prob"] = p
    tr = build_transitions([("snap-a", [ep])], reward_mode="gold_prob", break_penalty=0.5, gamma=1.0)
    # round 2 broke a right answer: the break penalty on top of -0.4
    assert [t.reward for t in tr] == pytest.approx([-0.3, -0.4 - 0.5])
    assert round_rewards([0.0, 0.0], [False, False], "gold_prob", 0.5, gold_probs=[0.1, 0.35]) == pytest.approx([0.25])
    with pytest.raises(SnapshotError, match="episode.gold_prob=true"):
        build_transitions([("snap-b", [rewarded_episode("f", [0.0, 1.0], [2])])], reward_mode="gold_prob")


def test_gold_prob_reward_needs_the_collect_knob():
    with pytest.raises(ConfigError, match="upper.reward"):
        load_config(overrides={"upper.reward": "gold_prob"})
    assert load_config(overrides={"upper.reward": "gold_prob", "episode.gold_prob": True}).episode.gold_prob
