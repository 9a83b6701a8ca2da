"""The lower-level learner (lower/learner.py): the context-dependency bonus, parameter updates, the
pi_old and reference passes it skips, bf16 master weights, gradient accumulation."""

import copy
import math
from dataclasses import replace

import pytest
import torch

from conftest import restored
from factories import bf16_pair, sampled_lower_setup
from tosca_mlmt.lower.trajectory import to_tensors


# bf16 keeps 8 significand bits, and a batched (right-padded) bf16 forward and an unbatched one
# round differently all the way up the residual stream: oneDNN picks its GEMM blocking by shape,
# on AMX most of all. Measured on an AMX Xeon, one token's log-prob under the two disagrees by up
# to 0.23 nats, so a token bonus (coef 0.5 x a difference of two log-probs) may be off by
# 0.5 x 2 x 0.25 = 0.25. At clip 0.3 no bonus exceeds 0.15, so that bound catches a shifted token
# (log-probs swing by nats between neighbours) but little else; the rest is the second check: a
# wrong span, feedback left in or a flipped sign is off by the bonus's own size summed over the
# refine, while bf16 noise stays within a quarter of it (about a tenth, measured).
TOLERANCE = {"fp32": dict(atol=2e-4, rtol=1e-4), "bf16": dict(atol=0.25, rtol=0.0)}


@pytest.fixture(scope="module")
def debug_setup(lower_setup, debug_cfg):
    """The embedded model's sampled episodes (some right, some wrong: advantages and bonus gates with
    signal) scored and trained on the debug base, which shares their tokenizer. For the tests whose
    checks are identities between two computations of the same learner, not what the model knows:
    the same forwards at a tenth of the cost."""
    cfg, trajs = lower_setup
    return replace(cfg, model=debug_cfg.model), trajs


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bonus_equals_an_independent_two_forward_computation(debug_setup, bf16_setup, debug_policies, precision):
    """Both bonus levels against plain unbatched forwards of HF's own model; the reference does
    not depend on the level, so it is computed once for both."""
    from peft import set_peft_model_state_dict

    from tosca_mlmt.lower.learner import LowerLearner

    cfg, trajs, policies = (*debug_setup, debug_policies) if precision == "fp32" else bf16_setup
    model = policies.model("solver")
    state = copy.deepcopy(policies.adapter_state("solver"))

    def lp_of(context, y):  # plain, unbatched forward over context + y; HF's own logits of y, in fp32
        ids = torch.tensor([context + y])
        with policies.use("solver"), torch.no_grad(), torch.autocast("cpu", torch.bfloat16,
                                                                      enabled=precision == "bf16"):
            # logits_to_keep: HF's head on the last len(y) + 1 positions only, those that predict y
            logits = model(input_ids=ids, logits_to_keep=len(y) + 1).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(y)[:, None]).squeeze(-1)

    diffs = []
    for t in trajs:
        s, e = t.turn_spans[1]
        g0, g1 = t.feedback_spans[1]
        diffs.append(lp_of(t.ids[:s], t.ids[s:e]) - lp_of(t.ids[:g0] + t.ids[g1:s], t.ids[s:e]))
    # ungated and summed: the raw two-forward quantity, whatever the episodes' rewards
    trainers = {level: LowerLearner(replace(cfg, lower=replace(cfg.lower, bonus=replace(
        cfg.lower.bonus, level=level, clip=0.3, gate="none", reduce="sum"))), policies) for level in ("sequence", "token")}
    assert all(t.scorer.use_bf16 == (precision == "bf16") for t in trainers.values())
    tt = to_tensors(trajs, trainers["token"].pad_id)
    with torch.no_grad():  # pi_old does not depend on the level either: one batched forward for both
        old_lp = trainers["token"].scorer.forward(tt.input_ids, tt.attention_mask).logprobs
    shared = {}  # nor does log pi(y | x, z): the first level's no-feedback forward serves both levels
    for trainer in trainers.values():
        def without_feedback(ts, reference, engine=None, real=trainer.scorer.without_feedback):
            if reference not in shared:
                shared[reference] = real(ts, reference=reference, engine=engine)
            return shared[reference]
        trainer.scorer.without_feedback = without_feedback
    for level, trainer in trainers.items():
        bonus, stats = trainer.context_bonus(trajs, old_lp, None, torch.zeros_like(old_lp))
        errors, sizes = [], []
        for b, (t, diff) in enumerate(zip(trajs, diffs)):
            s, e = t.turn_spans[1]
            if level == "sequence":  # one term, on every token of the refine
                want = torch.full((e - s,), float(0.5 * diff.sum().clamp(-0.3, 0.3)))
            else:
                want = 0.5 * diff.clamp(-0.3, 0.3)
            torch.testing.assert_close(bonus[b, s:e], want, **TOLERANCE[precision], msg=lambda m: f"{level}: {m}")
            assert bonus[b, : s].abs().sum() == 0, level
            errors.append((bonus[b, s:e] - want).abs().sum())
            sizes.append(want.abs().sum())
        assert sum(errors) <= 0.25 * sum(sizes) if precision == "bf16" else True, level
        assert 0.0 <= stats["bonus/clip_rate"] <= 1.0
    assert list(shared) == [False]  # bonus.model=policy: the adapter's own forward
    set_peft_model_state_dict(model, state, adapter_name="solver")


@pytest.mark.slow
def test_bonus_shifts_only_refine_advantages_after_normalization(debug_setup, debug_policies, monkeypatch):
    """Turn 1's advantages are the same with and without the bonus, and the refine's advantage
    moves by exactly the bonus (added after the group normalization, not inside it)."""
    from tosca_mlmt.lower.learner import LowerLearner

    cfg, trajs = debug_setup
    policies = debug_policies
    # every refine broke a right answer (r1 = 1, r_final = 0): the improvement gate is -1 on all
    trajs = [replace(t, turn_rewards=[1.0, 0.0]) for t in trajs]
    seen = {}
    monkeypatch.setattr(LowerLearner, "_epochs", lambda self, batch, step: seen.update(
        adv=batch.advantages.clone(), tt=batch.tt) or {"grad_norm": 0.0})
    runs = {}
    for coef in (0.0, 0.5):  # KL off: 0 at the fresh adapter anyway, and off no reference pass runs
        c = replace(cfg, lower=replace(cfg.lower, kl_coef=0.0, bonus=replace(cfg.lower.bonus, coef=coef, clip=100.0)))
        LowerLearner(c, policies).update(trajs, step=0)
        runs[coef] = seen["adv"]
    tt = seen["tt"]
    t1, t2 = tt.turn_ids == 0, tt.turn_ids == 1
    torch.testing.assert_close(runs[0.5][t1], runs[0.0][t1], atol=0, rtol=0)
    # all groups tie (same rewards): the estimator gives 0, so the refine advantage is the bonus alone,
    # the same on every token of a refine (sequence level)
    assert runs[0.0][t2].abs().max() == 0
    shift = runs[0.5] - runs[0.0]
    assert (shift[t2] != 0).any() and shift[~t2].abs().max() == 0
    for b in range(len(trajs)):
        vals = shift[b][t2[b]]
        assert torch.allclose(vals, vals[0].expand_as(vals))


@pytest.mark.slow
def test_turn_gamma_zero_keeps_refine_outcomes_out_of_turn_one(debug_setup, debug_policies, monkeypatch):
    """The learner hands lower.turn_gamma to the estimator: at 0, turn 1's advantages are the same
    whether the refines kept or broke the right answers; at 1 (reward-to-go) they move."""
    from tosca_mlmt.lower.learner import LowerLearner

    cfg, trajs = debug_setup
    policies = debug_policies
    seen = {}
    monkeypatch.setattr(LowerLearner, "_epochs", lambda self, batch, step: seen.update(
        adv=batch.advantages.clone(), tt=batch.tt) or {"grad_norm": 0.0})
    runs = {}
    for gamma in (0.0, 1.0):
        # no bonus and no KL: the advantages come from the rewards alone, and no scoring forward runs
        c = replace(cfg, lower=replace(cfg.lower, turn_gamma=gamma, kl_coef=0.0,
                                       bonus=replace(cfg.lower.bonus, coef=0.0)))
        for name, finals in (("kept", lambda i: float(i % 2)), ("broke", lambda i: float(i % 3 == 0))):
            ts = [replace(t, turn_rewards=[float(i % 2), finals(i)]) for i, t in enumerate(trajs)]
            LowerLearner(c, policies).update(ts, step=0)
            runs[gamma, name] = seen["adv"]
    t1 = seen["tt"].turn_ids == 0
    torch.testing.assert_close(runs[0.0, "kept"][t1], runs[0.0, "broke"][t1], atol=0, rtol=0)
    assert not torch.allclose(runs[1.0, "kept"][t1], runs[1.0, "broke"][t1])
    assert runs[0.0, "kept"][t1].abs().max() > 0


@pytest.mark.slow
def test_mask_truncated_drops_cut_turns_from_the_loss_but_not_from_the_advantages(debug_setup, debug_policies,
                                                                                   monkeypatch):
    from tosca_mlmt.lower.learner import LowerLearner

    cfg, trajs = debug_setup
    policies = debug_policies
    # rewards that vary within groups (nonzero advantages); row 0's first attempt was cut. No bonus and no
    # KL: nothing then reads pi_old or the reference before the update, so no scoring forward runs
    trajs = [replace(t, turn_rewards=[float(i % 2), float((i + 1) % 2)], cut=[i == 0, False])
             for i, t in enumerate(trajs)]
    cfg = replace(cfg, lower=replace(cfg.lower, kl_coef=0.0, bonus=replace(cfg.lower.bonus, coef=0.0)))
    seen, logged = {}, {}
    real_epochs = LowerLearner._epochs
    monkeypatch.setattr(LowerLearner, "_epochs", lambda self, batch, step: seen.update(
        adv=batch.advantages.clone(), mask=batch.tt.mask.clone()) or {"grad_norm": 0.0})
    for on in (False, True):
        c = replace(cfg, lower=replace(cfg.lower, mask_truncated=on))
        logged[on] = LowerLearner(c, policies).update(trajs, step=0).metrics
        seen[on] = dict(seen)
    assert seen[False]["adv"].abs().max() > 0
    torch.testing.assert_close(seen[True]["adv"], seen[False]["adv"], atol=0, rtol=0)
    s, e = trajs[0].turn_spans[0]
    assert seen[False]["mask"][0, s:e].sum() == e - s and seen[True]["mask"][0, s:e].sum() == 0
    assert torch.equal(seen[True]["mask"][1:], seen[False]["mask"][1:])
    assert logged[True]["truncated_turns"] == logged[False]["truncated_turns"] == 1
    assert (logged[True]["truncated_turns_masked"], logged[False]["truncated_turns_masked"]) == (1, 0)
    assert logged[False]["loss_tokens"] - logged[True]["loss_tokens"] == e - s

    # a batch whose every turn was cut still runs its forward and optimizer step, and moves nothing (with
    # these varied rewards and no turn cut, test_update_changes_the_solver_adapter_and_nothing_else moves it)
    monkeypatch.setattr(LowerLearner, "_epochs", real_epochs)
    c = replace(cfg, lower=replace(cfg.lower, mask_truncated=True))
    all_cut = [replace(t, cut=[True] * len(t.turn_spans)) for t in trajs]
    model = policies.model("solver")
    with restored(dict(model.named_parameters())) as before:
        out = LowerLearner(c, policies).update(all_cut, step=0).metrics
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert out["loss_tokens"] == 0 and out["grad_norm"] == 0 and out["optimizer_steps"] >= 1


@pytest.mark.slow
def test_train_refine_off_leaves_the_gradient_blind_to_refine_rewards(lower_setup, debug_policies):
    """lower.train_refine=false (the masked-refine control): two batches that differ only in the refines'
    rewards give the same gradient, turn 1's (turn_gamma 0: turn 1 is credited by its own reward); on, the
    refines train and the same change moves the gradient. The bonus and the KL loss stay on. The
    embedded model's episodes are updated on the debug base (the same tokenizer): the masking does
    not depend on what the model knows."""
    from tosca_mlmt.lower.learner import LowerLearner

    cfg, trajs = lower_setup
    policies = debug_policies
    model = policies.model("solver")
    params = {n: p for n, p in model.named_parameters() if ".solver." in n}
    finals = {"kept": lambda i: float(i % 2), "broke": lambda i: float(i % 3 == 0)}
    grads, tokens = {}, {}
    for train_refine in (False, True):
        lo = replace(cfg.lower, turn_gamma=0.0, kl_mode="loss", train_refine=train_refine,
                     minibatch_size=len(trajs), epochs=1, max_grad_norm=1e9)
        for name, final in finals.items():
            ts = [replace(t, turn_rewards=[float(i % 2), final(i)]) for i, t in enumerate(trajs)]
            with restored(params):
                out = LowerLearner(replace(cfg, lower=lo), policies).update(ts, step=0).metrics
                grads[train_refine, name] = {n: p.grad.clone() for n, p in params.items()}
            tokens[train_refine] = out["loss_tokens"]
    for n in params:
        torch.testing.assert_close(grads[False, "kept"][n], grads[False, "broke"][n], atol=0, rtol=0)
    assert any(g.abs().sum() > 0 for g in grads[False, "kept"].values())
    assert any(not torch.allclose(grads[True, "kept"][n], grads[True, "broke"][n]) for n in params)
    turn1 = sum(e - s for t in trajs for s, e in t.turn_spans[:1])
    assert tokens[False] == turn1 < tokens[True]


@pytest.mark.slow
@pytest.mark.parametrize("kl_mode, norm_std, warns", [("reward", True, True), ("loss", True, False),
                                                       ("reward", False, False)])
def test_learner_warns_about_kl_rewards_under_std_normalised_grpo(debug_setup, debug_policies, kl_mode, norm_std,
                                                                  warns):
    import warnings

    from tosca_mlmt.lower.learner import LowerLearner

    cfg, _ = debug_setup
    policies = debug_policies
    c = replace(cfg, lower=replace(cfg.lower, advantage="grpo", kl_coef=0.01, kl_mode=kl_mode, grpo_norm_std=norm_std))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        LowerLearner(c, policies)
    assert any("kl_mode=reward" in str(w.message) for w in caught) == warns


@pytest.mark.slow
def test_bf16_update_keeps_fp32_master_adapters_and_finite_losses(debug_cfg):
    """With bf16 base weights the LoRA adapter must stay fp32: an AdamW step of lr ~1e-5 on a
    bf16 weight of size ~1e-2 is below its rounding step and would be lost. On the debug base,
    sampled in bf16 too: the mechanics do not depend on what the model knows, and bf16 forwards
    of the embedded model cost minutes on CPUs that emulate bf16 matmuls."""
    from tosca_mlmt.lower.learner import LowerLearner

    cfg, policies = bf16_pair(debug_cfg)
    cfg, trajs = sampled_lower_setup(cfg, policies)
    trajs = [replace(t, turn_rewards=[float(i % 2), float((i + 1) % 2)]) for i, t in enumerate(trajs)]
    trainer = LowerLearner(cfg, policies)
    assert trainer.params and all(p.dtype == torch.float32 for p in trainer.params)
    assert all(p.dtype == torch.bfloat16 for n, p in policies.model("solver").named_parameters() if "lora_" not in n)
    before = [p.detach().clone() for p in trainer.params]
    metrics = trainer.update(trajs, step=0).metrics
    moved = sum(not torch.equal(a, p) for a, p in zip(before, trainer.params))
    assert moved > 0 and metrics["grad_norm"] > 0
    assert all(math.isfinite(v) for v in (metrics["policy_loss"], metrics["grad_norm"], metrics["kl"]))


@pytest.mark.slow
@pytest.mark.parametrize("advantage,logprob_temperature", [("gae", "raw"), ("grpo", "raw"), ("archer", "raw"),
                                                          ("grpo", "sampling")])
def test_update_changes_the_solver_adapter_and_nothing_else(lower_setup, debug_policies, advantage,
                                                            logprob_temperature):
    """On the debug base (the same tokenizer, so the embedded model's episodes are its ids too): which
    tensors an update moves does not depend on what the model knows."""
    from peft import set_peft_model_state_dict

    from tosca_mlmt.lower.learner import LowerLearner

    cfg, trajs = lower_setup
    policies = debug_policies
    # rewards must vary for group estimators to produce a gradient
    trajs = [replace(t, turn_rewards=[float(i % 2), float((i + 1) % 2)]) for i, t in enumerate(trajs)]
    cfg = replace(cfg, lower=replace(cfg.lower, advantage=advantage, logprob_temperature=logprob_temperature))
    model = policies.model("solver")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = LowerLearner(cfg, policies)
    vh_before = copy.deepcopy(trainer.value_head.state_dict())
    metrics = trainer.update(trajs, step=0).metrics
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed, "no parameter moved"
    assert all(".solver." in n and "lora_" in n for n in changed), sorted(changed)[:5]
    assert metrics["grad_norm"] > 0 and metrics["optimizer_steps"] >= 1
    # the engine/trainer mismatch compares raw log-probs only (the engines log raw ones)
    assert metrics["old_pass"] > 0 and ("engine_logprob_gap_mean" in metrics) == (logprob_temperature == "raw")
    vh_changed = any(not torch.equal(v, trainer.value_head.state_dict()[k]) for k, v in vh_before.items())
    assert vh_changed == (advantage == "gae")
    if advantage == "archer":  # the utterance critic learned, and its target followed by Polyak averaging
        assert metrics["critic_loss"] > 0
        assert not torch.equal(trainer.critic.q.weight, trainer.critic_target.q.weight)
    set_peft_model_state_dict(model, {k: v for k, v in policies.adapter_state("solver").items()}, adapter_name="solver")
    for n, p in model.named_parameters():  # restore for the next tests
        p.data.copy_(before[n])


@pytest.mark.slow
def test_behaviour_old_logprobs_feed_the_ratio_but_the_bonus_reads_one_policy(lower_setup, policies, monkeypatch):
    """lower.old_logprobs=behaviour: PPO's pi_old is the logged sampling log-probs, but the trainer-
    scored bonus compares log pi(y|x,z,g) and log pi(y|x,z) under the same weights: logged
    log-probs of another policy (here shifted by -0.7 nats a token) change no bonus term."""
    from tosca_mlmt.lower.learner import LowerLearner

    cfg, trajs = lower_setup
    trajs = [replace(t, turn_rewards=[float(i % 2), float((i + 1) % 2)]) for i, t in enumerate(trajs)]
    other = [replace(t, behaviour_logprobs=[[x - 0.7 for x in turn] for turn in t.behaviour_logprobs]) for t in trajs]
    seen = {}
    monkeypatch.setattr(LowerLearner, "_epochs", lambda self, batch, step: seen.update(batch=batch) or {})
    out = {}
    for mode, data in (("recompute", trajs), ("behaviour", other)):
        # KL off: nothing asserted here reads it, and off no reference pass runs
        lo = replace(cfg.lower, old_logprobs=mode, kl_coef=0.0, bonus=replace(cfg.lower.bonus, scorer="trainer"))
        trainer = LowerLearner(replace(cfg, lower=lo), policies)
        out[mode] = (trainer.update(data, step=0).refine_bonus, seen["batch"])
    (rows_r, batch_r), (rows_b, batch_b) = out["recompute"], out["behaviour"]
    assert rows_r and len(rows_r) == len(rows_b)
    for a, b in zip(rows_r, rows_b):
        assert a[:2] == b[:2] and a[2] == pytest.approx(b[2], abs=1e-5) and a[3] == pytest.approx(b[3], abs=1e-6)
    m = batch_b.tt.mask > 0
    assert torch.equal(batch_b.old_logprobs[m], batch_b.tt.behaviour_logprobs[m])  # the ratio's pi_old is logged
    assert (batch_r.old_logprobs[m] - batch_b.old_logprobs[m]).mean() == pytest.approx(0.7, abs=0.05)


@pytest.mark.slow
def test_grad_accum_gives_the_gradient_of_the_whole_minibatch(debug_cfg, debug_policies):
    """token-mean over micro-batches of unequal token counts (one row each, every row a different
    length) takes the same gradient as the minibatch in one forward (fp32): each micro-batch's mean
    is scaled by its share of the tokens. A mean of micro-batch means, 1/grad_accum each, would
    weigh a token of the shortest row several times one of the longest."""
    from tosca_mlmt.lower.learner import LowerLearner

    policies = debug_policies
    cfg, trajs = sampled_lower_setup(debug_cfg, policies)
    trajs = trajs[:4]
    for i in range(1, 4):  # the random model writes every turn to max_new_tokens: cut the refines unequally
        t = trajs[i]
        s, e = t.turn_spans[-1]
        k = min(e - s - 1, 5 * i)
        trajs[i] = replace(t, ids=t.ids[: e - k], turn_spans=[*t.turn_spans[:-1], (s, e - k)],
                           behaviour_logprobs=[*t.behaviour_logprobs[:-1], t.behaviour_logprobs[-1][: e - k - s]])
    tokens = [sum(e - s for s, e in t.turn_spans) for t in trajs]
    assert len(set(tokens)) == 4, tokens
    model = policies.model("solver")
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = {}
    for accum in (1, 4):
        lo = replace(cfg.lower, minibatch_size=4, grad_accum=accum, epochs=1, max_grad_norm=1e9, bonus=replace(
            cfg.lower.bonus, coef=0.0))
        with restored(params):
            trainer = LowerLearner(replace(cfg, lower=lo), policies)
            trainer.update(trajs, step=0)
            grads[accum] = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
            grads[accum]["value_head"] = trainer.value_head.weight.grad.clone()
    assert grads[1].keys() == grads[4].keys() and any(g.abs().sum() > 0 for g in grads[1].values())
    for n in grads[1]:
        assert torch.allclose(grads[1][n], grads[4][n], rtol=1e-4, atol=1e-7), n


@pytest.mark.slow
@pytest.mark.parametrize("kl_mode", ["reward", "loss"])
def test_zero_kl_coef_skips_the_reference_pass_and_changes_nothing(debug_cfg, debug_policies, monkeypatch, kl_mode):
    """With lower.kl_coef = 0 (and no SCoRe, no reference bonus) the adapters-off forward is
    not run, and the update is exactly the one a run that computed the reference gets: every
    KL term is weighted by 0."""
    from peft import set_peft_model_state_dict

    from tosca_mlmt.lower.learner import LowerLearner
    from tosca_mlmt.lower.scoring import SolverScorer

    policies = debug_policies
    cfg, trajs = sampled_lower_setup(debug_cfg, policies)
    cfg = replace(cfg, lower=replace(cfg.lower, kl_coef=0.0, kl_mode=kl_mode,
                                     bonus=replace(cfg.lower.bonus, model="policy")))
    state = copy.deepcopy(policies.adapter_state("solver"))
    reference_calls = []
    forward, score = SolverScorer.forward, SolverScorer.score

    def counting_forward(self, *args, reference=False, **kw):
        reference_calls.append(reference)
        return forward(self, *args, reference=reference, **kw)

    def score_with_reference(self, tt, trajs, values, features, **kw):  # what kl_coef > 0 would compute
        s = score(self, tt, trajs, values, features, **kw)
        return replace(s, ref_logprobs=self._sharded(tt, trajs, list(range(len(trajs))), reference=True)[0])

    monkeypatch.setattr(SolverScorer, "forward", counting_forward)
    runs = {}
    for name in ("skipped", "computed"):
        if name == "computed":
            monkeypatch.setattr(SolverScorer, "score", score_with_reference)
        reference_calls.clear()
        torch.manual_seed(0)  # the value head's init
        metrics = LowerLearner(cfg, policies).update(trajs, step=0).metrics
        runs[name] = (metrics, reference_calls.count(True), copy.deepcopy(policies.adapter_state("solver")))
        set_peft_model_state_dict(policies.model("solver"), state, adapter_name="solver")
    (m0, ref0, w0), (m1, ref1, w1) = runs["skipped"], runs["computed"]
    assert ref0 == 0, f"kl_coef = 0 still ran {ref0} reference forwards"
    assert ref1 > 0  # the comparison run really had reference log-probs
    for k in ("policy_loss", "value_loss", "grad_norm"):
        assert k in m0 and m0[k] == m1[k], f"{k}: {m0.get(k)} (skipped) != {m1.get(k)} (computed)"
    moved = max(float((w0[k] - state[k]).abs().max()) for k in state)
    assert moved > 0, "the update did not move the adapter: the weight comparison is vacuous"
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "skipping the reference pass changed the update"


def test_trainer_forwards_run_the_head_on_action_tokens_only_and_change_no_number(debug_cfg, debug_policies,
                                                                                    monkeypatch):
    """Every trainer forward of an update (pi_old with entropy, the reference, the refines with g cut
    out, the training forward) computes log-probs on the action tokens alone, and the update is the
    one a dense head over every position gives: no loss, KL, bonus or diagnostic reads a position
    outside the loss mask. fp32 on the random debug model."""
    from peft import set_peft_model_state_dict

    from tosca_mlmt.lower import scoring
    from tosca_mlmt.lower.learner import LowerLearner
    from tosca_mlmt.lower.scoring import SolverScorer

    policies = debug_policies
    cfg, trajs = sampled_lower_setup(debug_cfg, policies)  # kl_coef > 0 and the trainer-scored bonus: all four passes
    state = copy.deepcopy(policies.adapter_state("solver"))
    heads, forward, dense = [], SolverScorer.forward, scoring.token_logprobs_from_hidden

    def counting_head(hidden, head, ids, chunk, with_entropy=False, keep=None, temperature=1.0):
        heads.append((hidden.shape[0] * (hidden.shape[1] - 1), None if keep is None else int(keep[:, 1:].sum()),
                      torch.is_grad_enabled()))
        return dense(hidden, head, ids, chunk, with_entropy=with_entropy, keep=keep, temperature=temperature)

    def dense_forward(self, *args, keep=None, **kw):
        return forward(self, *args, **kw)

    monkeypatch.setattr(scoring, "token_logprobs_from_hidden", counting_head)
    runs = {}
    for name in ("kept", "dense"):
        if name == "dense":
            monkeypatch.setattr(SolverScorer, "forward", dense_forward)
        heads.clear()
        torch.manual_seed(0)  # the value head's init
        metrics = LowerLearner(cfg, policies).update(trajs, step=0).metrics
        runs[name] = (metrics, list(heads), copy.deepcopy(policies.adapter_state("solver")))
        set_peft_model_state_dict(policies.model("solver"), state, adapter_name="solver")
    (m0, h0, w0), (m1, h1, w1) = runs["kept"], runs["dense"]
    assert all(k is not None and 0 < k < n for n, k, _ in h0), h0  # every pass ran on part of its positions
    assert {g for *_, g in h0} == {False, True}  # no-grad scoring and the training forward both
    assert sum(k for _, k, _ in h0) < 0.5 * sum(n for n, _, _ in h1)
    for k in ("policy_loss", "kl", "bonus/mean", "entropy", "grad_norm", "approx_kl"):
        assert m0[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), (k, m0[k], m1[k])
    moved = max(float((w0[k] - state[k]).abs().max()) for k in state)
    assert moved > 0, "the update did not move the adapter: the comparison is vacuous"
    for k in w0:
        torch.testing.assert_close(w0[k], w1[k], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_auto_old_logprobs_skip_the_pass_only_where_pi_old_is_pi_theta(debug_cfg, debug_policies, monkeypatch):
    """lower.old_logprobs=auto on a batch that is one optimizer step and has no reader of pi_old
    before the update (no bonus on refines, values or reference): no scoring forward runs, and the
    update is bit-for-bit the one recompute makes, entropy diagnostic included. With two
    minibatches the second step's pi_old is not the current weights, so the pass runs (on the
    second minibatch's rows: test_auto_old_logprobs_skip_the_first_minibatchs_rows_only)."""
    from peft import set_peft_model_state_dict

    from tosca_mlmt.lower.learner import LowerLearner
    from tosca_mlmt.lower.scoring import SolverScorer

    policies = debug_policies
    cfg, trajs = sampled_lower_setup(debug_cfg, policies)
    # the random debug model is never right: reward alternate samples so GRPO has a signal
    trajs = [replace(t, turn_rewards=[float(i % 2)] * len(t.turn_rewards)) for i, t in enumerate(trajs)]
    lo = replace(cfg.lower, kl_coef=0.0, advantage="grpo", minibatch_size=len(trajs),
                 bonus=replace(cfg.lower.bonus, coef=0.0))
    state = copy.deepcopy(policies.adapter_state("solver"))
    grad_modes, forward = [], SolverScorer.forward

    def counting_forward(self, *args, **kw):
        grad_modes.append(torch.is_grad_enabled())
        return forward(self, *args, **kw)

    monkeypatch.setattr(SolverScorer, "forward", counting_forward)
    runs = {}
    for mode, mb in (("auto", len(trajs)), ("recompute", len(trajs)), ("auto-two-steps", len(trajs) // 2)):
        grad_modes.clear()
        learner = LowerLearner(replace(cfg, lower=replace(lo, old_logprobs=mode.split("-")[0], minibatch_size=mb)),
                               policies)
        upd = learner.update(trajs, step=0)
        runs[mode] = (upd.metrics, grad_modes.count(False), upd.skipped_old,
                      copy.deepcopy(policies.adapter_state("solver")))
        set_peft_model_state_dict(policies.model("solver"), state, adapter_name="solver")
    (m0, nograd0, skipped0, w0), (m1, nograd1, skipped1, w1) = runs["auto"], runs["recompute"]
    assert skipped0 and nograd0 == 0, f"auto ran {nograd0} scoring forwards"
    assert not skipped1 and nograd1 > 0
    assert runs["auto-two-steps"][2] is False and runs["auto-two-steps"][1] > 0
    assert runs["auto-two-steps"][0]["old_pass"] == 0.5 and m0["old_pass"] == 0.0 and m1["old_pass"] == 1.0
    moved = max(float((w0[k] - state[k]).abs().max()) for k in state)
    assert moved > 0, "the update did not move the adapter: the weight comparison is vacuous"
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "skipping the pi_old pass changed the update"
    assert m0["policy_loss"] == m1["policy_loss"] and m0["ratio_mean"] == 1.0
    assert m0["entropy"] == pytest.approx(m1["entropy"], rel=1e-5) and m0["entropy"] > 0


@pytest.mark.slow
def test_auto_old_logprobs_skip_the_first_minibatchs_rows_only(debug_cfg, debug_policies, monkeypatch):
    """With one epoch of two minibatches the first one's loss forward runs with the weights that
    sampled, so lower.old_logprobs=auto scores pi_old on the second minibatch's rows alone (the
    reference, for the KL loss, on all). The update matches recompute's up to the fp32 noise of
    recompute's own pi_old forward on the first rows (there its ratio is ~1, here exactly 1), and
    the second step reads the very pi_old recompute scored. Skipping the second minibatch's rows
    instead (pi_old taken after the first step) lands measurably elsewhere: the check can fail."""
    policies = debug_policies
    with restored(dict(policies.model("solver").named_parameters())):  # other tests start from the untrained adapter
        _first_minibatch_skip(debug_cfg, policies, monkeypatch)


def _first_minibatch_skip(debug_cfg, policies, monkeypatch):
    from peft import set_peft_model_state_dict

    from tosca_mlmt.algos.losses import kl_estimate
    from tosca_mlmt.lower.learner import LowerLearner
    from tosca_mlmt.lower.scoring import SolverScorer
    from tosca_mlmt.seeds import stream
    from tosca_mlmt.tensors import masked_mean

    cfg, trajs = sampled_lower_setup(debug_cfg, policies)
    trajs = [replace(t, turn_rewards=[float(i % 2)] * len(t.turn_rewards)) for i, t in enumerate(trajs)]
    n, half = len(trajs), len(trajs) // 2
    lo = replace(cfg.lower, kl_coef=0.05, kl_mode="loss", advantage="grpo", minibatch_size=half, lr=2e-2,
                 bonus=replace(cfg.lower.bonus, coef=0.0))
    # a trained-looking adapter (LoRA B off 0), so pi_old differs from the reference and the KL is not 0
    gen = torch.Generator().manual_seed(0)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if "lora_B" in k else v.clone()
             for k, v in policies.adapter_state("solver").items()}
    set_peft_model_state_dict(policies.model("solver"), state, adapter_name="solver")
    scored, batches = [], []  # rows of each no-grad pi_old forward; the UpdateBatch each run's epochs read
    forward, epochs = SolverScorer.forward, LowerLearner._epochs

    def counting_forward(self, ids, *args, reference=False, **kw):
        if not torch.is_grad_enabled() and not reference:
            scored.append(ids.shape[0])
        return forward(self, ids, *args, reference=reference, **kw)

    def keeping_epochs(self, batch, step):
        batches.append(batch)
        return epochs(self, batch, step)

    monkeypatch.setattr(SolverScorer, "forward", counting_forward)
    monkeypatch.setattr(LowerLearner, "_epochs", keeping_epochs)
    first = sorted(int(i) for i in stream(cfg.seed, "minibatch", 0, 0).permutation(n)[:half])
    second = sorted(set(range(n)) - set(first))
    runs = {}
    for mode in ("auto", "recompute", "wrong-rows"):
        scored.clear()
        learner = LowerLearner(replace(cfg, lower=replace(lo, old_logprobs=mode.replace("wrong-rows", "auto"))),
                               policies)
        if mode == "wrong-rows":
            monkeypatch.setattr(learner, "current_rows", lambda *a: second)
        metrics = learner.update(trajs, step=0).metrics
        runs[mode] = (metrics, sum(scored), copy.deepcopy(policies.adapter_state("solver")))
        set_peft_model_state_dict(policies.model("solver"), state, adapter_name="solver")
    (ma, rows_a, wa), (mr, rows_r, wr), (_, _, ww) = runs["auto"], runs["recompute"], runs["wrong-rows"]
    auto, recompute = batches[0], batches[1]
    assert rows_a == n - half and rows_r == n, (rows_a, rows_r)
    assert ma["old_pass"] == 0.5 and mr["old_pass"] == 1.0
    assert auto.old_current.tolist() == [i in first for i in range(n)]
    m = auto.tt.mask
    assert float(auto.old_logprobs[first].abs().sum()) == 0.0  # never read: the loss takes pi_theta there
    torch.testing.assert_close(auto.old_logprobs[second] * m[second], recompute.old_logprobs[second] * m[second],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(auto.ref_logprobs, recompute.ref_logprobs, rtol=1e-5, atol=1e-5)
    # the pre-update KL diagnostic is over the scored rows: recompute's KL on the second minibatch
    tm = to_tensors(trajs, learner.pad_id).mask[second]
    kl = kl_estimate(recompute.old_logprobs[second], recompute.ref_logprobs[second], lo.kl_estimator)
    assert ma["kl"] == pytest.approx(float(masked_mean(kl, tm)), rel=1e-4, abs=1e-7) and ma["kl"] != mr["kl"]
    # so is the engine/trainer mismatch: the sampler's log-probs against pi_old where it was scored
    # (the adapter was moved after sampling, so the two differ)
    gap = (recompute.old_logprobs[second] - auto.tt.behaviour_logprobs[second])[tm > 0].abs()
    assert ma["engine_logprob_gap_mean"] == pytest.approx(float(gap.mean()), rel=1e-4) and float(gap.mean()) > 1e-4
    assert ma["engine_logprob_gap_max"] == pytest.approx(float(gap.max()), rel=1e-4)
    moved = max(float((wa[k] - state[k]).abs().max()) for k in state)
    assert moved > 0, "the update did not move the adapter: the comparison is vacuous"
    gap = max(float((wa[k] - wr[k]).abs().max()) for k in wa)
    wrong = max(float((ww[k] - wr[k]).abs().max()) for k in wa)
    assert gap < 1e-2 * moved and wrong > 10 * max(gap, 1e-7), (gap, wrong, moved)


@pytest.mark.slow
def test_engine_scored_bonus_equals_the_trainer_scored_one_with_no_forward_before_the_update(
        lower_setup, policies, monkeypatch):
    """lower.bonus.scorer=engine: log pi(y | x, z, g) is the engine's sampling log-prob and
    log pi(y | x, z) the engine's teacher-forced score, so with one optimizer step per batch and
    old_logprobs=auto no no-grad trainer forward runs at all, and every refine's bonus term equals
    the trainer-scored one (fp32, HF engine: its generate and its score read the same weights).
    auto, the default, keeps the trainer on an HF engine (its scoring would be the same forward
    again): the very update the trainer makes."""
    from peft import set_peft_model_state_dict

    from tosca_mlmt.lower.learner import LowerLearner
    from tosca_mlmt.lower.scoring import SolverScorer
    from tosca_mlmt.rollout.engines.hf import HFEngine

    cfg, trajs = lower_setup
    # ungated and summed: the raw two-log-prob quantity, whatever the rewards; kl 0 so no reference pass
    lo = replace(cfg.lower, kl_coef=0.0, advantage="grpo", old_logprobs="auto", minibatch_size=len(trajs),
                 bonus=replace(cfg.lower.bonus, gate="none", reduce="sum", clip=100.0))
    state = copy.deepcopy(policies.adapter_state("solver"))
    nograd, forward = [], SolverScorer.forward

    def counting_forward(self, *args, **kw):
        nograd.append(not torch.is_grad_enabled())
        return forward(self, *args, **kw)

    monkeypatch.setattr(SolverScorer, "forward", counting_forward)
    engine, runs = HFEngine(policies, 8), {}
    for scorer in ("trainer", "auto", "engine"):
        nograd.clear()
        learner = LowerLearner(replace(cfg, lower=replace(lo, bonus=replace(lo.bonus, scorer=scorer))), policies)
        upd = learner.update(trajs, step=0, engine=engine)
        runs[scorer] = (upd.metrics, sum(nograd), upd.refine_bonus, copy.deepcopy(policies.adapter_state("solver")))
        set_peft_model_state_dict(policies.model("solver"), state, adapter_name="solver")
    (mt, nt, bt, wt), (me, ne, be, we), (ma, na, ba, wa) = runs["trainer"], runs["engine"], runs["auto"]
    assert nt >= 2 and mt["old_pass"] == 1.0  # pi_old and the no-feedback forward
    assert (mt["bonus/engine_scored"], me["bonus/engine_scored"], ma["bonus/engine_scored"]) == (0.0, 1.0, 0.0)
    assert na == nt and ba == bt and all(torch.equal(wa[k], wt[k]) for k in wt), "auto on HF is not the trainer"
    assert ne == 0 and me["old_pass"] == 0.0, f"engine scoring still ran {ne} trainer forwards"
    assert len(bt) == len(be) >= 4 and [r[:2] for r in bt] == [r[:2] for r in be]
    raw_t, raw_e = torch.tensor([r[2] for r in bt]), torch.tensor([r[2] for r in be])
    assert raw_t.abs().max() > 0.1, "the feedback changes nothing: the comparison is vacuous"
    torch.testing.assert_close(raw_e, raw_t, atol=2e-3, rtol=1e-4)  # a sum of ~30 terms each ~1e-5 apart
    assert max(float((we[k] - state[k]).abs().max()) for k in state) > 0, "the engine-scored update did not train"


def test_sampling_logprob_temperature_scores_the_distribution_the_batch_was_drawn_from(debug_cfg, debug_policies):
    """lower.logprob_temperature=sampling: every forward of the learner (pi_theta, pi_old, the bonus's
    no-feedback refines) reads log softmax(logits / T) at solver_sampling.temperature, computed here
    from the model's full logits; raw reads T = 1. The auto bonus scorer then stays off the engine."""
    from types import SimpleNamespace

    from tosca_mlmt.lower.learner import LowerLearner

    policies = debug_policies
    cfg, trajs = sampled_lower_setup(debug_cfg, policies)
    tt = to_tensors(trajs, policies.tokenizer("solver").pad_token_id or 0)
    model = policies.model("solver")
    with torch.no_grad(), policies.use("solver"):
        logits = model(input_ids=tt.input_ids, attention_mask=tt.attention_mask).logits.float()
    vllm = SimpleNamespace(name="vllm")
    for mode, T in (("raw", 1.0), ("sampling", 0.5)):
        c = replace(cfg, solver_sampling=replace(cfg.solver_sampling, temperature=0.5),
                    lower=replace(cfg.lower, logprob_temperature=mode, autocast="none"))
        learner = LowerLearner(c, policies)
        with torch.no_grad(), policies.use("solver"):
            got = learner.scorer.forward(tt.input_ids, tt.attention_mask, keep=tt.mask).logprobs
        want = torch.log_softmax(logits[:, :-1] / T, -1).gather(-1, tt.input_ids[:, 1:, None])[..., 0]
        m = tt.mask[:, 1:] > 0
        assert torch.allclose(got[:, 1:][m], want[m], atol=1e-4), mode
        assert learner.engine_scores_bonus(vllm) == (mode == "raw")
        learner.close()
    # the two differ: a test of T would pass with T ignored otherwise
    raw = torch.log_softmax(logits[:, :-1], -1).gather(-1, tt.input_ids[:, 1:, None])[..., 0]
    assert (raw[m] - want[m]).abs().max() > 0.05
