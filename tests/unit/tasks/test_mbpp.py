"""Tests for the MBPP task: loading and validation, code extraction, and verification.

The reference-solution test verifies ALL 500 test-split rows in the sandbox (about 20 s
on 2 cores with 2 threads). Data tests skip when the shared data folder ($TOSCA_MLMT_DATA
or ../shared/data) is absent.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tosca_mlmt.errors import ConfigError, DataError
from tosca_mlmt.tasks.base import Problem
from tosca_mlmt.tasks.mbpp import MBPPTask, default_data_path, extract_code
from tosca_mlmt.tasks.sandbox import SANDBOX_VERSION, sandbox_mode

DATA = default_data_path()
needs_data = pytest.mark.skipif(
    not (DATA / "mbpp" / "mbpp.jsonl").is_file(),
    reason=f"shared data not found at {DATA}/mbpp/mbpp.jsonl (set TOSCA_MLMT_DATA to the data folder)",
)

ADD = Problem(
    task="mbpp",
    id="mbpp-synthetic-add",
    question="Write a function to add two numbers.",
    answer="def add(a, b):\n    return a + b\n",
    split="test",
    meta={"tests": ["assert add(2, 2) == 4", "assert add(1, 2) == 3", "assert add(0, 0) == 0"], "setup": ""},
)

GOOD_ROW = {
    "task_id": 11,
    "text": "Write a function to add two numbers.",
    "code": "def add(a, b):\n    return a + b",
    "test_setup_code": "",
    "test_list": ["assert add(1, 2) == 3"],
    "challenge_test_list": [],
}


def _fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


# --- extraction ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("```python\ndef a(): pass\n```\ntext\n```python\ndef b(): pass\n```", "def b(): pass\n"),  # last block
        ("```\ndef f(): pass\n```", "def f(): pass\n"),  # untagged fence
        ("```py\ndef f(): pass\n```", "def f(): pass\n"),
        ("```python\ndef f(): pass\n```\nUsage:\n```python\nprint(f())\n```", "def f(): pass\n"),  # usage block
        ("```python\nimport math\n```", "import math\n"),  # no def anywhere: still the last block
        ("```text\ndef nope(): pass\n```\n```python\ndef f(): pass\n```", "def f(): pass\n"),  # other language
        ("```python\ndef f():\n    return 1", "def f():\n    return 1"),  # truncated, never closed
        ("def f(x):\n    return x", "def f(x):\n    return x"),  # bare code
        ("The answer is to add them.", None),
        ("```python\n\n```", None),
    ],
)
def test_extract_code(response, expected):
    assert extract_code(response) == expected


# --- verification (no data needed) -------------------------------------------------


def test_versions_and_name():
    task = MBPPTask()
    assert task.name == "mbpp"
    # The manifest records whether code ran under bubblewrap or the in-process fallback.
    assert task.verifier_version == f"mbpp-v1+{SANDBOX_VERSION}+{sandbox_mode()}"


def test_verify_correct_and_partial():
    task = MBPPTask()
    good = task.verify(ADD, _fenced(ADD.answer))
    assert (good.correct, good.reward) == (True, 1.0)
    assert good.info == {"pass_rate": 1.0, "timed_out": False, "passed": 3, "total": 3, "forged": False}
    assert good.extracted == ADD.answer + "\n" and good.feedback_context == ""

    bad = task.verify(ADD, _fenced("def add(a, b):\n    return a * b"))
    assert (bad.correct, bad.reward) == (False, 0.0)
    assert bad.info["passed"] == 2 and bad.info["pass_rate"] == pytest.approx(2 / 3)
    assert "assert add(1, 2) == 3" in bad.feedback_context and "AssertionError" in bad.feedback_context


def test_verify_without_code_gives_zero_and_says_why():
    verdict = MBPPTask().verify(ADD, "I think you should add the two numbers.")
    assert (verdict.correct, verdict.reward, verdict.extracted) == (False, 0.0, None)
    assert verdict.info == {"pass_rate": 0.0, "timed_out": False, "passed": 0, "total": 3, "forged": False}
    assert "no code block found" in verdict.feedback_context


def test_verify_timeout_is_reported():
    task = MBPPTask()
    task.timeout_s = 1.0
    verdict = task.verify(ADD, _fenced("def add(a, b):\n    while True:\n        pass"))
    assert verdict.reward == 0.0 and verdict.info["timed_out"] is True
    assert verdict.feedback_context == "timeout"


def test_reward_forgeries_score_zero_and_are_flagged():
    # An object equal to everything meets the parent's comparison as an opaque value.
    always_equal = "class Yes:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Yes()"
    verdict = MBPPTask().verify(ADD, _fenced(always_equal))
    assert (verdict.reward, verdict.info["passed"], verdict.info["forged"]) == (0.0, 0, False)
    # Calling the runner's reporter directly is seen in the result channel: flagged, 0.
    reporter = (
        "import gc\n"
        "for fn in [o for o in gc.get_objects() if getattr(o, '__name__', '') == 'report']:\n"
        "    for i in range(3):\n"
        "        fn({'kind': 'test', 'i': i, 'ok': True, 'err': '', 'values': []})\n"
        "def add(a, b):\n    return 0"
    )
    verdict = MBPPTask().verify(ADD, _fenced(reporter))
    assert (verdict.reward, verdict.correct, verdict.info["forged"]) == (0.0, False, True)
    assert "forged result records" in verdict.feedback_context


def test_verify_traceback_reaches_feedback():
    verdict = MBPPTask().verify(ADD, _fenced("def add(a, b):\n    return a + c"))
    assert "NameError" in verdict.feedback_context and "return a + c" in verdict.feedback_context


def test_instruction_shows_task_example_and_format():
    text = MBPPTask().instruction(ADD)
    assert ADD.question in text
    assert "assert add(2, 2) == 4" in text and "assert add(1, 2) == 3" not in text
    assert "Write the Python function in a ```python code block." in text


# --- loading and validation --------------------------------------------------------


def _write_rows(tmp_path, lines: list[str]):
    path = tmp_path / "mbpp" / "mbpp.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("bad_line", "field"),
    [
        ('{"task_id": 12, "text": ', "<row>"),
        (json.dumps([1, 2]), "<row>"),
        (json.dumps({k: v for k, v in GOOD_ROW.items() if k != "task_id"}), "task_id"),
        (json.dumps({**GOOD_ROW, "task_id": "12"}), "task_id"),
        (json.dumps({**GOOD_ROW, "task_id": 11}), "task_id"),  # duplicate of line 1
        (json.dumps({**GOOD_ROW, "task_id": 12, "text": ""}), "text"),
        (json.dumps({k: v for k, v in {**GOOD_ROW, "task_id": 12}.items() if k != "code"}), "code"),
        (json.dumps({k: v for k, v in {**GOOD_ROW, "task_id": 12}.items() if k != "test_list"}), "test_list"),
        (json.dumps({**GOOD_ROW, "task_id": 12, "test_list": []}), "test_list"),
        (json.dumps({**GOOD_ROW, "task_id": 12, "test_list": "assert True"}), "test_list"),
        (json.dumps({**GOOD_ROW, "task_id": 12, "test_list": ["assert True", 3]}), "test_list"),
        (json.dumps({**GOOD_ROW, "task_id": 12, "test_setup_code": None}), "test_setup_code"),
        # issue 68: a row no code could pass honestly, or that every code passes
        (json.dumps({**GOOD_ROW, "task_id": 12, "test_list": ["print('hello')"]}), "test_list"),
        (json.dumps({**GOOD_ROW, "task_id": 12, "test_list": ["assert add(1, 2) == 3", "x = 1"]}), "test_list"),
        (json.dumps({**GOOD_ROW, "task_id": 12, "test_list": ["assert add(1, 2) == 3", "assert add(1,"]}), "test_list"),
        (json.dumps({**GOOD_ROW, "task_id": 12, "test_setup_code": "def broken(:"}), "test_setup_code"),
        (json.dumps({**GOOD_ROW, "task_id": 12, "test_setup_code": "D = [(1, 3)]",
                     "test_list": ["assert all(add(a, 2) == b for a, b in D)"]}), "test_list"),
    ],
)
def test_malformed_row_raises_data_error_naming_file_line_field(tmp_path, bad_line, field):
    path = _write_rows(tmp_path, [json.dumps(GOOD_ROW), "", bad_line])
    task = MBPPTask(str(tmp_path))
    with pytest.raises(DataError) as info:
        task.load("test")
    assert (info.value.path, info.value.line, info.value.field) == (str(path), 3, field)
    assert f"{path}:3" in str(info.value) and f"'{field}'" in str(info.value)

    res = task.load("test", skip_bad_rows=True)
    assert res.skipped_rows == 1 and [p.id for p in res.problems] == ["mbpp-11"]


def test_load_builds_problems_from_rows(tmp_path):
    rows = [{**GOOD_ROW, "task_id": i, "test_setup_code": f"x = {i}"} for i in (700, 11, 510, 511, 5, 974)]
    _write_rows(tmp_path, [json.dumps(r) for r in rows])
    task = MBPPTask(str(tmp_path))
    test = task.load("test").problems
    assert [p.id for p in test] == ["mbpp-11", "mbpp-510"]  # sorted by task_id
    assert [p.id for p in task.load("train").problems] == ["mbpp-700", "mbpp-974"]
    first = test[0]
    assert (first.task, first.split) == ("mbpp", "test")
    assert (first.question, first.answer) == (GOOD_ROW["text"], GOOD_ROW["code"])
    assert first.meta == {"tests": GOOD_ROW["test_list"], "setup": "x = 11"}
    assert [p.id for p in task.load("test", limit=1).problems] == ["mbpp-11"]


def test_bad_split_limit_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="invalid split"):
        MBPPTask(str(tmp_path)).load("validation")
    with pytest.raises(ConfigError, match="data file not found"):
        MBPPTask(str(tmp_path)).load("test")
    _write_rows(tmp_path, [json.dumps(GOOD_ROW)])
    with pytest.raises(ConfigError, match="invalid limit"):
        MBPPTask(str(tmp_path)).load("test", limit=-1)


def test_data_path_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TOSCA_MLMT_DATA", str(tmp_path))
    assert MBPPTask().path == tmp_path / "mbpp" / "mbpp.jsonl"


# --- the real data set -------------------------------------------------------------


@needs_data
def test_ids_are_stable_and_splits_disjoint():
    task = MBPPTask()
    train, test = task.load("train").problems, task.load("test").problems
    assert len(train) == 374 and len(test) == 500
    assert [p.id for p in test] == [p.id for p in MBPPTask().load("test").problems]
    assert {p.id for p in test} == {f"mbpp-{i}" for i in range(11, 511)}
    assert {p.id for p in train} == {f"mbpp-{i}" for i in range(601, 975)}
    assert not {p.id for p in train} & {p.id for p in test}
    assert all(p.split == "train" for p in train) and all(p.split == "test" for p in test)


@needs_data
def test_reference_solutions_pass(capsys):
    task = MBPPTask()
    problems = task.load("test").problems
    with ThreadPoolExecutor(max_workers=2) as pool:
        verdicts = list(pool.map(lambda p: task.verify(p, _fenced(p.answer)), problems))
    failures = [(p.id, v.feedback_context) for p, v in zip(problems, verdicts) if v.reward != 1.0]
    with capsys.disabled():
        print(f"\nMBPP test split: {len(problems) - len(failures)}/{len(problems)} reference solutions pass")
        for pid, why in failures:
            print(f"  {pid}: {why.splitlines()[-1] if why else '?'}")
    assert (len(problems) - len(failures)) / len(problems) >= 0.98


@needs_data
def test_reference_code_of_another_task_fails():
    task = MBPPTask()
    problems = task.load("test", limit=21).problems
    for problem, other in zip(problems[:20], problems[1:]):
        verdict = task.verify(problem, _fenced(other.answer))
        assert verdict.reward == 0.0 and not verdict.correct, problem.id
