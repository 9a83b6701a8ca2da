"""``jsonl``: any question/answer data set, read in place, scored by final-answer equivalence.

The data (``task.path``) is a ``.jsonl`` file, a ``.parquet`` file or a folder written by
``datasets``' ``save_to_disk``. Splits come from the data when it has them (``{split}`` in the
path names one file per split; a saved ``DatasetDict`` holds them), else from a hash of the
question (``task.test_fraction`` of the rows in test, the rest in train, disjoint).
``task.question_key`` / ``task.answer_key`` name the row keys; ``task.answer_format`` says how
the final answer is written, in the gold field and in responses alike. Every row is validated
(not only those a split keeps), and a bad one is a DataError naming the file, the row (line
for jsonl, 1-based row for parquet and datasets) and the key.

Problem ids are ``<prefix>-<row>`` (``<prefix>-<split>-<row>`` when the data holds the splits),
or ``<prefix>-<value of task.id_key>``; the prefix defaults to the data's file name, so a run
on ``mydata.jsonl`` is labelled ``mydata``, not ``gsm8k``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tosca_mlmt.config import TaskConfig
from tosca_mlmt.errors import ConfigError, DataError
from tosca_mlmt.tasks.base import (LoadResult, Problem, Verdict, check_split, check_text, decode_line, no_problems,
                                    parse_json_line, read_lines, short_repr, stable_split)
from tosca_mlmt.tasks.mathverify import (ANSWER_FORMAT, ANSWER_LINE, echoes_format, extract_answer, extract_gold,
                                         fold_width, gold_problem, has_answer_marker, last_boxed, match_method)

# v2: the answer line's extraction of math-v4 (an empty last answer line reads only what follows it)
VERIFIER_VERSION = "jsonl-v2"
BOXED_FORMAT = "Reason step by step, then put your final answer in \\boxed{}."
_PREFIX_JUNK_RE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Fields:
    """How a row maps onto a problem (the jsonl knobs of the ``task:`` section)."""

    question: str = "question"
    answer: str = "answer"
    id: str = ""
    answer_format: str = "auto"
    answer_regex: str = ""


def default_prefix(path: str) -> str:
    """The data's name: the file name without its extension (or the folder's name), with
    ``{split}`` and characters an id should not hold dropped."""
    p = Path(path)
    name = p.name.replace("{split}", "")
    for ext in (".jsonl", ".parquet", ".json"):
        name = name.removesuffix(ext)
    name = _PREFIX_JUNK_RE.sub("-", name).strip("-._")
    if not name and "{split}" not in p.parent.name:
        name = _PREFIX_JUNK_RE.sub("-", p.parent.name).strip("-._")
    return name or "jsonl"


def read_gold(value: str, fmt: str, regex: re.Pattern | None) -> str:
    """The final answer in a gold field; ValueError when ``fmt`` finds none."""
    text = value.strip()
    if fmt == "raw":
        return text
    if fmt == "auto":
        if not has_answer_marker(text):
            return text  # a bare answer ("42", "B")
        # a field that says where its answer is ('####', 'The answer is', \boxed) must have one there:
        # "steps ####" or an empty \boxed{} is no answer, not the bare answer "steps ####"
        return extract_gold(text)
    if fmt == "hash":
        if "####" not in text:
            raise ValueError("no '####' in it (task.answer_format is 'hash')")
        return extract_gold(text)
    found = last_boxed(text) if fmt == "boxed" else _last_match(regex, text)
    if not found:
        what = "no \\boxed{} in it" if fmt == "boxed" else f"task.answer_regex {regex.pattern!r} does not match it"
        raise ValueError(what)
    return found


def _last_match(regex: re.Pattern | None, text: str) -> str | None:
    last = None
    for m in regex.finditer(text):
        last = m
    if last is None:
        return None
    return (last.group(1) if regex.groups else last.group(0)).strip() or None


class JsonlTask:
    name = "jsonl"
    verifier_version = VERIFIER_VERSION

    def __init__(self, path: str, fields: Fields = Fields(), id_prefix: str = "", prompt: str = "",
                 test_fraction: float = 0.2):
        self.path = path
        self.fields = fields
        self.prefix = id_prefix or default_prefix(path)
        self.prompt = prompt
        self.test_fraction = test_fraction
        if fields.answer == fields.question:
            raise ConfigError(f"invalid value {fields.answer!r} for field 'task.answer_key': it is also "
                              "task.question_key, so every gold answer would be its own question")
        if fields.id and fields.id == fields.answer:
            raise ConfigError(f"invalid value {fields.id!r} for field 'task.id_key': it is also task.answer_key, "
                              "so every problem id would give its gold answer away")
        if fields.answer_format == "regex" and not fields.answer_regex:
            raise ConfigError("invalid value for field 'task.answer_regex': required by task.answer_format 'regex'")
        self.regex = re.compile(fields.answer_regex) if fields.answer_format == "regex" else None
        if prompt:
            self.answer_format = ""  # the user's prompt says how to answer; refines do not add a line
        else:
            self.answer_format = {"boxed": BOXED_FORMAT, "regex": ""}.get(fields.answer_format, ANSWER_FORMAT)
        # solver turns may stop at the first "The answer is: N" line only when that is what was asked
        self.stop_regex = ANSWER_LINE if self.answer_format == ANSWER_FORMAT else None

    @classmethod
    def from_config(cls, cfg: TaskConfig) -> JsonlTask:
        if not cfg.path:
            raise ConfigError("invalid value for field 'task.path': required by task.name 'jsonl'")
        fields = Fields(cfg.question_key, cfg.answer_key, cfg.id_key, cfg.answer_format, cfg.answer_regex)
        return cls(cfg.path, fields, cfg.id_prefix, cfg.prompt, cfg.test_fraction)

    # ------------------------------------------------------------------ data
    def load(self, split: str, limit: int | None = None, skip_bad_rows: bool = False) -> LoadResult:
        check_split(split)
        if limit is not None and limit < 0:
            raise ConfigError(f"invalid limit {limit}; must be >= 0")
        source, rows, split_in_data = self._rows(split)
        problems, skipped, seen = [], 0, {}
        for row_no, row in rows:
            try:
                p = self._problem(source, row_no, row, split if split_in_data else None)
                if p.id in seen:
                    raise DataError(str(source), row_no, self.fields.id or "<row>",
                                    f"duplicate problem id {p.id!r} (also row {seen[p.id]})")
            except DataError:
                if not skip_bad_rows:
                    raise
                skipped += 1
                continue
            seen[p.id] = row_no
            if p.split == split:
                problems.append(p)
        if not problems:
            detail = "" if not seen else f"none of its {len(seen)} valid row(s) falls in the {split} split"
            raise no_problems(source, skipped, detail)
        return LoadResult(problems[:limit] if limit else problems, skipped)

    def _rows(self, split: str) -> tuple[Path, list[tuple[int, Any]], bool]:
        """(source shown in errors, [(row number, row)], whether the data itself holds ``split``)."""
        per_split = "{split}" in self.path
        path = Path(self.path.replace("{split}", split)).expanduser()
        if path.is_dir():
            return self._dataset_rows(path, split, per_split)
        if not path.is_file():
            raise ConfigError(f"invalid value for field 'task.path': not found: {path}")
        if path.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq

                table = pq.read_table(path)
                dupes = sorted({c for c in table.column_names if table.column_names.count(c) > 1})
                records = [] if dupes else table.to_pylist()
            except Exception as e:  # noqa: BLE001 -- any reader failure is a bad file
                raise DataError(str(path), None, None, f"cannot read as parquet: {type(e).__name__}: {e}") from None
            if dupes:  # a row read from it would keep only the last column of each name
                raise DataError(str(path), None, None, f"duplicate column(s) {', '.join(map(repr, dupes))}")
            return path, list(enumerate(records, start=1)), per_split
        return path, list(self._jsonl_rows(path)), per_split

    @staticmethod
    def _jsonl_rows(path: Path):
        for line_no, raw in read_lines(path):
            # decoding and JSON errors are raised when the row is turned into a problem, so
            # --skip-bad-rows counts them like any other bad row; blank lines are not rows
            if raw.strip():
                yield line_no, raw

    def _dataset_rows(self, path: Path, split: str, per_split: bool) -> tuple[Path, list, bool]:
        try:
            import datasets
        except ImportError as e:
            raise ConfigError(f"invalid value for field 'task.path': {path} is a folder, which needs the "
                              f"datasets package ({e})") from None
        try:
            data = datasets.load_from_disk(str(path))
        except Exception as e:  # noqa: BLE001 -- not a saved dataset, or a damaged one
            raise DataError(str(path), None, None, f"cannot load with datasets.load_from_disk: "
                                                   f"{type(e).__name__}: {e}") from None
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise DataError(str(path), None, None, f"the DatasetDict has no {split!r} split "
                                                       f"(it has: {', '.join(data) or 'none'})")
            return path / split, list(enumerate(data[split], start=1)), True
        return path, list(enumerate(data, start=1)), per_split

    def _problem(self, source: Path, row_no: int, row: Any, data_split: str | None) -> Problem:
        if isinstance(row, bytes):  # a jsonl line, parsed here so that a bad one is one bad row
            row = parse_json_line(source, row_no, decode_line(source, row_no, row))
        if not isinstance(row, dict):
            raise DataError(str(source), row_no, "<row>", f"expected a JSON object, got {short_repr(row)}")
        f = self.fields
        question = self._text(source, row_no, row, f.question, "task.question_key")
        answer_field = self._text(source, row_no, row, f.answer, "task.answer_key")
        try:
            gold = fold_width(read_gold(answer_field, f.answer_format, self.regex))
        except ValueError as e:
            raise DataError(str(source), row_no, f.answer, f"no final answer: {e}") from None
        bad_gold = gold_problem(gold)
        if bad_gold:
            raise DataError(str(source), row_no, f.answer, f"unusable gold answer: {bad_gold}")
        if f.id:
            rid = row.get(f.id)
            if isinstance(rid, bool) or not isinstance(rid, (str, int)) or not str(rid).strip():
                raise DataError(str(source), row_no, f.id, _why(rid, "a non-empty string or an integer", row,
                                                                "task.id_key"))
            if not str(rid).strip().isprintable():
                # an id is one token of a log line, a snapshot row, a table cell: a newline or an escape
                # code in it would split or repaint them
                raise DataError(str(source), row_no, f.id, f"the id {short_repr(rid)} holds a control or "
                                                           "line-break character")
            pid = f"{self.prefix}-{str(rid).strip()}"
        else:
            pid = f"{self.prefix}-{data_split}-{row_no:05d}" if data_split else f"{self.prefix}-{row_no:05d}"
        split = data_split or stable_split(question, self.test_fraction)
        extras = {k: v for k, v in row.items() if k not in (f.question, f.answer) and _jsonable(v)}
        meta: dict[str, Any] = {"row": row_no, "fields": extras}
        if gold != answer_field:
            meta["solution"] = answer_field
        return Problem(self.name, pid, question, gold, split, meta)

    @staticmethod
    def _text(source: Path, row_no: int, row: dict, key: str, knob: str) -> str:
        value = row.get(key)
        if isinstance(value, float) and not math.isfinite(value):
            # JSON's NaN/Infinity (and 1e400, which overflows to inf) would become the text 'nan'/'inf'
            raise DataError(str(source), row_no, key, f"expected a finite number or a string, got {value!r}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # a numeric answer column
        if not isinstance(value, str) or not value.strip():
            raise DataError(str(source), row_no, key, _why(value, "a non-empty string", row, knob))
        return check_text(source, row_no, key, value)

    # ------------------------------------------------------------------ prompting and scoring
    def instruction(self, problem: Problem) -> str:
        if self.prompt:
            return self.prompt.format(question=problem.question)
        return f"{problem.question}\n\n{self.answer_format}" if self.answer_format else problem.question

    def extract(self, response: str) -> str | None:
        fmt = self.fields.answer_format
        if fmt == "boxed":
            return last_boxed(response)
        if fmt == "regex":
            return _last_match(self.regex, response)
        return extract_answer(response)

    def verify(self, problem: Problem, response: str) -> Verdict:
        if self.answer_format == ANSWER_FORMAT and echoes_format(response):
            return Verdict(False, 0.0, None, {"method": None, "echo": True})
        extracted = self.extract(response)
        method = match_method(extracted, problem.answer) if extracted is not None else None
        return Verdict(method is not None, 1.0 if method is not None else 0.0, extracted, {"method": method})


def _why(value: Any, expected: str, row: dict, knob: str) -> str:
    if value is None:
        keys = ", ".join(sorted(map(str, row))[:12]) or "none"
        return f"missing (the row's keys: {keys}; set {knob} to the one to use)"
    return f"expected {expected}, got {short_repr(value)}"


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return False
    return True
