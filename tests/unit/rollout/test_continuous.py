"""Continuous episodes (rollout/continuous.py) against batched turns, on one vLLM engine.

The same EpisodeRunner plays the same problems twice on the same engine, once with
``engine.vllm.continuous_episodes`` (every episode's next turn joins the running vLLM batch as its
last turn ends) and once with one batched call per turn. In fp32 the two must record the same
episodes: every turn's prompt and response ids, finish reason, reward, strategy, pi_b, Q-values,
feedback span and state length, log-probs within 1e-4, the counterfactual refines' rewards and the
progress callback's counts. The test also checks that the continuous run really was continuous (no
per-turn generate call, and a writer request entered the batch while turn-1 requests still
decoded), that greedy turn 1 hands one decode to all samples, that two different merged policies
fall back to batched turns unless no writer model writes (fixed feedback), and that a run that fails
midway leaves nothing in flight. With ``engine.vllm.serve_adapters`` (a LoRA request per role) two
trained adapters share the batch.

The embedded model, so that turn lengths differ as in real collects (a tiny random model decodes
every turn to its limit, and the turns would end together). Skipped when vLLM cannot be imported or
the embedded model is unavailable; two engine start-ups, 2-4 minutes on a 2-core CPU.
"""

from __future__ import annotations

import contextlib
import os

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from conftest import FP32, VLLM_MARKS, perturbed_lora_b, vllm_session  # noqa: E402
from tosca_mlmt.rollout import continuous  # noqa: E402
from tosca_mlmt.rollout.runner import EpisodeRunner  # noqa: E402
from tosca_mlmt.tasks import make_task  # noqa: E402

pytestmark = VLLM_MARKS

LOGPROB_TOL = 1e-4  # fp32; the two schedules put different requests in a step


def _overrides(**extra) -> dict:
    return {**FP32, "engine.name": "vllm", "engine.vllm.kv_cache_gb": 1, "engine.vllm.max_model_len": 1024,
            "episode.max_prompt_tokens": 768, "logging.wandb": False, "logging.progress": False,
            "task.name": "arith", "task.level": 1, "episode.n_samples": 2, "episode.rounds": 2,
            "episode.counterfactual": True, "episode.min_q_decisions": 0,  # Q(s, .) steers, per micro-batch
            "solver_sampling.max_new_tokens": 48, "episode.max_feedback_tokens": 24, **extra}


@pytest.fixture(scope="module")
def env():
    """(cfg, PolicyPair, VLLMEngine); the writer has a Q head of random weights, so that pi_b is not
    uniform and the strategies depend on Q(s, .) computed per micro-batch of finished attempts."""
    import torch

    from tosca_mlmt.models.q_head import QHead

    with vllm_session(_overrides()) as (cfg, policies, engine):
        hidden = policies.model("writer").get_base_model().config.hidden_size
        policies.q_head = QHead(hidden, len(cfg.episode.strategies))
        with torch.no_grad():
            policies.q_head.proj.weight.copy_(0.05 * torch.randn(policies.q_head.proj.weight.shape,
                                                                  generator=torch.Generator().manual_seed(0)))
        yield cfg, policies, engine


class Spy:
    """Records, at each submitted request, which kinds of request were in flight, and the progress
    callback's counts; fails any per-turn generate call while the run is meant to be continuous."""

    def __init__(self, engine, monkeypatch, continuous_run: bool):
        self.engine, self.overlaps, self.turns, self.in_flight = engine, [], {}, {}
        submit, step = engine.submit, engine.step

        def spy_submit(tag, prompt, params, policy):
            self.overlaps.append((tag[0], sorted(set(self.in_flight.values()))))
            submit(tag, prompt, params, policy)
            self.in_flight[id(tag)] = tag[0]  # by identity: a counterfactual's tag holds a Turn, not hashable

        def spy_step():
            done = step()
            for tag, _ in done:
                self.in_flight.pop(id(tag), None)
            return done

        monkeypatch.setattr(engine, "submit", spy_submit)
        monkeypatch.setattr(engine, "step", spy_step)
        if continuous_run:
            monkeypatch.setattr(engine, "generate", lambda *a, **k: pytest.fail("a batched generate call"))

    def on_turn(self, kind: str, k: int) -> None:
        self.turns[kind] = self.turns.get(kind, 0) + k


def _play(cfg, policies, engine, problems, monkeypatch, on: bool, task=None):
    """(episodes, Spy) of one run with continuous episodes on or off."""
    with monkeypatch.context() as mp:
        mp.setattr(engine, "continuous", on)
        spy = Spy(engine, mp, on)
        runner = EpisodeRunner(cfg, task or make_task(cfg.task), engine, policies, on_turn=spy.on_turn)
        assert continuous.applies(runner) == on
        episodes = runner.run(problems, batch_index=3)
        return episodes, spy, runner


def _assert_same(a, b) -> None:
    assert [e.episode_id for e in a] == [e.episode_id for e in b]
    for ea, eb in zip(a, b):
        assert len(ea.turns) == len(eb.turns)
        for ta, tb in zip(ea.turns, eb.turns):
            where = f"{ea.episode_id} turn {ta.index} ({ta.kind})"
            assert ta.prompt_ids == tb.prompt_ids, where
            assert ta.response_ids == tb.response_ids, where
            for f in ("finish_reason", "reward", "correct", "strategy", "state_len", "truncated", "feedback_span"):
                assert getattr(ta, f) == getattr(tb, f), (where, f)
            if ta.kind == "feedback":  # Q(s, .) ran on other micro-batches: equal up to fp32 sums
                assert ta.q_values == pytest.approx(tb.q_values, abs=1e-4), where
                assert ta.behaviour_probs == pytest.approx(tb.behaviour_probs, abs=1e-4), where
                assert ta.behaviour_prob == pytest.approx(tb.behaviour_prob, abs=1e-4), where
            assert max((abs(x - y) for x, y in zip(ta.logprobs, tb.logprobs)), default=0.0) < LOGPROB_TOL, where
            assert ta.info == tb.info, where


def test_continuous_plays_the_batched_episodes(env, monkeypatch):
    cfg, policies, engine = env
    from dataclasses import replace

    # 2 problems x 2 samples at 32/16 tokens: the 4 episodes' solves and refines still end apart (at
    # eos, after the answer line, at the limit), so their turns overlap as in a real collect, while
    # the longest chain of turns, which sets both runs' decode steps, is 2/3 of 48/24's
    cfg = replace(cfg, solver_sampling=replace(cfg.solver_sampling, max_new_tokens=32),
                  episode=replace(cfg.episode, max_feedback_tokens=16))
    problems = make_task(cfg.task).load("train", 2).problems
    batched, spy_b, run_b = _play(cfg, policies, engine, problems, monkeypatch, on=False)
    ids0 = engine._stream_ids
    cont, spy_c, run_c = _play(cfg, policies, engine, problems, monkeypatch, on=True)
    _assert_same(batched, cont)
    # it ran as requests of its own: 4 solves, 8 feedbacks, 8 refines and 8 counterfactuals
    assert engine._stream_ids - ids0 == 4 + 3 * 8 and not engine.streaming and not spy_b.overlaps
    # episodes moved on independently: a writer request joined while turn-1 requests still decoded
    assert any(kind == "feedback" and "solve" in flying for kind, flying in spy_c.overlaps), spy_c.overlaps
    assert any(kind == "refine" and "feedback" in flying for kind, flying in spy_c.overlaps)
    # every episode's turns reached the progress callback, the same counts either way
    assert spy_c.turns == spy_b.turns == {"solve": 4, "feedback": 8, "refine": 8, "counterfactual": 8}
    assert run_c.gen_tokens == run_b.gen_tokens > 0 and run_c.gen_seconds > 0
    assert any(t.info.get("counterfactual_reward") is not None for e in cont for t in e.turns)
    # Q steered the choice: pi_b is not uniform, so equal strategies test the shared draws
    assert any(max(t.behaviour_probs) - min(t.behaviour_probs) > 1e-3 for e in cont for t in e.turns if t.q_values)


def test_greedy_turn_one_decodes_once_for_all_samples(env, monkeypatch):
    cfg, policies, engine = env
    from dataclasses import replace

    greedy = replace(cfg, solver_sampling=replace(cfg.solver_sampling, temperature=0.0),
                     episode=replace(cfg.episode, rounds=1, counterfactual=False))
    problems = make_task(cfg.task).load("train", 2).problems
    batched = _play(greedy, policies, engine, problems, monkeypatch, on=False)[0]
    cont, spy, _ = _play(greedy, policies, engine, problems, monkeypatch, on=True)
    _assert_same(batched, cont)
    assert [k for k, _ in spy.overlaps].count("solve") == 2  # one request per problem, n = 2 samples each
    assert spy.turns == {"solve": 4, "feedback": 4, "refine": 4}


def test_different_policies_stay_batched_unless_no_writer_writes(env, monkeypatch):
    cfg, policies, engine = env
    from dataclasses import replace

    problems = make_task(cfg.task).load("train", 2).problems
    with perturbed_lora_b(policies, "writer", seed=5):
        assert not engine.mixes_roles()
        with monkeypatch.context() as mp:
            mp.setattr(engine, "continuous", True)
            runner = EpisodeRunner(cfg, make_task(cfg.task), engine, policies)
            assert not continuous.applies(runner)
            with pytest.raises(RuntimeError, match="cannot share a vLLM batch"):
                engine.open_stream(("solver", "writer"))
        # SCoRe's static instruction: the writer model never runs, so its weights do not matter. One
        # round: a second one replays the same solver-only path (the batched test covers rounds)
        static = replace(cfg, episode=replace(cfg.episode, feedback="static", counterfactual=False, rounds=1))
        batched = _play(static, policies, engine, problems, monkeypatch, on=False)[0]
        cont = _play(static, policies, engine, problems, monkeypatch, on=True)[0]
        _assert_same(batched, cont)
        assert all(t.finish_reason == "fixed" for e in cont for t in e.turns if t.kind == "feedback")


def test_a_failed_run_leaves_nothing_in_flight(env, monkeypatch):
    cfg, policies, engine = env
    task = make_task(cfg.task)
    problems = task.load("train", 2).problems
    calls = []

    def verify(problem, text):
        calls.append(text)
        if len(calls) == 2:  # the second finished turn 1: the other requests are still decoding
            raise ValueError("verifier broke")
        return type(task).verify(task, problem, text)

    monkeypatch.setattr(task, "verify", verify)
    with monkeypatch.context() as mp:
        mp.setattr(engine, "continuous", True)
        with pytest.raises(ValueError, match="verifier broke"):
            EpisodeRunner(cfg, task, engine, policies).run(problems)
    assert not engine.streaming and not engine.llm.llm_engine.has_unfinished_requests()
    from tosca_mlmt.rollout.engines.base import SamplingParams

    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.0), "solver")
    assert len(out) == 1 and len(out[0][0].token_ids) <= 4


def test_served_adapters_share_the_batch(monkeypatch):
    """serve_adapters: solver and writer are LoRA requests on one base, so two trained adapters mix."""
    with vllm_session(_overrides(**{"engine.vllm.serve_adapters": True, "episode.rounds": 1,
                                    "episode.counterfactual": False, "solver_sampling.max_new_tokens": 32,
                                    "episode.max_feedback_tokens": 16})) as (cfg, policies, engine):
        problems = make_task(cfg.task).load("train", 2).problems
        with contextlib.ExitStack() as stack:
            for i, role in enumerate(("solver", "writer")):
                stack.enter_context(perturbed_lora_b(policies, role, seed=10 + i))
            assert policies.adapter_key("solver") != policies.adapter_key("writer") and engine.mixes_roles()
            batched = _play(cfg, policies, engine, problems, monkeypatch, on=False)[0]
            cont = _play(cfg, policies, engine, problems, monkeypatch, on=True)[0]
            _assert_same(batched, cont)
