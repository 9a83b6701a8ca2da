"""episode.writer_sees: tool and episode.feedback: tool (rollout/tool.py): a task's own check of each attempt
reaches the writer's state, its signal and the stored feedback turn; the tool template's hints give nothing away."""

from dataclasses import replace

import pytest

from tosca_mlmt.errors import ConfigError
from tosca_mlmt.metrics import environment
from tosca_mlmt.rollout.engines.base import Generation
from tosca_mlmt.rollout.runner import EpisodeRunner
from tosca_mlmt.tasks.arith import ArithTask
from tosca_mlmt.tasks.base import Problem
from tosca_mlmt.tasks.math_tasks import GSM8KTask
from tosca_mlmt.tasks.steps import check_steps

pytestmark = pytest.mark.slow

SEVENTEEN = Problem("arith", "tool-17", "What is 7 + 10?", "17", "train")
# a two-step word problem (gold 27: 4 * 5 = 20, 20 + 7 = 27) and a hand-made attempt for each finding
BOXES = Problem("gsm8k", "tool-27", "Mo has 4 boxes of 5 pens and 7 loose pens. How many pens does Mo have?",
                "27", "train")
ATTEMPTS = {  # attempt -> (the writer's line, the signal)
    "7 + 10 = 18\nThe answer is: 18": ("Step check: `7 + 10 = 18` does not hold.", 1),
    "7 + 10 = 17\nThe answer is: 17": ("Step check: all 1 equation(s) in the attempt hold.", 0),
    "The answer is: 3": ("Step check: no arithmetic to check.", 0),
    "The answer is: 10": ("Step check: the final answer 10 is a number the question gives.", 1),
}


class Scripted:
    """An engine whose solver writes ``attempt`` and whose writer writes a fixed sentence."""

    name = "scripted"

    def __init__(self, policies, attempt: str):
        eos = policies.eos_ids("solver")[0]
        self.replies = {"solver": policies.tokenizer("solver").encode(attempt) + [eos],
                        "writer": policies.tokenizer("writer").encode("Look again.") + [eos]}

    def generate(self, prompts, params, policy):
        g = Generation(tuple(self.replies[policy]), (-0.5,) * len(self.replies[policy]), "stop")
        return [[g] * params.n for _ in prompts]


def _run(cfg, policies, attempt, task=None, problem=SEVENTEEN, **episode):
    cfg = replace(cfg, episode=replace(cfg.episode, **{"rounds": 1, "n_samples": 1, **episode}))
    return EpisodeRunner(cfg, task or ArithTask(1), Scripted(policies, attempt), policies).run([problem])[0]


@pytest.mark.parametrize("attempt", list(ATTEMPTS))
def test_the_checks_finding_reaches_the_writer_state_its_signal_and_the_stored_turn(tiny_cfg, policies, tmp_path,
                                                                                     attempt):
    from tosca_mlmt.store import load_snapshot, write_snapshot

    line, signal = ATTEMPTS[attempt]
    ep = _run(tiny_cfg, policies, attempt, writer_sees="tool")
    z, fb, _ = ep.turns
    state = policies.tokenizer("writer").decode(fb.prompt_ids[:fb.state_len])
    assert f"{line}\n" in state and state.index(line) > state.index("Student's attempt 1")
    want = check_steps(SEVENTEEN.question, z.text, z.extracted).to_json()
    assert fb.info["tool_report"] == want and fb.info["writer_signal"] == signal and want["flagged"] == bool(signal)
    sid, _ = write_snapshot(tmp_path, [ep], {"task": {"name": "arith", "split": "train"}})
    back = load_snapshot(tmp_path, sid).episodes()[0].turns[1]
    assert back.info["tool_report"] == want and back.info["writer_signal"] == signal


def test_each_attempt_of_a_later_round_gets_its_own_line(tiny_cfg, policies):
    ep = _run(tiny_cfg, policies, "7 + 10 = 18\nThe answer is: 18", writer_sees="tool", rounds=2)
    state = policies.tokenizer("writer").decode(ep.turns[3].prompt_ids[:ep.turns[3].state_len])
    assert state.count("Step check: `7 + 10 = 18` does not hold.") == 2


def test_the_tool_template_points_at_the_step_and_gives_no_value_away(tiny_cfg, policies):
    """feedback: tool writes the check's hint, a fixed rule: over hand-made attempts with slips in either step,
    a copied operand and right steps, no hint holds the gold nor the recomputed value of the step it names."""
    from tosca_mlmt.leak import leak_rate
    from tosca_mlmt.metrics import summarize
    from tosca_mlmt.tasks.steps import evaluate

    attempts = ["4 * 5 = 21\n21 + 7 = 28\nThe answer is: 28", "4 * 5 = 20\n20 + 7 = 26\nThe answer is: 26",
                "4 * 5 + 7 = 29\nThe answer is: 29", "The answer is: 5", "4 * 5 = 20\n20 + 7 = 27\nThe answer is: 27",
                "The answer is: 27"]
    episodes = [_run(tiny_cfg, policies, a, task=GSM8KTask(), problem=BOXES, feedback="tool") for a in attempts]
    hints = [ep.turns[1].text for ep in episodes]
    assert hints == ["Recheck 4 * 5.", "Recheck 20 + 7.", "Recheck 4 * 5 + 7.",
                     "Your answer is a number the question gives; recheck which operation the question asks for.",
                     "Your steps check out.", "Write out the calculation that gives your answer."]
    assert all(ep.turns[1].finish_reason == "fixed" and ep.turns[1].info["feedback"] == "tool" for ep in episodes)
    assert leak_rate(episodes) == 0.0
    for ep in episodes[:3]:
        step = ep.turns[1].info["tool_report"]["slips"][0]["expression"]
        assert str(evaluate(step)) not in ep.turns[1].text.replace(step, "")
    assert summarize(episodes)["environment"] == "honest:tool"


@pytest.mark.parametrize("feedback, sent", [("tool", "Recheck 7 + 10."), ("verdict", "Your answer is wrong.")])
def test_fixed_feedback_reaches_the_solver_alone_under_strategy_prefix(tiny_cfg, policies, feedback, sent):
    """episode.strategy_prefix opens *written* feedback with the strategy's sentence; the tool template's hint and
    the verdict are sent alone (a uniformly drawn 'Your answer looks right: give it again.' before 'Recheck
    7 + 10.' would contradict it), while generated feedback still gets its strategy's sentence."""
    from tosca_mlmt.config.episode import DEFAULT_STRATEGIES

    ep = _run(tiny_cfg, policies, "7 + 10 = 18\nThe answer is: 18", feedback=feedback, strategy_prefix=True)
    refine = policies.tokenizer("solver").decode(ep.turns[2].prompt_ids)
    assert sent in refine and not any(s["prefix"] in refine for s in DEFAULT_STRATEGIES)
    ep = _run(tiny_cfg, policies, "7 + 10 = 18\nThe answer is: 18", strategy_prefix=True)
    refine = policies.tokenizer("solver").decode(ep.turns[2].prompt_ids)
    assert f"{DEFAULT_STRATEGIES[ep.turns[1].strategy]['prefix']} Look again." in refine


@pytest.mark.parametrize("attempt, sent", [("7 + 10 = 18\nThe answer is: 18", "Recheck 7 + 10."),
                                            ("7 + 10 = 17\nThe answer is: 17", "Your steps check out.")])
def test_a_selector_strategy_can_send_the_checks_hint(tiny_cfg, policies, attempt, sent):
    """A prefix_only strategy whose prefix holds {tool_hint} sends the check's hint on this attempt (what the
    tool template sends), so a learned selector can choose it; the other strategies keep their sentences."""
    strategies = [{"name": "point_at_step", "instruction": "Point at the flagged step.",
                   "prefix": "Look: {tool_hint}"}]
    ep = _run(tiny_cfg, policies, attempt, writer_sees="tool", strategies=strategies, prefix_only=["point_at_step"])
    fb = ep.turns[1]
    assert fb.text == f"Look: {sent}" and fb.finish_reason == "fixed" and fb.strategy_name == "point_at_step"
    refine = policies.tokenizer("solver").decode(ep.turns[2].prompt_ids)
    assert f"Look: {sent}" in refine and "{tool_hint}" not in refine
    other = [{"name": "confirm", "instruction": "Say it is right.", "prefix": "Keep {it}."}]
    assert _run(tiny_cfg, policies, attempt, writer_sees="tool", strategies=other,
                prefix_only=["confirm"]).turns[1].text == "Keep {it}."


class NoCheck:
    """A user's task without check_attempt (arith's problems and verifier)."""

    name = "no_check"
    verifier_version = "v1"

    def __init__(self):
        self.inner = ArithTask(1)

    def load(self, *a, **k):
        return self.inner.load(*a, **k)

    def instruction(self, problem):
        return self.inner.instruction(problem)

    def verify(self, problem, response):
        return self.inner.verify(problem, response)


@pytest.mark.parametrize("field", ["writer_sees", "feedback"])
def test_a_task_without_a_check_is_refused_by_name(tiny_cfg, policies, field):
    cfg = replace(tiny_cfg, episode=replace(tiny_cfg.episode, **{field: "tool"}))
    with pytest.raises(ConfigError, match=rf"episode\.{field}.*'no_check' has no check_attempt"):
        EpisodeRunner(cfg, NoCheck(), Scripted(policies, "The answer is: 3"), policies)
    EpisodeRunner(replace(cfg, episode=tiny_cfg.episode), NoCheck(), Scripted(policies, "x"), policies)  # no tool: fine


def test_collect_refuses_a_task_without_a_check_before_any_model_loads(monkeypatch, tmp_path):
    """A user's task named by path (tests/byo_plugin.py's CountTask has no check_attempt)."""
    from tosca_mlmt.config import load_config
    from tosca_mlmt.pipelines import collect as stage

    def no_models(*a, **k):
        raise AssertionError("a model was loaded before the task was refused")

    monkeypatch.setattr(stage, "PolicyPair", no_models)
    cfg = load_config(overrides={"task.name": "byo_plugin:CountTask", "episode.writer_sees": "tool"})
    with pytest.raises(ConfigError, match=r"episode\.writer_sees.*task 'count' has no check_attempt"):
        stage.collect(cfg, tmp_path)


class _Graded(ArithTask):
    """A verifier that, like mbpp's, hands the writer a grading test's error (Verdict.feedback_context)."""

    def verify(self, problem, response):
        return replace(super().verify(problem, response), feedback_context="hidden test: assert f(3) == 9")


@pytest.mark.parametrize("sees, shown", [("none", True), ("tool", False)])
def test_under_a_tool_the_writer_never_reads_the_grading_context(tiny_cfg, policies, sees, shown):
    ep = _run(tiny_cfg, policies, "7 + 10 = 18\nThe answer is: 18", task=_Graded(1), writer_sees=sees)
    fb = ep.turns[1]
    state = policies.tokenizer("writer").decode(fb.prompt_ids[:fb.state_len])
    assert ("hidden test: assert f(3) == 9" in state) is shown
    assert environment([ep]) == ("privileged:grading_tests" if shown else "honest:tool")


class _Counted(ArithTask):
    """Arith whose check counts its runs (mbpp's check is a sandbox run: each one costs)."""

    def __init__(self, n_digits):
        super().__init__(n_digits)
        self.checked: list[str] = []

    def check_attempt(self, problem, response):
        self.checked.append(response)
        return super().check_attempt(problem, response)


@pytest.mark.parametrize("field", ["writer_sees", "feedback"])
def test_each_attempt_a_writer_reads_is_checked_once_per_episode(tiny_cfg, policies, field):
    """Round k's writer state reads attempts 1..k: their checks are run once each, not once per round
    (3 rounds read 3 attempts: 3 checks, where re-checking every round would run 1 + 2 + 3 = 6)."""
    attempt, task = "7 + 10 = 18\nThe answer is: 18", _Counted(1)
    ep = _run(tiny_cfg, policies, attempt, task=task, rounds=3, **{field: "tool"})
    assert len(ep.solver_turns) == 4 and task.checked == [attempt] * 3  # the last refine: no writer reads it
    want = check_steps(SEVENTEEN.question, attempt, "18").to_json()
    feedback = [t for t in ep.turns if t.kind == "feedback"]
    assert [t.info["tool_report"] for t in feedback] == [want] * 3
    if field == "writer_sees":
        assert [t.info["writer_signal"] for t in feedback] == [1] * 3
