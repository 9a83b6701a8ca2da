"""Typed records and the interface every verifiable task implements.

A task turns a data source into :class:`Problem` records with stable ids and disjoint
train/test splits, renders the solver's turn-1 instruction, and scores a response text
with a versioned verifier. The episode runner never looks inside a task beyond this.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

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


class Task(Protocol):
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
