"""``task.reward``: a user function that scores responses in place of the task's verifier.

Three forms, told apart once, when the hook is built (:func:`call_form`), never per call:

* ``fn(problem, response)``: the single-turn form;
* ``fn(problem, response, context)`` (a third positional parameter without a default, or one named
  ``context``, or ``**kwargs``): the same, with a :class:`RewardContext` saying which attempt of the
  episode it scores (turn, round), the attempt before it and the feedback it answered;
* a *batched* function, marked by :func:`batched` (or ``fn.batched = True``):
  ``fn(problems, responses[, contexts]) -> list``, called once per batch of turns the rollout scores
  together (a turn of every episode of a batch; under continuous episodes, the turns one engine step ended).

Each result is ``bool | float | Verdict``:

* ``True`` / ``False``: correct or not, reward 1.0 / 0.0;
* a finite number: the reward; the turn counts as correct when it is >= 1.0 (full credit);
* a :class:`~tosca_mlmt.tasks.base.Verdict`: used as it is.

Extra metrics: ``context.log_metric(name, value)`` (TRL's ``log_metric``, OpenRLHF's ``extra_logs``)
records a number on the turn (``info["reward_metrics"]``); the stages' summaries average each name over
the solver turns that logged it, as ``reward/<name>`` (metrics.reward_stats).

The task's own ``verify`` still runs first: it supplies the extracted answer, its info and the
feedback writer's context, and the function decides reward and correctness. A call that
raises, or returns anything else (None, NaN, a string), is a *reward error*: the turn scores
0 and is not correct, ``info["reward_error"]`` says why, :attr:`RewardHook.errors` counts it
(collect reports it as ``reward_errors``) and the first one is warned about. A batched call that
raises, or returns a list of the wrong length, is a reward error for every turn of the batch. A user
function never stops a run: a bug in it shows up as a count, not as hours of lost episodes.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import numbers
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tosca_mlmt.tasks.base import Problem, Task, Verdict

KINDS = ("solve", "refine", "counterfactual")


class RewardFunctionWarning(UserWarning):
    """A ``task.reward`` call failed; the turn scored 0."""


@dataclass
class RewardContext:
    """Where in the episode the scored response sits. Outside an episode (a bare ``verify`` call) it is
    a first attempt with no history. One per scored turn: ``log_metric`` on it is thread-safe."""

    turn: int = 1  # the solver's attempt: 1 = the solve, 2 = the first refine, k + 1 = round k's refine
    round: int = 0  # the feedback round: 0 for the solve, k for round k's refine (Turn.round)
    kind: str = "solve"  # solve, refine, or counterfactual: round k's refine replayed without its feedback
    previous_response: str | None = None  # the attempt before, as the verifier read it; None on turn 1
    previous_reward: float | None = None  # that attempt's reward (this function's score of it)
    previous_correct: bool | None = None
    feedback: str | None = None  # the writer's feedback this refine answers; None on turn 1 and counterfactuals
    strategy: str | None = None  # the writer's strategy behind that feedback
    episode_id: str = ""
    sample: int = 0  # the episode's sample number among its problem's samples
    metrics: dict[str, float] = field(default_factory=dict)  # what log_metric recorded

    def log_metric(self, name: str, value: float) -> None:
        """Record an extra number for this turn; logged as ``reward/<name>``, averaged over the turns that
        logged it. A bad name or a value that is not a finite number raises (the turn is a reward error)."""
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise ValueError(f"log_metric name {name!r:.40}: expected a non-empty string without spaces")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"log_metric {name!r}: value {value!r:.40} is not a finite number")
        self.metrics[name] = float(value)


def batched(fn: Callable) -> Callable:
    """Mark ``fn(problems, responses[, contexts]) -> list`` as a batched reward: the rollout calls it
    once per batch of turns. Returns ``fn`` itself (its source, and so its fingerprint, is unchanged)."""
    fn.batched = True
    return fn


def call_form(fn: Callable, batch: bool) -> str | None:
    """How ``fn`` takes the context: ``"keyword"`` (a parameter named context / contexts, or
    ``**kwargs``), ``"positional"`` (a third positional parameter without a default), or None
    (two arguments only, or a signature Python cannot read)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    name = "contexts" if batch else "context"
    if any(p.name == name and p.kind != p.POSITIONAL_ONLY for p in params):
        return "keyword"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in params) or (
            len(positional) >= 3 and positional[2].default is inspect.Parameter.empty):
        return "positional"
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return "keyword"
    return None


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

    def __init__(self, task: Task, fn: Callable[..., Any], spec: str):
        if not callable(fn):
            from tosca_mlmt.errors import ConfigError

            raise ConfigError(f"invalid value {spec!r} for field 'task.reward': names a "
                              f"{type(fn).__name__}, not a function")
        self.task, self.fn, self.spec = task, fn, spec
        self.name = task.name
        self.batched = getattr(fn, "batched", False) is True
        self.form = call_form(fn, self.batched)  # read once: a call never inspects the function
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

    def verify(self, problem: Problem, response: str, context: RewardContext | None = None) -> Verdict:
        return self.verify_batch([problem], [response], [RewardContext() if context is None else context])[0]

    def verify_batch(self, problems: Sequence[Problem], responses: Sequence[str],
                     contexts: Sequence[RewardContext]) -> list[Verdict]:
        """One verdict per (problem, response, context); a batched function is called once for all."""
        if not len(problems) == len(responses) == len(contexts):
            raise ValueError(f"verify_batch: {len(problems)} problems, {len(responses)} responses, "
                             f"{len(contexts)} contexts")
        if not problems:
            return []
        bases = [self.task.verify(p, r) for p, r in zip(problems, responses)]
        if not self.batched:
            return [self._score(lambda: self._call(p, r, c), p, b, c)
                    for p, r, c, b in zip(problems, responses, contexts, bases)]
        try:
            outs = list(self._call(list(problems), list(responses), list(contexts)))
            if len(outs) != len(problems):
                raise ValueError(f"returned {len(outs)} results for a batch of {len(problems)}")
        except Exception as e:  # noqa: BLE001 -- user code: a failed batch scores all of it 0, counted
            return [self._failed(p, f"{type(e).__name__}: {e}", b) for p, b in zip(problems, bases)]
        return [self._score(lambda o=o: o, p, b, c) for o, p, b, c in zip(outs, problems, bases, contexts)]

    def _call(self, problem, response, context):
        if self.form == "keyword":
            return self.fn(problem, response, **{("contexts" if self.batched else "context"): context})
        return self.fn(problem, response, context) if self.form == "positional" else self.fn(problem, response)

    def _score(self, result: Callable[[], Any], problem: Problem, base: Verdict, context: RewardContext) -> Verdict:
        try:
            verdict = self._to_verdict(result(), base)
        except Exception as e:  # noqa: BLE001 -- user code: any failure scores 0, counted
            return self._failed(problem, f"{type(e).__name__}: {e}", base)
        with self._lock:
            self.calls += 1
        if context.metrics:
            verdict = replace(verdict, info=dict(verdict.info, reward_metrics=dict(context.metrics)))
        return verdict

    @staticmethod
    def _to_verdict(out: Any, base: Verdict) -> Verdict:
        if isinstance(out, Verdict):
            return out
        if isinstance(out, bool):
            return replace(base, correct=out, reward=1.0 if out else 0.0)
        if isinstance(out, numbers.Real) and math.isfinite(out):
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
                          stacklevel=3)
        return replace(base, correct=False, reward=0.0, info=dict(base.info, reward_error=why))
