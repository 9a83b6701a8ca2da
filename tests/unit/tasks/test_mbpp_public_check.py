"""mbpp's check_attempt: the attempt's code against the public test its instruction shows, never the grading run."""

from __future__ import annotations

import pytest

from tosca_mlmt.leak import answer_leaked
from tosca_mlmt.tasks import mbpp
from tosca_mlmt.tasks.base import Problem
from tosca_mlmt.tasks.mbpp import MBPPTask

ADD = Problem("mbpp", "mbpp-synthetic-add", "Write a function to add two numbers.", "def add(a, b):\n    return a + b\n",
              "test", {"tests": ["assert add(2, 2) == 4", "assert add(1, 2) == 3", "assert add(0, 0) == 0"],
                       "setup": ""})
# passes the public test (2 + 2), fails the grading tests after it
DOUBLES = "```python\ndef add(a, b):\n    return 2 * a\n```"
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"


def test_only_the_test_the_instruction_shows_is_run(monkeypatch):
    task, ran = MBPPTask(), []
    real = mbpp.run_python

    def spy(code, tests, **kw):
        ran.append(list(tests))
        return real(code, tests, **kw)

    monkeypatch.setattr(mbpp, "run_python", spy)
    report = task.check_attempt(ADD, DOUBLES)
    assert ran == [["assert add(2, 2) == 4"]] and "assert add(2, 2) == 4" in task.instruction(ADD)
    assert not report.flagged and report.passed and report.features() == (0.0, 0.0, 0.0)
    assert not task.verify(ADD, DOUBLES).correct  # the grading tests it never ran would fail it


def test_a_failing_public_test_and_missing_code_are_flagged():
    task = MBPPTask()
    failing = task.check_attempt(ADD, WRONG)
    assert failing.flagged and failing.features() == (1.0, 0.0, 1.0) and "add(2, 2)" in failing.error
    assert "add(1, 2)" not in failing.describe() and failing.describe().startswith("Public test check: the example")
    none = task.check_attempt(ADD, "I would add them.")
    assert none.flagged and none.features() == (1.0, 1.0, 0.0) and none.describe() == "Public test check: no code to run."
    for report in (failing, none, task.check_attempt(ADD, DOUBLES)):
        assert report.to_json()["flagged"] == report.flagged
        assert answer_leaked(ADD.answer, report.hint(), ADD.question, "mbpp") is None  # code: not measured
        assert "return" not in report.hint() and "a + b" not in report.hint()


@pytest.mark.parametrize("response", [DOUBLES, WRONG])
def test_the_report_reads_no_gold(response):
    """Swapping the reference solution and the grading tests after the public one changes nothing."""
    other = Problem(ADD.task, ADD.id, ADD.question, "def add(a, b): return 0", "test",
                    {"tests": ADD.meta["tests"][:1] + ["assert add(5, 5) == 99"], "setup": ""})
    assert MBPPTask().check_attempt(ADD, response) == MBPPTask().check_attempt(other, response)
