"""A task and reward functions written the way a user writes them, outside the package.

tests/unit/tasks/test_byo_task.py names them by path (``byo_plugin:CountTask``, ``tests/byo_plugin.py:flaky_reward``)
and through a fake installed entry point; nothing here is imported by the package itself.
"""

from __future__ import annotations

from tosca_mlmt.tasks.base import LoadResult, Problem, Verdict, check_split


class CountTask:
    """"Write the number N": correct when the response contains N. Takes the ``task:`` section."""

    name = "count"
    verifier_version = "count-v1"

    def __init__(self, cfg=None):
        self.offset = 0 if cfg is None else cfg.level  # a task may read any task.* knob

    def load(self, split: str, limit: int | None = None, skip_bad_rows: bool = False) -> LoadResult:
        check_split(split)
        base = self.offset + (0 if split == "train" else 100)
        return LoadResult([Problem(self.name, f"count-{split}-{i}", f"Write the number {base + i}.", str(base + i),
                                   split) for i in range(limit or 4)])

    def instruction(self, problem: Problem) -> str:
        return f"{problem.question} Reply with the number only."

    def verify(self, problem: Problem, response: str) -> Verdict:
        ok = problem.answer in response
        return Verdict(ok, 1.0 if ok else 0.0, problem.answer if ok else None)


def make_count_task():
    """A factory that takes no arguments (the registry calls it with none)."""
    return CountTask()


def length_reward(problem: Problem, response: str) -> float:
    """Partial credit: up to 1.0 for a 20-character response."""
    return min(len(response) / 20, 1.0)


def flaky_reward(problem: Problem, response: str) -> bool:
    """Raises on every odd-numbered problem (a reward service that is down half the time)."""
    if int(problem.id.rsplit("-", 1)[1]) % 2:
        raise ConnectionError("reward service unreachable")
    return len(response) > 0


def broken_reward(problem: Problem, response: str) -> bool:
    raise RuntimeError("bug in the reward function")


def none_reward(problem: Problem, response: str):
    return None  # forgot the return statement


class NotATask:
    name = "not-a-task"
