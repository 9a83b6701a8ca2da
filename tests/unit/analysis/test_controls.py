"""The eval's inference-matched controls (analysis/controls.py): the vote, the gate, the checker."""

import pytest

from tosca_mlmt.analysis.controls import (Attempt, ControlPlan, answer_key, control_row, control_summary, flagged,
                                          gated_index, majority_index, plan_controls, require_checker)
from tosca_mlmt.errors import ConfigError
from tosca_mlmt.records import Turn
from tosca_mlmt.tasks.arith import ArithTask
from tosca_mlmt.tasks.base import Problem
from tosca_mlmt.tasks.math_tasks import GSM8KTask
from tosca_mlmt.tasks.mathverify import is_equivalent

TAGS = ["<think>", "</think>"]


def turn(text: str) -> Turn:
    return Turn(0, 0, "solver", "solve", [1], [2], [-0.1], "stop", text)


def check(task, problem, text, tags=(), reads_thinking=True) -> bool:
    return flagged(task, problem, turn(text), list(tags), reads_thinking)


def test_the_most_frequent_answer_wins_and_numbers_vote_by_value():
    assert majority_index(["3", "5", "5"]) == 1
    assert majority_index(["7", "12.0", "$12", "7", "12"]) == 1  # 12 three times (as written three ways), 7 twice
    assert majority_index(["1/2", "0.5", "3"]) == 0
    assert answer_key(" x  + 1 ") == answer_key("x+1") and answer_key("12") == answer_key("12.00") != answer_key("13")


LATEX_SAME = [("\\dfrac12", "\\frac{1}{2}", "0.5", "1/2", "\\tfrac{1}{2}"), ("\\dfrac{x}{2}", "\\frac{x}{2}", "\\frac{x}{2}."),
              ("\\left(3, 4\\right)", "(3,4)"), ("90^\\circ", "90", "\\$90"), ("\\text{east}", "east"),
              ("-\\frac{3}{4}", "-0.75", "\\frac{-3}{4}")]


@pytest.mark.parametrize("spellings", LATEX_SAME)
def test_answers_the_verifier_counts_as_one_vote_together(spellings):
    assert len({answer_key(a) for a in spellings}) == 1
    assert all(is_equivalent(a, spellings[0]) for a in spellings)  # the rule correctness uses agrees
    assert majority_index(["7", *spellings[:2]]) == 1  # two spellings of one answer outvote one 7
    assert majority_index(["7", "7", *spellings[:2]]) == 0  # a tie: the 7 came first


def test_different_latex_answers_still_vote_apart():
    assert len({answer_key(a) for a in ("\\frac{1}{2}", "\\frac{1}{3}", "\\frac{x}{2}", "\\frac{2}{x}")}) == 4
    assert answer_key("\\frac{1}{0}") != answer_key("0") and answer_key("$ $") is None


def test_ties_go_to_the_first_tied_answer_in_sample_order():
    assert majority_index(["4", "9"]) == 0
    assert majority_index(["9", "4", "4", "9"]) == 0
    assert majority_index(["2", "9", "4", "4", "9"]) == 1  # 9 and 4 tie at two; 9 came first
    assert majority_index(["2", "4", "9", "9", "4"]) == 1


def test_no_answer_does_not_vote_and_no_answer_at_all_keeps_the_first_sample():
    assert majority_index([None, None, "6"]) == 2
    assert majority_index([None, "", "  "]) == 0
    assert majority_index([None, "5", None, None]) == 1


def test_the_gate_keeps_an_unflagged_first_answer_and_resamples_a_flagged_one():
    assert gated_index([False]) == 0
    assert gated_index([True]) == 1
    assert gated_index([True, False]) == 1  # K = 2: the first resample was not flagged, it stands
    assert gated_index([True, True]) == 2  # every answer before the last flagged: the last resample
    assert gated_index([False, True]) == 0
    assert gated_index([]) == 0


def test_the_arith_checker_flags_a_slip_and_a_copied_operand_and_passes_a_clean_attempt():
    task = ArithTask(1)
    p = Problem("arith", "a-1", "What is 7 + 10?", "17", "test")
    assert check(task, p, "7 + 10 = 18\nThe answer is: 18")  # a slip
    assert check(task, p, "The answer is: 7")  # the question's own number
    assert not check(task, p, "7 + 10 = 17\nThe answer is: 17")


def test_the_gate_reads_the_attempt_as_the_method_s_tool_does_thinking_included_by_default():
    from tosca_mlmt.rollout.tool import attempt_report

    task = ArithTask(1)
    p = Problem("arith", "a-1", "What is 7 + 10?", "17", "test")
    text = "<think>7 + 10 = 18, so 18</think>The answer is: 17"  # the slip is in the thinking only
    assert check(task, p, text, TAGS, reads_thinking=True)  # writer_reads_thinking (default): the whole attempt
    assert not check(task, p, text, TAGS, reads_thinking=False)  # off: what follows the thinking
    for reads in (True, False):
        assert check(task, p, text, TAGS, reads) == attempt_report(task, p, turn(text), TAGS, reads).flagged


class _Own:
    name = "mine"

    def check_attempt(self, problem, response):
        return type("Report", (), {"flagged": "bad" in response})()


def test_a_task_s_own_check_attempt_is_used_and_a_task_without_one_is_refused():
    p = Problem("mine", "m-1", "q", "a", "test")
    require_checker(_Own())
    assert check(_Own(), p, "bad") and not check(_Own(), p, "good")
    no_checker = type("T", (), {"name": "jsonl"})()
    with pytest.raises(ConfigError, match="--resample tool: task 'jsonl' has no checker"):
        require_checker(no_checker)
    uncallable = type("T", (), {"name": "odd", "check_attempt": None})()  # the episode's tool refuses it too
    with pytest.raises(ConfigError, match="'odd' has no checker"):
        require_checker(uncallable)


def test_gsm8k_s_check_attempt_runs_the_step_checker_on_its_extracted_answer():
    task = GSM8KTask()
    require_checker(task)
    p = Problem("gsm8k", "g-1", "Tom has 18 apples and eats 1.", "17", "test")
    assert check(task, p, "18 - 1 = 17 so 17") is False
    assert check(task, p, "18 - 1 = 16 so 16")  # a slip
    assert check(task, p, "so 18")  # the answer copies the question's 18


def test_the_plan_matches_the_feedback_method_and_refuses_what_would_measure_nothing():
    assert plan_controls(None, None, 1, 0.7) is None
    assert plan_controls(0, None, 2, 0.7) == ControlPlan(3, False, 2)  # 0 = 1 + rounds
    assert plan_controls(5, "tool", 2, 0.7).samples == 5
    assert plan_controls(None, "tool", 3, 0.7).samples == 3
    with pytest.raises(ConfigError, match="solver_sampling.temperature"):
        plan_controls(3, None, 1, 0.0)
    with pytest.raises(ConfigError, match="episode.rounds is 0"):
        plan_controls(None, "tool", 0, 0.7)
    with pytest.raises(ConfigError, match="--resample"):
        plan_controls(None, "always", 1, 0.7)


def A(answer, correct):
    return Attempt(answer, correct)


def test_rows_and_summary_count_votes_flags_fixes_and_breaks():
    plan = ControlPlan(3, True, 1)
    flagged = lambda a: a.answer == "flag"  # noqa: E731
    rows = [control_row(A("flag", False), [A("5", True), A("4", False), A("4", False)], plan, flagged),  # fixed
            control_row(A("flag", True), [A("2", False), A("2", False), A("9", True)], plan, flagged),  # broke
            control_row(A("8", True), [A("8", True), A("1", False), A("8", True)], plan, flagged)]  # kept
    assert [r["majority_pick"] for r in rows] == [1, 0, 0]
    assert [r["resample_pick"] for r in rows] == [1, 1, 0]
    s = control_summary(rows, plan)
    assert s["acc_majority"] == pytest.approx(1 / 3) and s["majority_k"] == 3
    assert s["acc_resample"] == pytest.approx(2 / 3)  # the fix and the kept answer
    assert (s["resample_flagged"], s["resample_used"], s["resample_fixed"], s["resample_broke"]) == (2, 2, 1, 1)
    assert s["generations_per_problem"] == {"feedback": 2, "majority": 3, "resample": {"max": 2, "mean": 5 / 3}}


def test_the_gate_checks_answers_only_until_one_stands():
    plan, checked = ControlPlan(0, True, 3), []

    def flag(a):
        checked.append(a.answer)
        return a.answer in ("1", "2")

    row = control_row(A("1", False), [A("2", False), A("3", True), A("4", False)], plan, flag)
    assert checked == ["1", "2", "3"] and row["flags"] == [True, True, False]
    assert (row["resample_pick"], row["resample_correct"]) == (2, True) and "majority_pick" not in row
    assert control_summary([row], plan)["generations_per_problem"]["resample"] == {"max": 4, "mean": 3}
