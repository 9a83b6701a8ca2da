"""Rows and gold answers are validated where the data is loaded (issue 68, point 6): a gold answer must be
a finite, non-empty value the verifier can compare; a row with a key given twice, an id holding a line
break and a key mapping that makes the question its own answer are refused with the row (or field)
named; under --skip-bad-rows the bad rows are dropped and counted. No model."""

import json
from pathlib import Path

import pytest

from tosca_mlmt.config import load_config
from tosca_mlmt.config.load import parse_override
from tosca_mlmt.errors import ConfigError, DataError
from tosca_mlmt.tasks import make_task
from tosca_mlmt.tasks.math_tasks import GSM8KTask, Math500Task

GOOD = {"question": "What is 40 + 2?", "answer": "42"}


def _write(path: Path, rows: list) -> Path:
    """Rows as JSONL; a str row is written as it is (JSON that json.dumps would not write)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _jsonl(path: Path, **over):
    return make_task(load_config(overrides={"task.name": "jsonl", "task.path": str(path),
                                            "task.test_fraction": 0.0, **over}).task)


def _refused(task, path: Path, line: int, field: str, why: str, good_rows: int = 1):
    """The load fails naming path:line and the field; with skip_bad_rows the row is dropped and counted."""
    with pytest.raises(DataError) as e:
        task.load("train")
    assert str(e.value).startswith(f"{path}:{line}: field '{field}': "), str(e.value)
    assert why in str(e.value), str(e.value)
    res = task.load("train", skip_bad_rows=True)
    assert res.skipped_rows == 1 and len(res.problems) == good_rows
    return res


# ------------------------------------------------------------------ jsonl: gold answers


@pytest.mark.parametrize("answer", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_non_finite_json_number_is_no_gold_answer(tmp_path, answer):
    """json.loads reads NaN/Infinity (and 1e400 overflows to inf): the gold used to be the text 'nan' or
    'inf', and "The answer is: nan" scored correct."""
    f = _write(tmp_path / "d.jsonl", [GOOD, f'{{"question": "What is 0/0?", "answer": {answer}}}'])
    _refused(_jsonl(f), f, 2, "answer", "finite number")


@pytest.mark.parametrize("fmt, answer", [("raw", "nan"), ("auto", "inf"), ("hash", "so #### NaN"),
                                         ("auto", "The answer is: Infinity"), ("auto", "1e400"),
                                         ("raw", "9" * 400)])
def test_a_gold_text_that_reads_as_a_non_finite_number_is_refused(tmp_path, fmt, answer):
    """Every non-finite number compares equal to every other: 'inf' (or a 400-digit integer, inf as a float)
    is no gold answer."""
    f = _write(tmp_path / "d.jsonl", [{**GOOD, "answer": "#### 42"}, {"question": "q", "answer": answer}])
    _refused(_jsonl(f, **{"task.answer_format": fmt}), f, 2, "answer", "not a finite number")


@pytest.mark.parametrize("answer", ["steps ####", "steps #### ", "work \\boxed{}", "\\boxed{ }", "The answer is:"])
def test_a_marked_but_empty_final_answer_is_refused_not_taken_whole(tmp_path, answer):
    """answer_format auto used to fall back to the whole field when the '####' / \\boxed{} / 'The answer is'
    it found was empty: gold 'steps ####', gold '\\boxed{}'."""
    f = _write(tmp_path / "d.jsonl", [GOOD, {"question": "q", "answer": answer}])
    _refused(_jsonl(f), f, 2, "answer", "no final answer")


def test_a_gold_with_nothing_to_compare_is_refused(tmp_path):
    f = _write(tmp_path / "d.jsonl", [GOOD, {"question": "q", "answer": "$ $"}])
    _refused(_jsonl(f, **{"task.answer_format": "raw"}), f, 2, "answer", "nothing to compare")


def test_full_width_digits_are_folded_to_ascii_in_the_gold(tmp_path):
    """'４２' (full-width, as CJK input methods write) is the number 42: the gold is stored as '42', what the
    verifier, the leak check and the feedback writer compare; 'x²' keeps its superscript (not NFKC)."""
    f = _write(tmp_path / "d.jsonl", [{"question": "q1", "answer": "\uff14\uff12"},
                                      {"question": "q2", "answer": "#### \uff0d\uff17"},
                                      {"question": "q3", "answer": "x\u00b2"}])
    t = _jsonl(f)
    p1, p2, p3 = t.load("train").problems
    assert (p1.answer, p2.answer, p3.answer) == ("42", "-7", "x\u00b2")
    assert t.verify(p1, "The answer is: 42").correct and not t.verify(p1, "The answer is: 24").correct


# ------------------------------------------------------------------ jsonl: rows and ids


def test_a_key_given_twice_in_a_row_is_refused_naming_it(tmp_path):
    """json.loads keeps the last of two equal keys silently: which answer the row meant is unknowable."""
    f = _write(tmp_path / "d.jsonl", [GOOD, '{"question": "q", "answer": "1", "answer": "2"}'])
    _refused(_jsonl(f), f, 2, "answer", "appears twice")


def test_an_id_with_a_line_break_is_refused(tmp_path):
    f = _write(tmp_path / "d.jsonl", [{**GOOD, "uid": "a"}, {"question": "q", "answer": "1", "uid": "b\nc"}])
    _refused(_jsonl(f, **{"task.id_key": "uid"}), f, 2, "uid", "line-break")
    f = _write(tmp_path / "e.jsonl", [{**GOOD, "uid": "a"}, {"question": "q", "answer": "1", "uid": "b\x1b[2Jc"}])
    _refused(_jsonl(f, **{"task.id_key": "uid"}), f, 2, "uid", "control")


def test_answer_key_equal_to_question_key_is_refused_at_config_load(tmp_path):
    f = _write(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(ConfigError, match=r"field 'task\.answer_key': 'question' is also task\.question_key"):
        load_config(overrides={"task.name": "jsonl", "task.path": str(f), "task.answer_key": "question"})
    with pytest.raises(ConfigError, match=r"field 'task\.id_key': 'answer' is also task\.answer_key"):
        load_config(overrides={"task.name": "jsonl", "task.path": str(f), "task.id_key": "answer"})


def test_bad_rows_of_every_kind_are_dropped_and_counted(tmp_path):
    f = _write(tmp_path / "d.jsonl", [GOOD, '{"question": "a", "answer": NaN}', {"question": "b", "answer": "x ####"},
                                      '{"question": "c", "question": "d", "answer": "1"}',
                                      {"question": "e", "answer": "\\boxed{}"}, {"question": "f", "answer": "7"}])
    res = _jsonl(f).load("train", skip_bad_rows=True)
    assert res.skipped_rows == 4 and [p.answer for p in res.problems] == ["42", "7"]


# ------------------------------------------------------------------ gsm8k and math500


def _gsm8k(tmp_path, bad) -> tuple[GSM8KTask, Path]:
    path = _write(tmp_path / "gsm8k" / "train.jsonl", [{"question": "q1", "answer": "1 + 1 = 2\n#### 2"}, bad])
    return GSM8KTask(str(tmp_path)), path


@pytest.mark.parametrize("answer, why", [("so #### banana", "is not a number"), ("#### nan", "not a finite number"),
                                         ("#### inf", "not a finite number"), ("#### " + "9" * 400, "finite")])
def test_a_gsm8k_gold_must_be_a_finite_number(tmp_path, answer, why):
    task, path = _gsm8k(tmp_path, {"question": "q2", "answer": answer})
    _refused(task, path, 2, "answer", why)


def test_a_gsm8k_row_with_a_key_twice_is_refused(tmp_path):
    task, path = _gsm8k(tmp_path, '{"question": "q2", "answer": "#### 1", "answer": "#### 2"}')
    _refused(task, path, 2, "answer", "appears twice")


def test_a_gsm8k_full_width_gold_is_folded(tmp_path):
    task, _ = _gsm8k(tmp_path, {"question": "q2", "answer": "#### \uff11\uff12"})
    assert [p.answer for p in task.load("train").problems] == ["2", "12"]


def test_a_math500_gold_that_is_not_finite_is_refused(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"so \\boxed{{{i}}}"} for i in range(40)]
    path = _write(tmp_path / "math500" / "test.jsonl", rows + [{"question": "bad", "answer": "\\boxed{nan}"}])
    task = Math500Task(str(tmp_path))
    with pytest.raises(DataError, match=rf"{path}:41: field 'answer': unusable gold answer: 'nan' is not a finite"):
        task.load("train")
    assert task.load("train", skip_bad_rows=True).skipped_rows == 1


# ------------------------------------------------------------------ YAML 1.1 base 60


def test_yaml_base_60_is_kept_as_the_text_written(tmp_path):
    """YAML 1.1 reads 1:30 as the integer 90; a config means the text (a field that wants a number then
    names it)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("task:\n  name: jsonl\n  path: %s\n  answer_key: 1:30\n" % _write(tmp_path / "d.jsonl", [GOOD]))
    assert load_config(cfg).task.answer_key == "1:30"
    assert parse_override("task.id_key=1:30") == ("task.id_key", "1:30")
    key, value = parse_override("task.limit=1:30")
    with pytest.raises(ConfigError, match=r"field 'task\.limit' must be an integer, got '1:30'"):
        load_config(overrides={key: value})
