"""GSM8K and MATH-500: math word problems scored by final-answer equivalence.

Both read ``{"question", "answer"}`` JSONL files in place from the shared data folder.
Problem ids come from the 1-based line number in the source file, so they stay stable
across runs and machines as long as the file is unchanged.
"""

from __future__ import annotations

from pathlib import Path

from tosca_mlmt.errors import ConfigError, DataError
from tosca_mlmt.tasks.base import (DATA_ENV_VAR, LoadResult, Problem, Verdict, check_split, check_text, decode_line,
                                    default_data_path, no_problems, parse_json_line, read_lines, short_repr,
                                    stable_split)
from tosca_mlmt.tasks.mathverify import (ANSWER_FORMAT, ANSWER_LINE, VERIFIER_VERSION, answer_slot, echoes_format,
                                         extract_answer, extract_gold, fold_width, gold_problem, match_method)
from tosca_mlmt.tasks.steps import StepReport, check_steps



def _parse_row(path: Path, line_no: int, line: str, numeric: bool = False) -> tuple[str, str, str]:
    """(question, full solution, gold answer) of one JSONL line; DataError if malformed, or when the
    gold is no answer the verifier can compare (gold_problem; with ``numeric``, also when it is not a
    number: every GSM8K answer is one)."""
    row = parse_json_line(path, line_no, line)
    if not isinstance(row, dict):
        raise DataError(str(path), line_no, "<row>", "expected a JSON object")
    for field in ("question", "answer"):
        value = row.get(field)
        if not isinstance(value, str) or not value.strip():
            reason = "missing" if value is None else f"expected a non-empty string, got {short_repr(value)}"
            raise DataError(str(path), line_no, field, reason)
        check_text(path, line_no, field, value)
    try:
        gold = fold_width(extract_gold(row["answer"]))
    except ValueError as e:
        raise DataError(str(path), line_no, "answer", str(e)) from None
    bad = gold_problem(gold, numeric=numeric)
    if bad:
        raise DataError(str(path), line_no, "answer", f"unusable gold answer: {bad}")
    return row["question"], row["answer"], gold


def _read_rows(path: Path, skip_bad_rows: bool, numeric: bool = False) -> tuple[list[tuple[int, str, str, str]], int]:
    """Every valid row of ``path`` as (line_no, question, solution, gold), and the bad-row count.

    The whole file is validated (not just the rows a split or limit keeps), so a corrupt
    file fails the same way whichever split is asked for. Blank lines are ignored.
    """
    if not path.is_file():
        raise ConfigError(f"data file not found: {path} (set {DATA_ENV_VAR} to the data folder)")
    rows, skipped = [], 0
    for line_no, raw in read_lines(path):
        try:
            line = decode_line(path, line_no, raw)
            if not line.strip():
                continue
            rows.append((line_no, *_parse_row(path, line_no, line, numeric)))
        except DataError:
            if not skip_bad_rows:
                raise
            skipped += 1
    if not rows:
        raise no_problems(path, skipped)
    return rows, skipped


def _check_limit(limit: int | None) -> None:
    if limit is not None and limit < 0:
        raise ConfigError(f"invalid limit {limit}; must be >= 0")


class _MathTask:
    """Shared verification: extract the response's final answer and compare it to the gold."""

    name: str
    verifier_version = VERIFIER_VERSION

    def __init__(self, data_path: str | None = None):
        self.data_path = Path(data_path) if data_path is not None else default_data_path()

    def verify(self, problem: Problem, response: str) -> Verdict:
        if getattr(self, "answer_format", None) and echoes_format(response):
            return Verdict(False, 0.0, None, info={"method": None, "echo": True})
        extracted = extract_answer(response)
        method = match_method(extracted, problem.answer) if extracted is not None else None
        correct = method is not None
        return Verdict(correct, 1.0 if correct else 0.0, extracted, info={"method": method})

    def check_attempt(self, problem: Problem, response: str) -> StepReport:
        """The step checker's report on ``response`` (tasks/steps.py), with the answer this task's own
        extraction reads; it sees the question and the attempt only, never the gold answer."""
        return check_steps(problem.question, response, extract_answer(response))


class GSM8KTask(_MathTask):
    """GSM8K with its official train/test files; ids ``gsm8k-{split}-{line:05d}``."""

    name = "gsm8k"
    answer_format = ANSWER_FORMAT
    stop_regex = ANSWER_LINE
    answer_slot = staticmethod(answer_slot)  # where episode.gold_prob scores the gold answer

    def load(self, split: str, limit: int | None = None, skip_bad_rows: bool = False) -> LoadResult:
        check_split(split)
        _check_limit(limit)
        rows, skipped = _read_rows(self.data_path / "gsm8k" / f"{split}.jsonl", skip_bad_rows, numeric=True)
        problems = [
            Problem(
                self.name, f"gsm8k-{split}-{line_no:05d}", question, gold, split, {"solution": solution}
            )
            for line_no, question, solution, gold in rows[:limit]
        ]
        return LoadResult(problems, skipped)

    def instruction(self, problem: Problem) -> str:
        return (
            f"{problem.question}\n\n"
            f"{ANSWER_FORMAT}"
        )


class Math500Task(_MathTask):
    """MATH-500. Only a test file exists, so train/test are carved from it by a hash of
    the question (about 80/20, disjoint); ids ``math500-{line:03d}``."""

    name = "math500"

    def load(self, split: str, limit: int | None = None, skip_bad_rows: bool = False) -> LoadResult:
        check_split(split)
        _check_limit(limit)
        rows, skipped = _read_rows(self.data_path / "math500" / "test.jsonl", skip_bad_rows)
        problems = [
            Problem(self.name, f"math500-{line_no:03d}", question, gold, split, {"solution": solution})
            for line_no, question, solution, gold in rows
            if stable_split(question) == split
        ]
        if not problems:
            raise no_problems(self.data_path / "math500" / "test.jsonl", skipped,
                              f"none of its {len(rows)} valid row(s) falls in the {split} split")
        return LoadResult(problems[:limit], skipped)

    def instruction(self, problem: Problem) -> str:
        return (
            f"{problem.question}\n\n"
            "Reason step by step, then put your final answer in \\boxed{answer}."
        )
