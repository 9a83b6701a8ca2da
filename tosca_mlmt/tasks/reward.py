"""``task.reward``: a user function that scores responses in place of the task's verifier.

The function is ``fn(problem: Problem, response: str) -> bool | float | Verdict``:

* ``True`` / ``False``: correct or not, reward 1.0 / 0.0;
* a finite number: the reward; the turn counts as correct when it is >= 1.0 (full credit);
* a :class:`~tosca_mlmt.tasks.base.Verdict`: used as it is.

The task's own ``verify`` still runs first: it supplies the extracted answer, its info and the
feedback writer's context, and the function decides reward and correctness. A call that
raises, or returns anything else (None, NaN, a string), is a *reward error*: the turn scores
0 and is not correct, ``info["reward_error"]`` says why, :attr:`RewardHook.errors` counts it
(collect reports it as ``reward_errors``) and the first one is warned about. A user function
never stops a run: a bug in it shows up as a count, not as hours of lost episodes.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import threading
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tosca_mlmt.tasks.base import Problem, Task, Verdict


class RewardFunctionWarning(UserWarning):
    """A ``task.reward`` call failed; the turn scored 0."""


def _fingerprint(fn: Callable) -> str:
    """What a manifest records of the function: its ``verifier_version`` attribute when it has
    one, else a hash of its source (so an edit to the function changes the verifier version)."""
    version = getattr(fn, "verifier_version", None)
    if isinstance(version, str) and version:
        return version
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:12]
    except (OSError, TypeError):
        return "unversioned"


class RewardHook:
    """A task whose scores come from ``fn``; every other attribute is the task's own."""

    def __init__(self, task: Task, fn: Callable[[Problem, str], Any], spec: str):
        if not callable(fn):
            from tosca_mlmt.errors import ConfigError

            raise ConfigError(f"invalid value {spec!r} for field 'task.reward': names a "
                              f"{type(fn).__name__}, not a function")
        self.task, self.fn, self.spec = task, fn, spec
        self.name = task.name
        self.verifier_version = f"{task.verifier_version}+reward:{spec}@{_fingerprint(fn)}"
        self.calls = 0
        self.errors = 0
        self.first_error: str | None = None
        self._lock = threading.Lock()  # verify may run on several threads

    def __getattr__(self, attr: str) -> Any:
        # only reached for what RewardHook does not define: load, instruction, answer_format, ...
        if attr == "task":  # not set yet (copy/pickle build the object without __init__)
            raise AttributeError(attr)
        return getattr(self.task, attr)

    def verify(self, problem: Problem, response: str) -> Verdict:
        base = self.task.verify(problem, response)
        try:
            out = self.fn(problem, response)
            verdict = self._to_verdict(out, base)
        except Exception as e:  # noqa: BLE001 -- user code: any failure scores 0, counted
            return self._failed(problem, f"{type(e).__name__}: {e}", base)
        with self._lock:
            self.calls += 1
        return verdict

    @staticmethod
    def _to_verdict(out: Any, base: Verdict) -> Verdict:
        if isinstance(out, Verdict):
            return out
        if isinstance(out, bool):
            return replace(base, correct=out, reward=1.0 if out else 0.0)
        if isinstance(out, (int, float)) and math.isfinite(out):
            return replace(base, correct=out >= 1.0, reward=float(out))
        raise TypeError(f"returned {out!r:.60}; expected a bool, a finite number or a Verdict")

    def _failed(self, problem: Problem, why: str, base: Verdict) -> Verdict:
        with self._lock:
            self.calls += 1
            self.errors += 1
            first = self.errors == 1
            if first:
                self.first_error = f"{problem.id}: {why}"
        if first:
            warnings.warn(f"task.reward {self.spec} failed on {problem.id} ({why}); the turn scores 0. Later "
                          "failures are counted (reward_errors), not warned about.", RewardFunctionWarning,
                          stacklevel=2)
        return replace(base, correct=False, reward=0.0, info=dict(base.info, reward_error=why))
