"""Tests for the GSM8K / MATH-500 tasks and the math answer verifier.

The data-set tests run over ALL rows of gsm8k/test.jsonl (1319) and math500/test.jsonl
(500); together they take a few seconds because most golds match by cheap string or
numeric checks before math_verify is needed. They skip when the shared data folder
(resolved like the tasks do: $TOSCA_MLMT_DATA or ../shared/data) is absent.
"""

from __future__ import annotations

import json
import threading

import pytest

from tosca_mlmt.errors import ConfigError, DataError
from tosca_mlmt.tasks.math_tasks import GSM8KTask, Math500Task, default_data_path
from tosca_mlmt.tasks.mathverify import (
    VERIFIER_VERSION,
    extract_answer,
    extract_gold,
    is_equivalent,
    match_method,
)

DATA = default_data_path()
needs_data = pytest.mark.skipif(
    not (DATA / "gsm8k" / "test.jsonl").is_file() or not (DATA / "math500" / "test.jsonl").is_file(),
    reason=f"shared data not found at {DATA} (set TOSCA_MLMT_DATA to the data folder)",
)

# --- extraction -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("so $\\boxed{\\frac{1}{\\sqrt{2}}}$", "\\frac{1}{\\sqrt{2}}"),  # nested braces
        ("first \\boxed{1} then \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # last box; escaped braces
        ("\\fbox{7}", "7"),
        ("ok \\boxed{3} but then \\boxed{4", "3"),  # truncated last box -> previous balanced one
        ("Adding up gives 40 + 2.\nThe answer is: 42.", "42"),
        ("the answer is $-3.5$.", "-3.5"),  # case-insensitive, strips $ and period
        ("The answer is 1. Wait, recheck.\nThe answer is: 2", "2"),  # last occurrence
        ("total\n#### 1,234", "1234"),
        ("She has 3 apples, then 12 more, so 1,500 - 3 = 1,497 left", "1497"),  # last number
        ("The slope is -2/3 here", "-2/3"),
        ("it costs 0.75 dollars", "0.75"),
        ("10-3 gives 7", "7"),
        # an answer line's number alone: what follows is the solver's comment or a piece of the
        # next word the stop rule kept (math_verify read "12. Then 13" as 13)
        ("The answer is 12. Then 13", "12"),
        ("The answer is: 12. I hope it is correct.", "12"),
        ("The answer is: 12 (since 3 + 4 = 7)", "12"),
        ("The answer is: 25, but", "25"),
        ("The answer is 21 x", "21"),
        ("The answer is: **12**", "12"),
        ("The answer is 50%.", "50%"),
        # not a lone number: the whole line, as before
        ("The answer is 7 + 5 = 12", "7 + 5 = 12"),
        ("The answer is: 3, 4", "3, 4"),
        ("The answer is: 3:4", "3:4"),
        ("The answer is: 2\\sqrt{3}.", "2\\sqrt{3}"),
        ("The answer is: 3x+1", "3x+1"),
        # an empty last answer line: only what follows it is the answer (a turn cut at max_new_tokens
        # right after the cue wrote none; the 13 before it is reasoning, which v3 read as the answer)
        ("11 + 2 = 13 pencils\nThe answer is:", None),
        ("5 + 3 = 8. The answer is: \n", None),
        ("So the answer is:\n\n12.", "12"),
        ("no digits here at all", None),
        ("", None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize(
    ("answer_field", "expected"),
    [
        ("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18", "18"),
        ("So 1000 in all.\n#### 1,000", "1000"),
        ("Thus $\\boxed{\\frac{1}{2}}.$The answer is: \\frac{1}{2}", "\\frac{1}{2}"),
        ("Thus $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("boxed last: \\fbox{x^{2}}", "x^{2}"),
    ],
)
def test_extract_gold(answer_field, expected):
    assert extract_gold(answer_field) == expected


def test_extract_gold_without_answer_raises():
    with pytest.raises(ValueError):
        extract_gold("a solution that never states its result")


# --- equivalence ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("\\frac{1}{2}", "0.5"),
        ("1/2", "\\dfrac12"),
        ("3", "3.0"),
        ("1,234", "1234"),
        ("\\$32,\\!348", "32348"),
        ("90^\\circ", "90"),
        ("\\text{Evelyn}", "Evelyn"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
        ("18 dollars", "18"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("11 + 4 = 15", "15"),  # the result stated after the expression
        ("3/4", "0.75"),
        ("x+1", "x+1"),  # an expression gold: expressions still compare
    ],
)
def test_equivalent(pred, gold):
    assert is_equivalent(pred, gold)


@pytest.mark.parametrize(
    ("pred", "gold"),
    [("10", "11"), ("5x", "5"), ("2i", "2"), ("\\frac{1}{3}", "0.33"), ("", "1"), ("}{", "1"),
     # an unevaluated expression is no answer to a numeric gold: math_verify computed "11 + 2" to 13, so
     # restating the question's sum scored right, and it read "16 + 12 +" as 12
     ("11 + 2", "13"), ("16 + 12 +", "12"), ("10 - 4", "6"), ("3 × 4", "12")],
)
def test_not_equivalent(pred, gold):
    assert not is_equivalent(pred, gold)


def test_match_method_names_the_check():
    assert match_method("1,000", "1000") == "numeric"
    assert match_method("\\dfrac{1}{2}", "\\frac{1}{2}") == "string"
    assert match_method("\\frac{2}{4}", "0.5") == "math_verify"
    assert match_method("10", "11") is None


def test_math_verify_works_off_the_main_thread():
    # math_verify's SIGALRM timeout cannot be armed outside the main thread.
    results = []
    t = threading.Thread(target=lambda: results.append(match_method("\\frac{2}{4}", "0.5")))
    t.start()
    t.join()
    assert results == ["math_verify"]


# --- loading ----------------------------------------------------------------------


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


@pytest.mark.parametrize(
    ("bad_line", "field"),
    [
        ({"question": "q3", "answer": ""}, "answer"),
        ({"answer": "#### 3"}, "question"),
        ({"question": 3, "answer": "#### 3"}, "question"),
        ({"question": "q3", "answer": "no final answer"}, "answer"),
        ('{"question": "q3", "answer": ', "<row>"),
    ],
)
def test_malformed_row(tmp_path, bad_line, field):
    (tmp_path / "gsm8k").mkdir()
    good = [{"question": f"q{i}", "answer": f"{i} + 0 = {i}\n#### {i}"} for i in (1, 2, 4)]
    path = tmp_path / "gsm8k" / "test.jsonl"
    _write_jsonl(path, [good[0], good[1], bad_line, good[2]])
    task = GSM8KTask(str(tmp_path))

    with pytest.raises(DataError) as err:
        task.load("test")
    assert f"{path}:3" in str(err.value) and f"'{field}'" in str(err.value)
    assert (err.value.line, err.value.field) == (3, field)

    res = task.load("test", skip_bad_rows=True)
    assert res.skipped_rows == 1
    assert [p.id for p in res.problems] == ["gsm8k-test-00001", "gsm8k-test-00002", "gsm8k-test-00004"]
    assert [p.answer for p in res.problems] == ["1", "2", "4"]


def test_bad_split_limit_and_missing_file(tmp_path):
    task = GSM8KTask(str(tmp_path))
    with pytest.raises(ConfigError):
        task.load("validation")
    with pytest.raises(ConfigError):
        task.load("test")  # no file there
    with pytest.raises(ConfigError):
        task.load("test", limit=-1)


def test_data_path_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TOSCA_MLMT_DATA", str(tmp_path))
    assert GSM8KTask().data_path == tmp_path


# --- real data sets ---------------------------------------------------------------


@pytest.fixture(scope="module")
def gsm8k():
    return GSM8KTask()


@pytest.fixture(scope="module")
def math500():
    return Math500Task()


@pytest.fixture(scope="module")
def all_test_problems(gsm8k, math500):
    # MATH-500's own file is split train/test by us; both halves come from its test file.
    return {
        "gsm8k": (gsm8k, gsm8k.load("test").problems),
        "math500": (math500, math500.load("train").problems + math500.load("test").problems),
    }


@needs_data
@pytest.mark.parametrize("name", ["gsm8k", "math500"])
def test_own_solution_is_correct(all_test_problems, name):
    task, problems = all_test_problems[name]
    assert len(problems) == {"gsm8k": 1319, "math500": 500}[name]
    misses = [p.id for p in problems if not task.verify(p, p.meta["solution"]).correct]
    assert len(misses) <= 0.01 * len(problems), misses[:20]


@needs_data
@pytest.mark.parametrize("name", ["gsm8k", "math500"])
def test_other_rows_solution_is_wrong(all_test_problems, name):
    task, problems = all_test_problems[name]
    pairs = [(p, q) for p, q in zip(problems, problems[1:]) if p.answer != q.answer]
    assert len(pairs) > 0.9 * len(problems)
    accepted = [
        (p.id, p.answer, q.answer) for p, q in pairs if task.verify(p, q.meta["solution"]).correct
    ]
    assert len(accepted) <= 0.01 * len(pairs), accepted[:20]


@needs_data
def test_verdict_fields(gsm8k, math500):
    p = gsm8k.load("test", limit=1).problems[0]
    assert (p.task, p.id, p.split, p.answer) == ("gsm8k", "gsm8k-test-00001", "test", "18")
    assert "The answer is:" in gsm8k.instruction(p) and p.question in gsm8k.instruction(p)
    good = gsm8k.verify(p, "9 eggs at $2 each.\nThe answer is: $18.")
    assert (good.correct, good.reward, good.extracted) == (True, 1.0, "18")
    assert good.info == {"method": "string"}
    bad = gsm8k.verify(p, "I do not know")
    assert (bad.correct, bad.reward, bad.extracted, bad.info) == (False, 0.0, None, {"method": None})

    m = math500.load("test", limit=1).problems[0]
    assert "\\boxed{answer}" in math500.instruction(m)
    assert math500.verify(m, f"so $\\boxed{{{m.answer}}}$").correct
    assert gsm8k.verifier_version == math500.verifier_version == VERIFIER_VERSION
    assert (gsm8k.name, math500.name) == ("gsm8k", "math500")


@needs_data
@pytest.mark.parametrize("task_cls", [GSM8KTask, Math500Task])
def test_ids_stable_and_splits_disjoint(task_cls):
    first = {s: task_cls().load(s).problems for s in ("train", "test")}
    second = {s: task_cls().load(s).problems for s in ("train", "test")}
    for split in ("train", "test"):
        assert [p.id for p in first[split]] == [p.id for p in second[split]]
        assert [p.question for p in first[split]] == [p.question for p in second[split]]
        assert len({p.id for p in first[split]}) == len(first[split])
        assert all(p.split == split for p in first[split])
    train, test = first["train"], first["test"]
    assert not {p.id for p in train} & {p.id for p in test}
    assert not {p.question for p in train} & {p.question for p in test}
    assert train and test


@needs_data
def test_math500_split_is_about_80_20_and_limit_keeps_file_order(math500):
    n_train, n_test = len(math500.load("train").problems), len(math500.load("test").problems)
    assert n_train + n_test == 500
    assert 0.12 < n_test / 500 < 0.28
    head = math500.load("test", limit=5).problems
    assert head == math500.load("test").problems[:5]
    assert [p.id for p in head] == sorted(p.id for p in head)
    assert math500.load("test", limit=0).problems == []
