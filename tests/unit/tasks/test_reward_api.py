"""Issue 67 point 8: the multi-turn, batched task.reward API (tosca_mlmt/tasks/reward.py).

A reward function may take a RewardContext (which attempt, which round, the attempt before and the
feedback it answered), may be batched (one call per batch of turns the rollout scores together, in
the batched runner and under continuous episodes) and may log extra metrics, which every stage's
summary averages as ``reward/<name>``. The two-argument form keeps working. The episodes are played
on a scripted engine (fixed replies, numbered per call) over the tiny random model's tokenizer, so no
decoding runs; the reward functions live here and are named ``test_reward_api:<fn>`` where a config
needs them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from tosca_mlmt.rollout.engines.base import Generation
from tosca_mlmt.rollout.runner import EpisodeRunner
from tosca_mlmt.tasks.arith import ArithTask
from tosca_mlmt.tasks.base import Problem
from tosca_mlmt.tasks.reward import RewardContext, RewardFunctionWarning, RewardHook, batched

REPO = Path(__file__).resolve().parents[3]
CALLS: list = []  # what the reward functions below were called with, in order


@pytest.fixture(autouse=True)
def _fresh_calls():
    CALLS.clear()


# ---------------------------------------------------------------- reward functions, as a user writes them

def plain_reward(problem, response):
    CALLS.append((problem.id, response))
    return 0.25


def context_reward(problem, response, context):
    """Scores the attempt number, so a recorded reward says which context the turn was scored with."""
    CALLS.append((problem.id, response, replace(context, metrics={})))
    return 0.1 * context.turn


@batched
def batch_reward(problems, responses, contexts):
    CALLS.append((list(problems), list(responses), [replace(c, metrics={}) for c in contexts]))
    return [0.1 * c.turn + 0.01 * len(r) for r, c in zip(responses, contexts)]


@batched
def refine_breaks(problems, responses, contexts):
    """A batched reward whose service fails on every refine batch."""
    CALLS.append([c.kind for c in contexts])
    if any(c.kind == "refine" for c in contexts):
        raise ConnectionError("reward service unreachable")
    return [1.0] * len(problems)


def metric_reward(problem, response, context):
    """Logs two metrics; the second sample's refines then fail, so what they logged must not count."""
    context.log_metric("turn", context.turn)
    context.log_metric("chars", len(response))
    if context.kind == "refine" and context.sample == 1:
        raise RuntimeError("bug on refines of sample 1")
    return 0.5


# ---------------------------------------------------------------- a scripted engine

class TurnEngine:
    """Replies without decoding: the k-th solver call's i-th prompt gets "The answer is: <100 k + i>",
    the writer "Feedback <k>-<i>.", so every turn's text is its own. With ``continuous`` it also serves
    rollout/continuous.py, finishing at most ``per_step`` requests per step, and records per step the
    solver turns (solve, refine) it finished."""

    name = "scripted"

    def __init__(self, policies, continuous: bool = False, per_step: int = 3):
        self.policies, self.continuous, self.per_step = policies, continuous, per_step
        self.calls = {"solver": 0, "writer": 0}
        self.queue: list = []
        self.solver_turns_per_step: list[int] = []

    def _reply(self, policy: str, k: int, i: int) -> Generation:
        text = f"The answer is: {100 * k + i}\n" if policy == "solver" else f"Feedback {k}-{i}."
        ids = self.policies.tokenizer(policy).encode(text) + [self.policies.eos_ids(policy)[0]]
        return Generation(tuple(ids), (-0.5,) * len(ids), "stop")

    def generate(self, prompts, params, policy):
        k = self.calls[policy]
        self.calls[policy] += 1
        return [[self._reply(policy, k, i * params.n + j) for j in range(params.n)] for i in range(len(prompts))]

    # ---- the streaming interface of rollout/continuous.py
    def mixes_roles(self) -> bool:
        return True

    def open_stream(self, roles) -> None:
        self.queue = []

    def submit(self, tag, prompt, params, policy) -> None:
        self.queue.append((tag, policy))

    @property
    def streaming(self) -> bool:
        return bool(self.queue)

    def step(self):
        done, self.queue = self.queue[:self.per_step], self.queue[self.per_step:]
        self.solver_turns_per_step.append(sum(tag[0] in ("solve", "refine") for tag, _ in done))
        out = []
        for tag, policy in done:
            out.append((tag, self._reply(policy, self.calls[policy], 0)))
            self.calls[policy] += 1
        return out

    def abort_stream(self) -> None:
        self.queue = []


def _play(cfg, policies, fn, spec="test:fn", *, rounds=2, n=2, problems=2, counterfactual=False, continuous=False):
    cfg = replace(cfg, episode=replace(cfg.episode, rounds=rounds, n_samples=n, counterfactual=counterfactual))
    task = RewardHook(ArithTask(1), fn, spec)
    engine = TurnEngine(policies, continuous=continuous)
    runner = EpisodeRunner(cfg, task, engine, policies)
    return runner.run(task.load("train", problems).problems), task, engine


def _expected_context(ep, turn):
    """What a reward function must be told about ``turn``, read off the episode's recorded turns."""
    before = ep.turns[:turn.index]
    prev = [t for t in before if t.role == "solver"]
    fb = before[-1] if turn.kind == "refine" else None
    return RewardContext(turn=turn.round + 1, round=turn.round, kind=turn.kind,
                         previous_response=prev[-1].text if prev else None,
                         previous_reward=prev[-1].reward if prev else None,
                         previous_correct=prev[-1].correct if prev else None,
                         feedback=fb.text if fb else None, strategy=fb.strategy_name if fb else None,
                         episode_id=ep.episode_id, sample=ep.sample)


# ---------------------------------------------------------------- the context

def test_the_context_carries_each_turn_s_place_turn_round_and_feedback(debug_cfg, debug_policies):
    episodes, task, _ = _play(debug_cfg, debug_policies, context_reward, rounds=2, counterfactual=True)
    seen = {(ctx.episode_id, ctx.kind, ctx.round): (pid, response, ctx) for pid, response, ctx in CALLS}
    assert len(seen) == len(CALLS) == 4 * 5  # 4 episodes x (solve, 2 refines, 2 counterfactuals)
    for ep in episodes:
        assert [t.kind for t in ep.turns] == ["solve", "feedback", "refine", "feedback", "refine"]
        for t in ep.solver_turns:
            pid, response, ctx = seen[(ep.episode_id, t.kind, t.round)]
            assert (pid, response) == (ep.problem.id, t.text)
            assert ctx == _expected_context(ep, t)
            assert t.reward == pytest.approx(0.1 * (t.round + 1))  # scored with this context
        for t in ep.turns[2::2]:  # each refine's g-less twin: the refine's place, without its feedback
            _, _, ctx = seen[(ep.episode_id, "counterfactual", t.round)]
            assert ctx == replace(_expected_context(ep, t), kind="counterfactual", feedback=None, strategy=None)
            assert t.info["counterfactual_reward"] == pytest.approx(0.1 * (t.round + 1))
    refines = [ctx for _, _, ctx in CALLS if ctx.kind == "refine"]
    assert {ctx.turn for ctx in refines} == {2, 3} and all(ctx.feedback for ctx in refines)
    assert (task.calls, task.errors) == (20, 0)


def test_the_two_argument_form_still_scores_every_turn(debug_cfg, debug_policies):
    episodes, task, _ = _play(debug_cfg, debug_policies, plain_reward, rounds=1)
    turns = [(ep.problem.id, t.text) for ep in episodes for t in ep.solver_turns]
    assert sorted(CALLS) == sorted(turns) and task.form is None
    assert all(t.reward == 0.25 and not t.correct for ep in episodes for t in ep.solver_turns)
    assert task.verify(episodes[0].problem, "The answer is: 3").reward == 0.25  # a bare call, as before


@pytest.mark.parametrize("fn, form", [
    (lambda p, r, context=None: context.turn, "keyword"),  # by name, even with a default
    (lambda p, r, ctx: ctx.turn, "positional"),  # a third positional parameter without a default
    (lambda p, r, **kw: kw["context"].turn, "keyword"),
    (lambda p, r, scale=3.0: scale, None),  # a defaulted third parameter is not the context
])
def test_the_call_form_is_read_from_the_signature_once(fn, form, monkeypatch):
    task = RewardHook(ArithTask(1), fn, "m:f")
    monkeypatch.setattr(inspect, "signature", lambda *a, **k: pytest.fail("inspected per call"))
    p = ArithTask(1).load("train", 1).problems[0]
    v = task.verify_batch([p, p], ["a", "b"], [RewardContext(turn=1), RewardContext(turn=2, round=1, kind="refine")])
    assert task.form == form
    assert [x.reward for x in v] == ([3.0, 3.0] if form is None else [1.0, 2.0])
    assert task.verify(p, "a").reward == (3.0 if form is None else 1.0)  # a bare call: a first attempt


# ---------------------------------------------------------------- the batched form

@pytest.mark.parametrize("continuous", [False, True])
def test_a_batched_reward_runs_once_per_batch_of_turns(debug_cfg, debug_policies, continuous):
    """Batched turns: one call per turn of the batch (4 episodes each). Continuous episodes: one call
    per engine step that finished solver turns, with exactly those turns."""
    episodes, task, engine = _play(debug_cfg, debug_policies, batch_reward, rounds=2, continuous=continuous)
    sizes = [len(problems) for problems, _, _ in CALLS]
    if continuous:
        assert sizes == [k for k in engine.solver_turns_per_step if k] and max(sizes) > 1
    else:
        assert sizes == [4, 4, 4]
        assert [{c.kind for c in ctxs} for _, _, ctxs in CALLS] == [{"solve"}, {"refine"}, {"refine"}]
    by_turn = {(c.episode_id, c.kind, c.round): (p, r, c) for ps, rs, cs in CALLS for p, r, c in zip(ps, rs, cs)}
    assert len(by_turn) == 12  # every solver turn scored exactly once
    for ep in episodes:
        for t in ep.solver_turns:
            p, r, c = by_turn[(ep.episode_id, t.kind, t.round)]
            assert (p.id, r) == (ep.problem.id, t.text) and c == _expected_context(ep, t)
            assert t.reward == pytest.approx(0.1 * (t.round + 1) + 0.01 * len(t.text))
    assert (task.calls, task.errors) == (12, 0)


def test_a_failing_batched_call_scores_its_whole_batch_zero_and_counts_each_turn(debug_cfg, debug_policies):
    with pytest.warns(RewardFunctionWarning, match="reward service unreachable"):
        episodes, task, _ = _play(debug_cfg, debug_policies, refine_breaks, rounds=1)
    assert CALLS == [["solve"] * 4, ["refine"] * 4]
    for ep in episodes:
        solve, refine = ep.solver_turns
        assert solve.reward == 1.0 and "reward_error" not in solve.info
        assert (refine.reward, refine.correct) == (0.0, False)
        assert "ConnectionError: reward service unreachable" in refine.info["reward_error"]
    assert (task.calls, task.errors) == (8, 4)


def _problems(n=3):
    return ArithTask(1).load("train", n).problems


@pytest.mark.parametrize("returns, why", [
    (lambda ps: [1.0] * (len(ps) - 1), "returned 2 results for a batch of 3"),
    (lambda ps: 1.0, "TypeError"),  # not a list
])
def test_a_batched_result_of_the_wrong_shape_fails_the_batch(returns, why):
    task = RewardHook(ArithTask(1), batched(lambda ps, rs: returns(ps)), "m:f")
    with pytest.warns(RewardFunctionWarning):
        vs = task.verify_batch(_problems(), ["a", "b", "c"], [RewardContext() for _ in range(3)])
    assert [v.reward for v in vs] == [0.0] * 3 and all(why in v.info["reward_error"] for v in vs)
    assert (task.calls, task.errors) == (3, 3)


def test_one_bad_item_of_a_batch_fails_that_turn_only():
    task = RewardHook(ArithTask(1), batched(lambda ps, rs: [1.0, None, 0.5]), "m:f")
    with pytest.warns(RewardFunctionWarning, match="returned None"):
        vs = task.verify_batch(_problems(), ["a", "b", "c"], [RewardContext() for _ in range(3)])
    assert [(v.reward, v.correct, "reward_error" in v.info) for v in vs] == [(1.0, True, False), (0.0, False, True),
                                                                             (0.5, False, False)]
    assert (task.calls, task.errors) == (3, 1)


def test_a_batched_function_keeps_its_fingerprint_in_the_verifier_version():
    source_hash = hashlib.sha256(inspect.getsource(batch_reward).encode()).hexdigest()[:12]
    task = RewardHook(ArithTask(1), batch_reward, "test_reward_api:batch_reward")
    assert task.batched and task.verifier_version == f"{ArithTask(1).verifier_version}+reward:" \
                                                     f"test_reward_api:batch_reward@{source_hash}"
    assert RewardHook(ArithTask(1), refine_breaks, "m:f").verifier_version.rsplit("@", 1)[1] != source_hash


# ---------------------------------------------------------------- extra metrics

def test_log_metric_records_on_the_turn_and_a_bad_value_is_a_reward_error():
    def fn(p, r, context):
        context.log_metric("length", len(r))
        if r == "nan":
            context.log_metric("bad", float("nan"))
        return 1.0

    task = RewardHook(ArithTask(1), fn, "m:f")
    p = _problems(1)[0]
    assert task.verify(p, "abc").info["reward_metrics"] == {"length": 3.0}
    with pytest.warns(RewardFunctionWarning, match="'bad'.*not a finite number"):
        v = task.verify(p, "nan")
    assert v.reward == 0.0 and "reward_metrics" not in v.info  # a failed turn logged nothing
    with pytest.raises(ValueError, match="without spaces"):
        RewardContext().log_metric("two words", 1.0)


def test_extra_metrics_are_averaged_into_collect_s_metrics_record(debug_cfg, debug_policies, tmp_path):
    from tosca_mlmt.analysis.glossary import undocumented
    from tosca_mlmt.pipelines.collect import collect
    from tosca_mlmt.store import load_snapshot

    cfg = replace(debug_cfg, task=replace(debug_cfg.task, reward="test_reward_api:metric_reward"),
                  episode=replace(debug_cfg.episode, rounds=2, n_samples=2),
                  engine=replace(debug_cfg.engine, name="hf"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the failing refines are warned about; counted below
        res = collect(cfg, tmp_path / "snaps", policies=debug_policies, engine=TurnEngine(debug_policies),
                      problems=ArithTask(1).load("train", 2).problems, log_dir=str(tmp_path / "logs"))
    turns = [t for ep in load_snapshot(tmp_path / "snaps", res.snapshot_id).episodes() for t in ep.solver_turns]
    ok = [t for t in turns if "reward_error" not in t.info]
    assert len(turns) == 12 and len(ok) == 8  # sample 1's two refines on each problem failed
    want = {"collect/reward/turn": sum(t.round + 1 for t in ok) / len(ok),
            "collect/reward/chars": sum(len(t.text) for t in ok) / len(ok)}
    assert want["collect/reward/turn"] == pytest.approx(1.75)  # (4 x 1 + 2 x 2 + 2 x 3) / 8; 2 over all 12 turns
    rec = json.loads((tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {k: rec[k] for k in want} == pytest.approx(want)
    assert rec["collect/reward_errors"] == 4 and undocumented(rec) == []


# ---------------------------------------------------------------- the example's reward

def _example():
    spec = importlib.util.spec_from_file_location("multiturn_reward", REPO / "examples/multiturn_reward/reward.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_example_reward_credits_turn_one_and_penalises_a_broken_right_answer():
    ex = _example()
    p = Problem("arith", "arith-1", "What is 2 + 3?", "5", "train")
    refine = dict(turn=2, round=1, kind="refine", feedback="Check it.")
    cases = [("The answer is: 5", RewardContext(), 1.0), ("The answer is: 4", RewardContext(), ex.FORMAT_CREDIT),
             ("no idea", RewardContext(), 0.0),
             ("The answer is: 4", RewardContext(previous_correct=True, **refine), ex.BROKE_RIGHT),
             ("The answer is: 4", RewardContext(previous_correct=False, **refine), 0.0),
             ("The answer is: 5", RewardContext(previous_correct=False, **refine), 1.0)]
    assert [ex.score(p, r, c) for r, c, _ in cases] == [want for _, _, want in cases]
    contexts = [c for _, c, _ in cases]
    assert ex.score_batch([p] * 6, [r for r, _, _ in cases], contexts) == [want for _, _, want in cases]
    assert contexts[3].metrics == {"answered": 1.0, "broke_right": 1.0, "distinct_answers": 0.5}  # 5, 4, None
    task = RewardHook(ArithTask(1), ex.score_batch, "examples/multiturn_reward/reward.py:score_batch")
    assert task.batched and task.form == "keyword" and RewardHook(ArithTask(1), ex.score, "x:y").form == "keyword"
