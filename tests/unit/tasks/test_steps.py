"""The step checker (tosca_mlmt/tasks/steps.py): hand-made attempts, each with what a careful
reader would say about it."""

from __future__ import annotations

import builtins
from fractions import Fraction

import pytest

from tosca_mlmt.leak import answer_leaked
from tosca_mlmt.tasks.steps import MAX_OPERANDS, Slip, check_steps, evaluate, hint


@pytest.mark.parametrize("text, value", [
    ("7 + 10", 17), ("18 - 1", 17), ("2 + 3 * 4", 14), ("20 - 6 / 3", 18), ("3 x 4", 12), ("3 × 4 ÷ 6", 2),
    ("-3 + 5", 2), ("$1,200 + 300", 1500), ("10 / 4", Fraction(5, 2)), ("1.5 * 2", 3),
])
def test_evaluate_follows_precedence_exactly(text, value):
    assert evaluate(text) == value


@pytest.mark.parametrize("text", ["1 / 0", "7 +", "7 7", "abs(3)", "2 ** 3", "(2 + 3)", " + ".join(["1"] * (MAX_OPERANDS + 1))])
def test_evaluate_refuses_what_is_not_a_plain_chain(text):
    assert evaluate(text) is None


def test_right_steps_are_not_flagged():
    r = check_steps("Priya has 11 cookies and gets 4 more. How many now?", "11 + 4 = 15\nThe answer is 15", "15")
    assert (r.equations, r.slips, r.copied, r.flagged) == (1, (), None, False)


def test_a_slip_is_found_and_named_as_written():
    r = check_steps("What is 7 more than 10?", "First, 7+10 = 18. Then 18 - 0 = 18.\nThe answer is 18", "18")
    assert r.equations == 2
    assert r.slips == (Slip("7 + 10", "18"),)
    assert r.flagged and r.features() == (1.0, 1.0, 0.0)


def test_a_copied_operand_is_flagged_without_any_equation():
    r = check_steps("How much is 18 minus 1?", "The answer is 18", "18")
    assert (r.equations, r.slips, r.copied) == (0, (), "18")
    assert r.features() == (1.0, 0.0, 1.0)


def test_no_arithmetic_and_no_answer_is_not_flagged():
    r = check_steps("What is 3 + 4?", "I am not sure how to do this.", None)
    assert not r.flagged and r.to_json() == {"equations": 0, "flagged": False, "copied": None, "slips": []}


def test_decimals_count_when_rounded_to_their_places():
    r = check_steps("q", "10 / 3 = 3.33 and 10 / 3 = 3.4, 2.5 * 2 = 5.0", None)
    assert r.equations == 3 and r.slips == (Slip("10 / 3", "3.4"),)


def test_numbers_inside_longer_numbers_are_not_equations():
    # "x2 + 3 = 5" cut out of "12 + 3 = 15" would be a false slip
    r = check_steps("q", "112 + 3 = 115, and v2.5 + 1 = 3.5", None)
    assert r.slips == () and r.equations == 2


def test_hostile_text_is_never_evaluated(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("model text reached eval/exec")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    attempt = ("__import__('os').system('touch /tmp/pwned') = 3\n"
               "9" * 400 + " * " + "9" * 400 + " = 1\n" + " * ".join(["99"] * 5000) + " = 2\n1 + 1 = 3")
    r = check_steps("q", attempt, None)
    # only the plain one is checked: the huge operands and the long chain are out of bounds
    assert r.slips == (Slip("1 + 1", "3"),) and r.equations == 1


def test_hints_point_at_the_step_without_its_value():
    question = "Ben has 19 marbles and loses 8. How many are left?"
    r = check_steps(question, "19 - 8 = 12\nThe answer is 12", "12")
    text = hint(r)
    assert text == "Recheck 19 - 8."
    assert answer_leaked("11", text, question, "arith") is False
    copied = hint(check_steps(question, "The answer is 19", "19"))
    assert "19" not in copied and answer_leaked("11", copied, question, "arith") is False


def test_an_answer_a_true_step_arrives_at_is_not_copied():
    # 18 - 9 = 9: the answer is a number of the question and right; the step that derives it holds
    question = "What is 18 minus 9?"
    assert check_steps(question, "18 - 9 = 9\nThe answer is 9", "9").copied is None
    assert check_steps(question, "The answer is 9", "9").copied == "9"  # nothing derives it: flagged
    assert check_steps(question, "18 - 9 = 18\nThe answer is 18", "18").copied == "18"  # a slip derives nothing


def test_a_hint_never_vouches_for_an_answer_nothing_checked():
    assert hint(check_steps("What is 7 + 10?", "The answer is 17", "17")) == "Write out the calculation that gives your answer."
    assert hint(check_steps("What is 7 + 10?", "7 + 10 = 17. The answer is 17", "17")) == "Your steps check out."
