"""Answer leakage in the writer's feedback (tosca_mlmt/leak.py), and its summary metric."""

from fractions import Fraction

import pytest

from tosca_mlmt.records import Episode, Turn
from tosca_mlmt.leak import answer_leaked, leak_rate, numbers_in, number_value, spelled_numbers_in
from tosca_mlmt.metrics import summarize
from tosca_mlmt.tasks.base import Problem


@pytest.mark.parametrize("text, value", [("15", 15), ("15.0", 15), ("$15", 15), ("1,500", 1500), ("-3", -3),
                                         ("0.5", Fraction(1, 2)), (".5", Fraction(1, 2)), ("3/4", Fraction(3, 4)),
                                         ("15.", 15), ("abc", None), ("", None), ("1/0", None)])
def test_number_value_normalises_spellings(text, value):
    assert number_value(text) == value


def test_numbers_in_reads_whole_numbers_and_signs():
    assert numbers_in("Take 10-3, not 150 or 1.5; $1,200 and -4.") == [10, 3, 150, Fraction(3, 2), 1200, -4]


@pytest.mark.parametrize("gold, feedback, leaked", [
    ("15", "The answer is 15.", True),
    ("15", "The answer should be 15.0", True),
    ("15", "You should get $15 in total.", True),
    ("15.00", "so it is 15", True),
    ("1500", "That makes 1,500 apples.", True),
    ("15", "Check your addition; 150 is too big and 1.5 too small.", False),
    ("15", "Check your calculation carefully.", False),
    ("-3", "Subtract: 10-3 again.", False),  # "10-3" is a subtraction, not the number -3
    ("-3", "You should get -3.", True),
    ("\\frac{1}{2}", "It simplifies to \\frac{1}{ 2 }.", True),
    ("\\frac{1}{2}", "Simplify the fraction.", False),
    ("x", "Solve for x carefully.", True),  # a whole token: counts
    ("x", "Re-examine the next step.", False),  # not inside words
    # spelled out: a writer penalised for digits must not escape by writing words
    ("15", "So it comes to fifteen in all.", True),
    ("21", "You should end with twenty-one.", True),
    ("105", "That is one hundred and five.", True),
    ("1234", "It totals one thousand two hundred thirty-four.", True),
    ("9", "The answer is nine.", True),
    ("2", "Subtract: it equals two.", True),
    ("2", "Compare the two numbers again.", False),  # small number words are prose without an answer cue
    ("23", "Check the twenty and the three separately.", False),  # two numbers, neither 23
    ("50", "Fifteen is wrong.", False),
])
def test_answer_leaked(gold, feedback, leaked):
    assert answer_leaked(gold, feedback, "What is 7 + 8?", "math500") is leaked


def test_not_measured_for_code_tasks_empty_golds_and_golds_the_question_gives():
    assert answer_leaked("def f(x):\n    return x", "def f(x):\n    return x", "Write f.", "mbpp") is None
    assert answer_leaked("", "anything", "q", "arith") is None
    # "reread_question" repeats the question's numbers: no giveaway when the gold is one of them
    assert answer_leaked("15", "It has 15 apples at the start.", "Ana has 15 apples, buys 3, loses 3.", "arith") is None


@pytest.mark.parametrize("text, values", [
    ("twenty-one apples and forty two pears", [21, 42]),
    ("one hundred and five, then ninety-nine", [105, 99]),
    ("seventeen and three", [17]),  # "three" below ten and after no answer cue
    ("the sum is three", [3]),
    ("one of the two steps", []),
    ("Twenty twenty", [20, 20]),
    ("one hundred thousand and twelve", [100012]),
])
def test_spelled_numbers_in(text, values):
    assert spelled_numbers_in(text) == values


def test_a_gold_the_question_spells_is_not_measured():
    assert answer_leaked("15", "Start from fifteen apples.", "Ana has fifteen apples and buys none.", "arith") is None
    assert answer_leaked("3", "Three is what you add.", "Add three to nothing.", "arith") is None


def _episode(i: int, feedback: str, task: str = "arith", answer: str = "15") -> Episode:
    p = Problem(task, f"p{i}", "What is 7 + 8?", answer, "train", {})
    ep = Episode(f"p{i}/s0", p, 0)
    ep.turns = [Turn(0, 0, "solver", "solve", [1], [2], [-0.1], "stop", "14", reward=0.0, correct=False, extracted="14"),
                Turn(1, 1, "writer", "feedback", [1], [2], [-0.1], "stop", feedback, strategy=0, strategy_name="s"),
                Turn(2, 1, "solver", "refine", [1], [2], [-0.1], "stop", "15", reward=1.0, correct=True, extracted="15")]
    return ep


def test_leak_rate_is_over_measured_feedback_and_reaches_the_summary():
    eps = [_episode(0, "The answer is 15."), _episode(1, "Recheck 7 + 8."), _episode(2, "x", task="mbpp")]
    assert leak_rate(eps) == 0.5
    assert summarize(eps)["leak_rate"] == 0.5
    assert leak_rate(eps[2:]) is None and "leak_rate" not in summarize(eps[2:])
