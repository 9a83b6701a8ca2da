"""The writer's logged data: turns decoded as eval decodes them (collect.solve_temperature,
collect.refine_temperature, collect.writer_temperature), the Q evaluation's sample of the replay
(upper.eval_states), and strategies whose feedback is their fixed sentence (episode.prefix_only)."""

from dataclasses import replace

import pytest

from tosca_mlmt.config import load_config
from tosca_mlmt.errors import ConfigError
from tosca_mlmt.rollout.engines.base import Generation
from tosca_mlmt.rollout.runner import EpisodeRunner
from tosca_mlmt.tasks.arith import ArithTask
from tosca_mlmt.upper.dataset import build_transitions, eval_sample
from factories import rewarded_episode


class TemperatureEngine:
    """Answers every prompt with fixed tokens; records (policy, temperature, n) of each call."""

    name = "scripted"

    def __init__(self, replies: dict[str, list[int]]):
        self.replies, self.calls = replies, []

    def generate(self, prompts, params, policy):
        self.calls.append((policy, params.temperature, params.n))
        g = Generation(tuple(self.replies[policy]), (-0.5,) * len(self.replies[policy]), "stop")
        return [[g] * params.n for _ in prompts]


def _replies(policies):
    eos = policies.eos_ids("solver")[0]
    return {"solver": policies.tokenizer("solver").encode("The answer is 3.") + [eos],
            "writer": policies.tokenizer("writer").encode("Check the sum.") + [eos]}


@pytest.mark.parametrize("solve_t,refine_t,writer_t", [(-1.0, -1.0, -1.0), (-1.0, 0.0, 0.0), (0.0, 0.3, -1.0),
                                                      (0.2, -1.0, 0.4)])
def test_each_turn_kind_decodes_at_its_own_temperature(tiny_cfg, policies, solve_t, refine_t, writer_t):
    cfg = replace(tiny_cfg, solver_sampling=replace(tiny_cfg.solver_sampling, temperature=0.7),
                  writer_sampling=replace(tiny_cfg.writer_sampling, temperature=0.9),
                  episode=replace(tiny_cfg.episode, rounds=2, n_samples=2, counterfactual=True))
    engine = TemperatureEngine(_replies(policies))
    task = ArithTask(1)
    EpisodeRunner(cfg, task, engine, policies, solve_temperature=solve_t, refine_temperature=refine_t,
                  writer_temperature=writer_t).run(task.load("train", 2).problems)
    solve, refine = (0.7 if t < 0 else t for t in (solve_t, refine_t))
    writer = 0.9 if writer_t < 0 else writer_t
    # solve (n samples), then per round: feedback, refine, counterfactual refine (one each)
    assert engine.calls == [("solver", solve, 2)] + [("writer", writer, 1), ("solver", refine, 1),
                                                      ("solver", refine, 1)] * 2


def test_collect_logs_refines_at_collect_refine_temperature_and_eval_decodes_all_greedily(tiny_cfg, policies,
                                                                                          tmp_path):
    from tosca_mlmt.pipelines.collect import collect
    from tosca_mlmt.pipelines.evaluate import eval_config

    cfg = replace(tiny_cfg, collect=replace(tiny_cfg.collect, solve_temperature=0.3, refine_temperature=0.0,
                                            writer_temperature=0.0),
                  writer_sampling=replace(tiny_cfg.writer_sampling, temperature=0.9),
                  episode=replace(tiny_cfg.episode, rounds=1, n_samples=2),
                  task=replace(tiny_cfg.task, name="arith", level=1, limit=2))
    engine = TemperatureEngine(_replies(policies))
    res = collect(cfg, tmp_path / "snaps", policies=policies, engine=engine)
    assert engine.calls == [("solver", 0.3, 2), ("writer", 0.0, 1), ("solver", 0.0, 1)]
    # the setting is part of the snapshot's recorded config
    from tosca_mlmt.store import open_snapshot
    recorded = open_snapshot(tmp_path / "snaps", res.snapshot_id).manifest["config"]["collect"]
    assert (recorded["solve_temperature"], recorded["refine_temperature"], recorded["writer_temperature"]) == (0.3, 0.0, 0.0)
    # eval's protocol is greedy everywhere: a collect setting must not change it
    e = eval_config(replace(cfg, collect=replace(cfg.collect, solve_temperature=0.5, refine_temperature=0.5,
                                                 writer_temperature=0.5)))
    assert e.solver_sampling.temperature == 0.0 == e.writer_sampling.temperature
    assert (e.collect.solve_temperature, e.collect.refine_temperature, e.collect.writer_temperature) == (-1, -1, -1)


def test_eval_refine_sampled_samples_only_the_refines_at_the_solvers_own_temperature(tiny_cfg, policies, tmp_path):
    """`mlmt eval --refine sampled`: turn 1 and the writer greedy as in the eval protocol, the refine
    at solver_sampling.temperature (what --resample's answers sample at), whatever collect.* said."""
    from tosca_mlmt.pipelines.collect import collect
    from tosca_mlmt.pipelines.evaluate import eval_config

    cfg = replace(tiny_cfg, solver_sampling=replace(tiny_cfg.solver_sampling, temperature=0.6),
                  writer_sampling=replace(tiny_cfg.writer_sampling, temperature=0.9),
                  collect=replace(tiny_cfg.collect, solve_temperature=0.3, refine_temperature=0.0),
                  episode=replace(tiny_cfg.episode, rounds=1, n_samples=3),
                  task=replace(tiny_cfg.task, name="arith", level=1, limit=2))
    engine = TemperatureEngine(_replies(policies))
    collect(eval_config(cfg, "sampled"), tmp_path / "snaps", policies=policies, engine=engine)
    assert engine.calls == [("solver", 0.0, 1), ("writer", 0.0, 1), ("solver", 0.6, 1)]
    assert eval_config(cfg).collect.refine_temperature == -1  # greedy stays the default
    with pytest.raises(ConfigError, match="solver_sampling.temperature is 0"):
        eval_config(replace(cfg, solver_sampling=replace(cfg.solver_sampling, temperature=0.0)), "sampled")
    with pytest.raises(ConfigError, match="--refine; allowed: greedy, sampled"):
        eval_config(cfg, "beam")


@pytest.mark.parametrize("field", ["solve_temperature", "refine_temperature", "writer_temperature"])
@pytest.mark.parametrize("bad", [-0.5, 0.0005, "x"])
def test_collect_temperatures_are_validated_at_load(field, bad):
    with pytest.raises(ConfigError, match=f"collect.{field}"):
        load_config(overrides={f"collect.{field}": bad})


def test_eval_sample_takes_whole_episodes_seeded_and_all_when_zero():
    eps = [rewarded_episode(f"e{i}", [0.0, 1.0, 1.0], actions=[0, 1]) for i in range(10)]  # 2 decisions each
    tr = build_transitions([("snap", eps)])
    assert eval_sample(tr, 0, seed=0) == list(range(20)) == eval_sample(tr, 20, seed=0)
    idx = eval_sample(tr, 5, seed=0)
    assert idx == sorted(idx) and len(idx) == 6  # three whole episodes: 6 >= 5 decisions
    by_episode = {}
    for i in idx:
        by_episode.setdefault(tr[i].episode_id, []).append(tr[i].round)
    assert all(sorted(r) == [1, 2] for r in by_episode.values()) and len(by_episode) == 3
    assert eval_sample(tr, 5, seed=0) == idx  # a pure function of the seed
    assert any(eval_sample(tr, 5, seed=s) != idx for s in range(1, 6))


class OneRightTask(ArithTask):
    """arith, but only the first problem's attempts are right (whatever the scripted solver says)."""

    def __init__(self, right_id: str):
        super().__init__(level=1)
        self.right_id = right_id

    def verify(self, problem, response):
        said = f"The answer is: {problem.answer}" if problem.id == self.right_id else "The answer is: -1"
        return super().verify(problem, said)


def test_the_writer_signal_is_logged_and_selects_through_the_q_heads_table(tiny_cfg, policies):
    """writer_sees=verdict: each feedback turn records o(s) (1 = the attempt was right), and collect's
    strategy choice reads Q(s, .) + T[o(s), .] from a writer head with a signal table."""
    import torch

    from tosca_mlmt.models.q_head import QHead
    from tosca_mlmt.upper.dataset import build_transitions

    task0 = ArithTask(1)
    problems = task0.load("train", 2).problems
    task = OneRightTask(problems[0].id)
    cfg = replace(tiny_cfg, episode=replace(tiny_cfg.episode, rounds=1, n_samples=2, writer_sees="verdict",
                                            strategy_selection="greedy", min_q_decisions=0))
    head = QHead(policies.model("writer").config.hidden_size, len(cfg.episode.strategies), signals=3)
    with torch.no_grad():
        head.signal_table[0, 3] = 5.0  # told "incorrect": start_over
        head.signal_table[1, 4] = 5.0  # told "correct": confirm
    saved = policies.q_head, policies.q_decisions
    policies.q_head, policies.q_decisions = head, 10**6
    try:
        episodes = EpisodeRunner(cfg, task, TemperatureEngine(_replies(policies)), policies).run(problems)
    finally:
        policies.q_head, policies.q_decisions = saved
    for ep in episodes:
        z, fb = ep.turns[0], ep.turns[1]
        assert fb.info["writer_signal"] == int(z.correct) and z.correct == (ep.problem.id == problems[0].id)
        assert fb.strategy_name == ("confirm" if z.correct else "start_over")
        assert fb.q_values[fb.strategy] == pytest.approx(5.0)  # a zero-weight head: Q is the table's cell
    assert [t.signal for t in build_transitions([("s", episodes)])] == [1, 1, 0, 0]


def test_a_saved_head_with_a_signal_table_loads_with_it(policies, tmp_path):
    import torch
    from safetensors.torch import save_file

    from tosca_mlmt.models.policies import Q_HEAD_FILE
    from tosca_mlmt.models.q_head import QHead

    head = QHead(16, 6, signals=3)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_()
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, tmp_path / Q_HEAD_FILE)
    saved = policies.q_head, policies.q_decisions, policies.strategies
    try:
        policies._load_writer_extras(tmp_path)
        loaded = policies.q_head
    finally:
        policies.q_head, policies.q_decisions, policies.strategies = saved
    h, o = torch.randn(5, 16), torch.tensor([0, 1, 2, 1, 0])
    assert torch.equal(loaded(h, o), head(h, o)) and not torch.equal(loaded(h, o), loaded(h))


class PromptEngine(TemperatureEngine):
    """TemperatureEngine that also keeps each call's prompts."""

    def generate(self, prompts, params, policy):
        self.calls.append((policy, len(prompts)))
        return [[Generation(tuple(self.replies[policy]), (-0.5,) * len(self.replies[policy]), "stop")] * params.n
                for _ in prompts]


def test_a_prefix_only_strategy_sends_its_sentence_alone_and_the_writer_writes_nothing_for_it(tiny_cfg, policies):
    """episode.prefix_only=[confirm]: right attempts get confirm (through the head's table), whose feedback
    is its prefix alone: no writer call, finish 'fixed', no log-probs, the refine reads the sentence
    once and none of the writer's text, and the text loss has nothing of it to clone. The other
    strategy's feedback is still written, prefix first."""
    import torch

    from tosca_mlmt.models.q_head import QHead

    problems = ArithTask(1).load("train", 2).problems
    task = OneRightTask(problems[0].id)
    cfg = replace(tiny_cfg, episode=replace(tiny_cfg.episode, rounds=1, n_samples=2, writer_sees="verdict",
                                            strategy_selection="greedy", min_q_decisions=0, strategy_prefix=True,
                                            prefix_only=["confirm"]))
    by_name = {s["name"]: s for s in cfg.episode.strategies}
    head = QHead(policies.model("writer").config.hidden_size, len(cfg.episode.strategies), signals=3)
    with torch.no_grad():
        head.signal_table[0, 3] = 5.0  # wrong: start_over (written)
        head.signal_table[1, 4] = 5.0  # right: confirm (prefix only)
    engine = PromptEngine(_replies(policies))
    saved = policies.q_head, policies.q_decisions
    policies.q_head, policies.q_decisions = head, 10**6
    try:
        episodes = EpisodeRunner(cfg, task, engine, policies).run(problems)
    finally:
        policies.q_head, policies.q_decisions = saved
    assert engine.calls == [("solver", 2), ("writer", 2), ("solver", 4)]  # the writer wrote for the 2 wrong ones
    decode = policies.tokenizer("solver").decode
    for ep in episodes:
        fb, refine = ep.turns[1], ep.turns[2]
        told = decode(refine.prompt_ids[refine.feedback_span.start:refine.feedback_span.end])
        if ep.turns[0].correct:
            assert fb.strategy_name == "confirm" and fb.finish_reason == "fixed" and fb.logprobs == []
            assert fb.text == by_name["confirm"]["prefix"]
            assert told.count(by_name["confirm"]["prefix"]) == 1 and "Check the sum." not in told
        else:
            assert fb.strategy_name == "start_over" and fb.finish_reason == "stop" and len(fb.logprobs) > 0
            assert told.index(by_name["start_over"]["prefix"]) < told.index("Check the sum.")
    assert [t.written for t in build_transitions([("s", episodes)])] == [False, False, True, True]


@pytest.mark.parametrize("value,says", [(["nope"], "is not a strategy"), (["confirm"], "has no 'prefix'")])
def test_prefix_only_names_a_strategy_with_a_prefix(value, says):
    plain = [{"name": "confirm", "instruction": "Say it is right."}, {"name": "redo", "instruction": "Redo it."}]
    with pytest.raises(ConfigError, match=r"episode\.prefix_only\[0\].*" + says):
        load_config(overrides={"episode.strategies": plain, "episode.prefix_only": value})
