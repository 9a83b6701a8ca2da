"""The lower level's losses (lower/objective.py, algos/losses.py): the PPO loss over the kept mask,
micro-batches cut to their longest row, and which parameters the value and ArCHer critic losses reach."""

import math
from dataclasses import replace

import pytest
import torch

from factories import cut_first_attempt, sampled_lower_setup
from tosca_mlmt.lower.trajectory import to_tensors, without_cut_turns


def test_ppo_loss_over_the_kept_mask_is_the_mean_over_the_uncut_tokens_alone():
    """The reference is computed token by token over the turns that were not cut; the cut turn's
    tokens get no gradient, and the loss differs from the unmasked one."""
    from tosca_mlmt.config import load_config
    from tosca_mlmt.lower.objective import UpdateBatch, ppo_loss
    from tosca_mlmt.lower.scoring import Forward

    lo = load_config().lower
    trajs = cut_first_attempt(3)
    tt = to_tensors(trajs, pad_id=0)
    kept, _ = without_cut_turns(trajs, tt)
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(tt.mask.shape, generator=g)).requires_grad_()
    lp0 = lp.detach()
    old = lp.detach() + 0.3 * torch.randn(tt.mask.shape, generator=g)
    adv = torch.randn(tt.mask.shape, generator=g)

    def loss_of(t):
        mb = UpdateBatch(t, old, None, None, adv, torch.zeros_like(adv), torch.zeros_like(adv), None)
        return ppo_loss(lo, Forward(lp, None, None, None), mb, None)[0]

    loss = loss_of(kept)
    ref, n = 0.0, 0
    for b, t in enumerate(trajs):
        for (s, e), cut in zip(t.turn_spans, t.cut):
            for i in range(s, e):
                if not cut:
                    r = math.exp(float(lp0[b, i]) - float(old[b, i]))
                    a = float(adv[b, i])
                    ref += -min(r * a, min(max(r, 1 - lo.clip_low), 1 + lo.clip_high) * a)
                    n += 1
    assert float(loss) == pytest.approx(ref / n, rel=1e-5)
    (grad,) = torch.autograd.grad(loss, lp)
    s, e = trajs[0].turn_spans[0]
    assert grad[0, s:e].abs().max() == 0 and grad[kept.mask > 0].abs().max() > 0
    assert float(loss_of(tt)) != pytest.approx(float(loss), rel=1e-3)


@pytest.mark.slow
def test_micro_batches_are_cut_to_their_longest_row_without_changing_the_loss(debug_cfg, debug_policies):
    """UpdateBatch.select drops the right padding past the selected rows' longest sequence; the
    loss and its gradient on the cut micro-batch equal those on the full width (fp32)."""
    from tosca_mlmt.lower import objective
    from tosca_mlmt.lower.scoring import SolverScorer

    policies = debug_policies
    cfg, trajs = sampled_lower_setup(debug_cfg, policies)
    # the random model writes every turn to max_new_tokens: shorten two refines so rows differ
    for i in (0, 1):
        t = trajs[i]
        s, e = t.turn_spans[-1]
        k = (e - s) // 2
        trajs[i] = replace(t, ids=t.ids[: e - k], turn_spans=[*t.turn_spans[:-1], (s, e - k)],
                           behaviour_logprobs=[*t.behaviour_logprobs[:-1], t.behaviour_logprobs[-1][: e - k - s]])
    tt = to_tensors(trajs, policies.tokenizer("solver").pad_token_id or 0)
    lengths = tt.attention_mask.sum(1)
    rows = torch.argsort(lengths)[:2]  # the two shortest: the most padding to drop
    assert int(lengths[rows].max()) < tt.input_ids.shape[1]
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(tt.mask.shape, generator=gen) * tt.mask
    zeros = torch.zeros(tt.mask.shape)
    full = objective.UpdateBatch(tt, None, None, None, adv, zeros, zeros, None)
    cut = full.select(rows)
    assert cut.tt.input_ids.shape == (2, int(lengths[rows].max()))
    uncut = objective.UpdateBatch(tt.select(rows), None, None, None, adv[rows], zeros[rows], zeros[rows], None)
    scorer = SolverScorer(cfg.lower, policies, torch.nn.Linear(1, 1))
    params = [p for p in policies.model("solver").parameters() if p.requires_grad]
    out = []
    for mb in (cut, uncut):
        with policies.use("solver"):
            fwd = scorer.forward(mb.tt.input_ids, mb.tt.attention_mask)
        loss, _ = objective.ppo_loss(cfg.lower, fwd, mb, None)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        out.append((loss.detach(), [g for g in grads if g is not None]))
    assert out[0][1], "no gradient reached the adapter"
    assert torch.allclose(out[0][0], out[1][0], rtol=1e-5, atol=1e-7)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(out[0][1], out[1][1]))


def test_the_value_loss_moves_the_adapter_and_the_archer_critic_does_not(debug_cfg, debug_policies):
    """gae's value head reads the trunk undetached (lower.vf_coef's help says so, as in TRL's value-head
    models): its loss alone has a gradient on the solver's adapter. ArCHer's critic reads detached
    features: its loss has none there, only on the critic."""
    from tosca_mlmt.algos.losses import value_loss
    from tosca_mlmt.lower import archer
    from tosca_mlmt.lower.scoring import SolverScorer

    policies = debug_policies
    cfg, trajs = sampled_lower_setup(debug_cfg, policies)
    tt = to_tensors(trajs, policies.tokenizer("solver").pad_token_id or 0)
    hidden_size = policies.model("solver").config.hidden_size
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden_size, 1)
    scorer = SolverScorer(cfg.lower, policies, head)
    adapter = [p for p in policies.model("solver").parameters() if p.requires_grad]
    with policies.use("solver"):
        fwd = scorer.forward(tt.input_ids, tt.attention_mask, values=True)
    returns = torch.ones_like(fwd.values)
    vl, _ = value_loss(fwd.values, fwd.values.detach(), returns, tt.mask)
    grads = torch.autograd.grad(vl, adapter, allow_unused=True, retain_graph=True)
    assert any(g is not None and g.abs().sum() > 0 for g in grads), "the value loss did not reach the adapter"

    critic = archer.UtteranceCritic(hidden_size)
    n_turns = max(len(t.turn_spans) for t in trajs)
    spans = [list(t.turn_spans) for t in trajs]
    y = torch.ones(len(trajs), n_turns)
    valid = torch.tensor([[float(k < len(s)) for k in range(n_turns)] for s in spans])
    targets = archer.CriticTargets(spans, y, y, valid)
    closs = archer.loss_on(critic, fwd.hidden, targets, n_turns)
    grads = torch.autograd.grad(closs, adapter + list(critic.parameters()), allow_unused=True)
    assert all(g is None for g in grads[: len(adapter)]), "the ArCHer critic moved the actor"
    assert any(g is not None and g.abs().sum() > 0 for g in grads[len(adapter):])


def _two_turn_group(r1s: list[float], r2s: list[float], problem: str = "p") -> list:
    """Hand-made two-turn trajectories of one problem: turn 1 at [1, 4), feedback [4, 6), the refine [6, 9)."""
    from tosca_mlmt.lower.trajectory import SolverTrajectory

    return [SolverTrajectory(f"e{i}", problem, list(range(10, 19)), [(1, 4), (6, 9)], [r1, r2],
                             [[-0.5] * 3, [-0.5] * 3], [None, (4, 6)], [False, False])
            for i, (r1, r2) in enumerate(zip(r1s, r2s))]


@pytest.mark.parametrize("stage", [1, 2])
def test_score_advantages_match_the_papers_shaping_computed_by_hand(stage):
    """configs/score.yaml on a group of four two-turn episodes with KL terms: stage I returns R1 = R2 = r2,
    stage II R2 = r2 + alpha (r2 - r1) and R1 = r1 + R2 (turn_gamma 1), each turn's advantage
    (R - group mean) / (group std + eps); the KL sits in the loss with SCoRe's per-turn betas and moves no
    advantage. The preset loads without the KL-reward collapse warning."""
    import statistics
    import warnings

    from tosca_mlmt.algos.advantages import AdvantageInputs
    from tosca_mlmt.config import load_config
    from tosca_mlmt.lower import objective
    from tosca_mlmt.lower.scoring import Scores

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a ConfigWarning fails the test
        lo = load_config("score").lower
    sc = lo.score
    r1s, r2s = [0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]
    trajs = _two_turn_group(r1s, r2s)
    tt = to_tensors(trajs, pad_id=0)
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(tt.mask.shape, generator=g) * tt.mask
    ref = old - 0.2 * torch.rand(tt.mask.shape, generator=g) * tt.mask  # KL terms of a few tenths of a nat
    step = 0 if stage == 1 else sc.stage1_steps
    rewards = objective.token_rewards(trajs, tt, Scores(old, None, None, ref, None), lo, step)
    adv, _ = objective.estimate(lo, AdvantageInputs(rewards.rewards, tt.mask, tt.turn_ids, tt.groups, tt.n_turns))
    assert rewards.stage == stage and rewards.kl.abs().sum() > 0
    if stage == 1:
        R2 = list(r2s)
        R1 = list(R2)
        betas = (sc.beta2, lo.kl_coef)
    else:
        R2 = [r2 + sc.alpha * (r2 - r1) for r1, r2 in zip(r1s, r2s)]
        R1 = [r1 + R for r1, R in zip(r1s, R2)]
        betas = (sc.beta1, sc.beta1)
    for k, (R, beta) in enumerate(zip((R1, R2), betas)):
        mean, std = statistics.fmean(R), statistics.pstdev(R)
        want = torch.tensor([(x - mean) / (std + 1e-6) for x in R])
        s, e = trajs[0].turn_spans[k]
        for b in range(len(trajs)):
            torch.testing.assert_close(adv[b, s:e], want[b].expand(e - s).float(), atol=1e-5, rtol=0)
        assert torch.all(rewards.kl_weight[:, s:e] == beta)


def test_first_turn_only_leaves_the_refines_no_gradient_whatever_their_advantages():
    """The masked-refine control's loss mask (lower.train_refine=false): the loss's gradient is the same
    whatever the refines' advantages are (a refine-only change of reward), and all zero on refine tokens;
    with the whole mask the same change moves it."""
    from tosca_mlmt.config import load_config
    from tosca_mlmt.lower.objective import UpdateBatch, ppo_loss
    from tosca_mlmt.lower.scoring import Forward
    from tosca_mlmt.lower.trajectory import first_turn_only

    lo = load_config("mlmt").lower
    trajs = _two_turn_group([0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0])
    tt = to_tensors(trajs, pad_id=0)
    masked = first_turn_only(tt)
    refine = tt.turn_ids == 1
    assert masked.mask[refine].sum() == 0 and torch.equal(masked.mask[~refine], tt.mask[~refine])
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(tt.mask.shape, generator=g)).requires_grad_()
    old, ref = lp.detach() + 0.1 * torch.randn(tt.mask.shape, generator=g), lp.detach() - 0.3
    adv = torch.randn(tt.mask.shape, generator=g) * tt.mask
    other = torch.where(refine, -3.0 * adv, adv)  # the refines' advantages alone change

    def grad(t, a):
        mb = UpdateBatch(t, old, None, ref, a, torch.zeros_like(a), torch.full_like(a, lo.kl_coef), None)
        return torch.autograd.grad(ppo_loss(lo, Forward(lp, None, None, None), mb, None)[0], lp)[0]

    assert torch.equal(grad(masked, adv), grad(masked, other))
    assert grad(masked, adv)[refine].abs().max() == 0 and grad(masked, adv)[~refine].abs().max() > 0
    assert not torch.allclose(grad(tt, adv), grad(tt, other))


@pytest.mark.parametrize("coef, train_refine, scorer, on, by_vllm", [
    (0.1, True, "auto", True, True),
    (0.1, True, "engine", True, True),
    (0.1, True, "trainer", True, False),
    (0.1, False, "auto", False, False),  # the masked-refine control computes no bonus, so no engine scored one
    (0.1, False, "engine", False, False),
    (0.0, True, "auto", False, False),
])
def test_the_engine_scores_the_bonus_only_where_one_is_computed(coef, train_refine, scorer, on, by_vllm):
    """lower.bonus_on is the one switch: lower/bonus/engine_scored follows it, as the bonus and pi_old skip do."""
    from types import SimpleNamespace

    from tosca_mlmt.config import load_config
    from tosca_mlmt.lower.learner import bonus_scored_by_engine

    lo = load_config("mlmt").lower
    lo = replace(lo, train_refine=train_refine, bonus=replace(lo.bonus, coef=coef, scorer=scorer, model="policy"),
                 logprob_temperature="raw")
    assert lo.bonus_on is on
    assert bonus_scored_by_engine(lo, SimpleNamespace(name="vllm")) is by_vllm
    assert bonus_scored_by_engine(lo, SimpleNamespace(name="hf")) is (by_vllm and scorer == "engine")
