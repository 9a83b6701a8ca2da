"""Typed records and the interface every verifiable task implements.

A task turns a data source into :class:`Problem` records with stable ids and disjoint
train/test splits, renders the solver's turn-1 instruction, and scores a response text
with a versioned verifier. The episode runner never looks inside a task beyond this.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tosca_mlmt.errors import DataError

SPLITS = ("train", "test")


@dataclass(frozen=True)
class Problem:
    task: str
    id: str  # stable across runs and machines; used to join turns, snapshots and evals
    question: str
    answer: str  # gold final answer (math) or reference solution (code)
    split: str
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. tests (mbpp), level (arith)

    def meta_json(self) -> str:
        return json.dumps(self.meta, sort_keys=True)


@dataclass(frozen=True)
class Verdict:
    correct: bool
    reward: float  # 1.0 when correct, else 0.0 (tasks may log partial credit in ``info``)
    extracted: str | None  # the answer the verifier read from the response, if any
    info: dict[str, Any] = field(default_factory=dict)  # e.g. pass_rate, timeouts
    feedback_context: str = ""  # extra text the feedback writer may see (e.g. a traceback)


@dataclass
class LoadResult:
    problems: list[Problem]
    skipped_rows: int = 0  # malformed rows dropped under --skip-bad-rows


class ToolReport(Protocol):
    """What a task's own check found in one attempt (``Task.check_attempt``). It is computed from the
    problem's question and the attempt only, never the gold answer or grading tests, so a writer that
    reads it (episode.writer_sees: tool) knows nothing it could not know at test time."""

    @property
    def flagged(self) -> bool:
        """The check found something wrong (the writer's signal level: 1 flagged, 0 not)."""
        ...

    def features(self) -> tuple[float, ...]:
        """A compact numeric state of the report (first entry: flagged)."""
        ...

    def to_json(self) -> dict:
        """The report as JSON, stored on the feedback turn's ``info["tool_report"]``."""
        ...

    def describe(self) -> str:
        """One line for the writer's state: what the check found ("Step check: `7 + 10 = 18` does not hold.")."""
        ...

    def hint(self) -> str:
        """Feedback for the solver (episode.feedback: tool) that points at what was flagged without
        stating a corrected value ("Recheck 7 + 10.")."""
        ...


class Task(Protocol):
    """A task may also define ``check_attempt(problem, response) -> ToolReport``: its own honest check of
    an attempt (the step checker for arith, gsm8k and math500), which episode.writer_sees: tool and
    episode.feedback: tool need; a task without it is refused under either."""

    name: str
    verifier_version: str  # bump whenever scoring could change; recorded in manifests

    def load(self, split: str, limit: int | None = None, skip_bad_rows: bool = False) -> LoadResult: ...

    def instruction(self, problem: Problem) -> str:
        """The turn-1 user message shown to the solver."""
        ...

    def verify(self, problem: Problem, response: str) -> Verdict: ...


DATA_ENV_VAR = "TOSCA_MLMT_DATA"


def default_data_path() -> Path:
    """``$TOSCA_MLMT_DATA``, else ``../shared/data`` next to the project root."""

    env = os.environ.get(DATA_ENV_VAR)
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]  # tosca_mlmt/tasks/ -> tosca_mlmt/ -> repo
    return repo.parent / "shared" / "data"


def stable_split(key: str, test_fraction: float = 0.2, salt: str = "tosca-mlmt-split-v1") -> str:
    """Assign ``key`` to train/test by a hash, so the split never depends on row order."""
    h = int.from_bytes(hashlib.sha256(f"{salt}:{key}".encode()).digest()[:8], "big")
    return "test" if (h % 10_000) < test_fraction * 10_000 else "train"


def check_split(split: str) -> None:
    if split not in SPLITS:
        from tosca_mlmt.errors import ConfigError

        raise ConfigError(f"invalid split '{split}'; allowed: {', '.join(SPLITS)}")


# ---------------------------------------------------------------- reading JSONL data files
# Every failure below is a DataError naming file:line, so a bad byte, a bad row or a row
# nested 100k levels deep is reported (or skipped under --skip-bad-rows) like any other
# malformed row, instead of surfacing later as a traceback in the tokenizer or verifier.


def read_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) of every line of ``path``; decoding is per line
    (:func:`decode_line`) so one bad byte costs one row, not the file."""
    try:
        with path.open("rb") as f:
            yield from enumerate(f, start=1)
    except OSError as e:
        raise DataError(str(path), None, None, f"cannot read: {e.strerror or e}") from None


def decode_line(path: Path, line_no: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a BOM may open the file
    except UnicodeDecodeError as e:
        raise DataError(str(path), line_no, None,
                        f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object's pairs as a dict, refusing a key given twice (``json`` keeps the last silently)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def parse_json_line(path: Path, line_no: int, line: str) -> Any:
    """The JSON value of one line; a DataError for invalid JSON and for an object with a key given
    twice (which of the two values the data meant is unknowable; ``json`` would keep the last)."""
    try:
        return json.loads(line, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        key = e.key if e.key.isprintable() else short_repr(e.key)
        raise DataError(str(path), line_no, key, "the key appears twice in the row (JSON would keep the last "
                                                 "value silently)") from None
    except json.JSONDecodeError as e:
        raise DataError(str(path), line_no, "<row>", f"invalid JSON: {e.msg}") from None
    except RecursionError:
        raise DataError(str(path), line_no, "<row>", "invalid JSON: nested too deeply") from None
    except ValueError as e:  # an integer past Python's 4300-digit conversion limit
        raise DataError(str(path), line_no, "<row>", f"invalid JSON: {e}") from None


def check_text(path: Path, line_no: int, field_: str, value: str) -> str:
    """``value`` unchanged, or a DataError when it holds a lone surrogate: JSON's ``\\ud800``
    escapes decode to one, and it only fails later, when the tokenizer encodes it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(str(path), line_no, field_,
                        f"contains a lone surrogate ({value[e.start]!r}), which is not valid Unicode") from None
    return value


def short_repr(value: Any) -> str:
    """A value for an error message: containers by size only (the repr of a deeply nested
    row recurses as deep as the JSON parser did, and can hit the recursion limit)."""
    if isinstance(value, (list, dict)):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    r = repr(value)
    return r if len(r) <= 40 else r[:37] + "..."


def no_problems(path: Path, skipped: int, detail: str = "") -> DataError:
    """The error for a data source that yields nothing to train or evaluate on."""
    why = detail or (f"all {skipped} row(s) are malformed (skipped)" if skipped else "the file holds no rows")
    return DataError(str(path), None, None, f"no problems: {why}")
