"""MBPP (Mostly Basic Python Problems): write a function that passes assert-style tests.

Splits follow the usual MBPP convention by ``task_id``: 601-974 train, 11-510 test; the
validation (511-600) and few-shot (1-10) ids are not used. A response is scored by
running the code it contains against the row's tests in :mod:`tosca_mlmt.tasks.sandbox`.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tosca_mlmt.errors import ConfigError, DataError
from tosca_mlmt.tasks.base import (DATA_ENV_VAR, LoadResult, Problem, Verdict, check_split, check_text, decode_line,
                                    default_data_path, no_problems, parse_json_line, read_lines, short_repr)
from tosca_mlmt.tasks.sandbox import Planner, clean_text, run_python, sandbox_fingerprint

DATA_FILE = Path("mbpp") / "mbpp.jsonl"
SPLIT_IDS = {"train": range(601, 975), "test": range(11, 511)}

# An opening fence with an optional language tag, then everything up to the closing
# fence, or to the end of the text when a truncated generation never closed it.
_FENCE_RE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"", "python", "python3", "py"}
NO_CODE_FEEDBACK = "no code block found: the response has no ```python block and no function definition"


def extract_code(response: str) -> str | None:
    """The code in a response: the last fenced Python (or untagged) block that defines
    something, else the last such block; an unfenced response counts if it has a ``def``.

    Preferring a block with ``def`` keeps a trailing usage example from replacing the
    solution it demonstrates.
    """
    blocks = [m.group(2) for m in _FENCE_RE.finditer(response) if m.group(1).lower() in _PYTHON_TAGS]
    blocks = [b for b in blocks if b.strip()]
    if blocks:
        defining = [b for b in blocks if "def " in b]
        return (defining or blocks)[-1]
    return response if "def " in response else None


@dataclass(frozen=True)
class PublicTestReport:
    """MBPP's own check of an attempt (``check_attempt``): its code run against the one test the instruction
    shows, never the grading run, so what it says is what the student could learn by running the example."""

    code_found: bool
    passed: bool
    error: str  # the sandbox's error on the public test ("" when it passed or no code was found)

    @property
    def flagged(self) -> bool:
        return not self.passed

    def features(self) -> tuple[float, float, float]:
        """(flagged, no code found, the public test fails)."""
        return float(self.flagged), float(not self.code_found), float(self.code_found and not self.passed)

    def to_json(self) -> dict:
        return {"flagged": self.flagged, "code_found": self.code_found, "passed": self.passed, "error": self.error}

    def describe(self) -> str:
        if not self.code_found:
            return "Public test check: no code to run."
        if self.passed:
            return "Public test check: the example test from the question passes."
        return f"Public test check: the example test from the question fails: {self.error}"

    def hint(self) -> str:
        if not self.code_found:
            return "Write your solution as a Python function in a ```python code block."
        if self.passed:
            return "Your code passes the example test; check the other cases the question describes."
        return "Your code fails the example test in the question; trace it by hand on that input."


class MBPPTask:
    name = "mbpp"
    # Per response, all tests together. Reference solutions take milliseconds except
    # mbpp-123 (about 4.5 s on one core, which times out when cores are shared).
    timeout_s = 5.0

    def __init__(self, data_path: str | None = None):
        """``data_path``: the data folder holding ``mbpp/mbpp.jsonl``."""
        self.data_path = Path(data_path) if data_path is not None else default_data_path()
        self.path = self.data_path / DATA_FILE

    @property
    def verifier_version(self) -> str:
        # Includes the sandbox's mode, so a manifest says whether code ran under real
        # isolation or the in-process fallback. Computed on use: it probes bubblewrap once.
        return f"mbpp-v1+{sandbox_fingerprint()}"

    def load(self, split: str, limit: int | None = None, skip_bad_rows: bool = False) -> LoadResult:
        check_split(split)
        if limit is not None and limit < 0:
            raise ConfigError(f"invalid limit {limit}; must be >= 0")
        if not self.path.is_file():
            raise ConfigError(f"data file not found: {self.path} (set {DATA_ENV_VAR} to the data folder)")
        rows: list[dict[str, Any]] = []
        seen: set[int] = set()
        skipped = 0
        for line_no, raw in read_lines(self.path):
            try:
                line = decode_line(self.path, line_no, raw)
                if not line.strip():
                    continue
                row = _parse_row(str(self.path), line_no, line)
                if row["task_id"] in seen:
                    raise DataError(str(self.path), line_no, "task_id", f"duplicate task_id {row['task_id']}")
            except DataError:
                if not skip_bad_rows:
                    raise
                skipped += 1
                continue
            seen.add(row["task_id"])
            if row["task_id"] in SPLIT_IDS[split]:
                rows.append(row)
        if not rows:
            ids = SPLIT_IDS[split]
            raise no_problems(self.path, skipped, f"none of its {len(seen)} valid row(s) has a {split} task_id "
                                                  f"({ids.start}-{ids.stop - 1})" if seen else "")
        rows.sort(key=lambda r: r["task_id"])
        problems = [_to_problem(r, split) for r in rows[:limit]]
        return LoadResult(problems=problems, skipped_rows=skipped)

    def instruction(self, problem: Problem) -> str:
        example = problem.meta["tests"][0]
        return (
            f"{problem.question}\n\n"
            f"Your function will be checked with tests like this one:\n{example}\n\n"
            "Write the Python function in a ```python code block."
        )

    def check_attempt(self, problem: Problem, response: str) -> PublicTestReport:
        """The attempt's code against the public test only (the one ``instruction`` shows), in the sandbox."""
        code = extract_code(response)
        if code is None:
            return PublicTestReport(False, False, "")
        public = problem.meta["tests"][:1]
        result = run_python(code, public, setup=problem.meta.get("setup", ""), timeout_s=self.timeout_s)
        return PublicTestReport(True, result.all_passed, "" if result.all_passed else clean_text(result.error, 300))

    def verify(self, problem: Problem, response: str) -> Verdict:
        tests = problem.meta["tests"]
        code = extract_code(response)
        if code is None:
            return Verdict(
                correct=False,
                reward=0.0,
                extracted=None,
                info={"pass_rate": 0.0, "timed_out": False, "passed": 0, "total": len(tests), "forged": False},
                feedback_context=NO_CODE_FEEDBACK,
            )
        result = run_python(code, tests, setup=problem.meta.get("setup", ""), timeout_s=self.timeout_s)
        return Verdict(
            correct=result.all_passed,
            reward=1.0 if result.all_passed else 0.0,
            extracted=code,
            info={
                "pass_rate": result.pass_rate,
                "timed_out": result.timed_out,
                "passed": result.passed,
                "total": result.total,
                # The code tampered with the sandbox's result channel; it scored 0.
                "forged": bool(result.forgery),
            },
            feedback_context=result.error,
        )


def _parse_row(path: str, line_no: int, line: str) -> dict[str, Any]:
    """Parse and validate one jsonl line; errors name ``path:line_no`` and the field."""
    row = parse_json_line(Path(path), line_no, line)
    if not isinstance(row, dict):
        raise DataError(path, line_no, "<row>", "expected a JSON object")
    task_id = row.get("task_id")
    # bool is an int subclass; true/false is a data error, not task 1/0.
    if not isinstance(task_id, int) or isinstance(task_id, bool):
        raise DataError(path, line_no, "task_id", _reason(task_id, "an integer"))
    for field in ("text", "code"):
        value = row.get(field)
        if not isinstance(value, str) or not value.strip():
            raise DataError(path, line_no, field, _reason(value, "a non-empty string"))
    tests = row.get("test_list")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        raise DataError(path, line_no, "test_list", _reason(tests, "a non-empty list of non-empty strings"))
    if not isinstance(row.get("test_setup_code", ""), str):
        raise DataError(path, line_no, "test_setup_code", _reason(row["test_setup_code"], "a string"))
    for field in ("text", "code", "test_list", "test_setup_code"):
        for value in row.get(field, []) if field == "test_list" else [row.get(field, "")]:
            check_text(Path(path), line_no, field, value)
    _check_tests(path, line_no, row)
    return row


def _check_tests(path: str, line_no: int, row: dict[str, Any]) -> None:
    """Refuse tests no code could pass honestly or every code passes: a setup or test that does not
    parse, a test row that is not asserts (``print('hello')`` passed any code), or an assert whose
    comparison the sandbox could only judge inside the code's own process (sandbox/checks.py)."""
    where = f"task {row['task_id']}"
    try:
        ast.parse(row.get("test_setup_code", ""))
    except (SyntaxError, ValueError) as e:
        raise DataError(path, line_no, "test_setup_code", f"{where}: does not parse: {e}") from None
    planner = Planner("", row.get("test_setup_code", ""))
    for i, test in enumerate(row["test_list"]):
        try:
            body = ast.parse(test).body
        except (SyntaxError, ValueError) as e:
            raise DataError(path, line_no, "test_list", f"{where}, test {i}: does not parse: {e}") from None
        if not body or not all(isinstance(stmt, ast.Assert) for stmt in body):
            raise DataError(path, line_no, "test_list", f"{where}, test {i}: not an assert: {short_repr(test)}")
        problem = planner.plan(test).error
        if problem:
            raise DataError(path, line_no, "test_list", f"{where}, test {i}: {problem}")


def _reason(value: Any, expected: str) -> str:
    return "missing" if value is None else f"expected {expected}, got {short_repr(value)}"


def _to_problem(row: dict[str, Any], split: str) -> Problem:
    return Problem(
        task="mbpp",
        id=f"mbpp-{row['task_id']}",
        question=row["text"],
        answer=row["code"],
        split=split,
        meta={"tests": row["test_list"], "setup": row.get("test_setup_code", "")},
    )
