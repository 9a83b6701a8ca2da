"""Inference-matched controls for an eval: does the writer's *feedback* beat spending the same
solver generations without it?

A feedback method with K rounds makes 1 + K solver generations per problem. Two controls make
as many, from the solver alone, sampled at its own temperature and shown no feedback:

* **majority of k**: the solver answers k times; the answer given most often counts. Answers
  vote by ``answer_key``: a number by its exact value (``12``, ``12.0``, ``$12`` and
  ``\\frac{24}{2}`` are one vote), other text by ``normalize_string``, the spelling the verifier's
  string match compares (``\\dfrac{x}{2}`` and ``\\frac{x}{2}`` are one vote); answers equal only
  to math_verify (``\\sqrt{4}`` and ``2``) still vote apart. An attempt without an answer does not
  vote. Ties go to the tied answer that came first in sample order; when no sample gave an
  answer, the first sample stands.
* **tool-gated resampling**: the first answer is the eval's own turn 1. While the task's
  checker (its ``check_attempt``: the step checker of tasks/steps.py on arith, gsm8k and
  math500, mbpp's public test) flags the current answer and a resample is left, the next
  sampled answer replaces it; an unflagged answer stands. With K = 1: flagged -> the resample
  is final, otherwise the first answer is. The checker reads what the method's tool reads
  (``flagged``: rollout/tool.attempt_report), so the control and the method are gated alike.

Apart from ``flagged``, the functions here are pure over answers, flags and verdicts; the eval
stage generates the samples (pipelines/evaluate.py) and stores them, so every number here can be
recomputed.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction

from tosca_mlmt.errors import ConfigError
from tosca_mlmt.leak import number_value
from tosca_mlmt.records import Turn
from tosca_mlmt.rollout.tool import attempt_report, has_check
from tosca_mlmt.tasks.base import Problem
from tosca_mlmt.tasks.mathverify import normalize_string

# A fraction of two integers as LaTeX writes it, braces optional on one digit: \frac{1}{2}, \frac12, -\frac{3}4.
_FRAC_RE = re.compile(r"(-?)\\frac(?:\{(-?\d+)\}|(\d))(?:\{(\d+)\}|(\d))")


def _latex_fraction(text: str) -> Fraction | None:
    m = _FRAC_RE.fullmatch(text)
    if m is None or int(m[4] or m[5]) == 0:
        return None
    value = Fraction(int(m[2] or m[3]), int(m[4] or m[5]))
    return -value if m[1] else value


def answer_key(answer: str | None) -> str | None:
    """What the vote compares: a number (also a LaTeX fraction of integers) by its exact value, other
    text by ``normalize_string`` (the spelling the verifier's string match compares); None (no answer,
    or an empty one) does not vote."""
    text = normalize_string(answer or "")
    if not text:
        return None
    value = number_value(text)
    value = _latex_fraction(text) if value is None else value
    return text if value is None else f"={value}"


def majority_index(answers: list[str | None]) -> int:
    """The sample whose answer wins the vote (module doc: ties go to the first in sample order)."""
    keys = [answer_key(a) for a in answers]
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return 0
    top = max(counts.values())
    return next(i for i, k in enumerate(keys) if k is not None and counts[k] == top)


def gated_index(flags: list[bool]) -> int:
    """Which of [first, resample 1, ..., resample K] is final, given whether the checker flagged
    each of the first K (``flags``): the first unflagged one, else the last resample."""
    return next((i for i, flagged in enumerate(flags) if not flagged), len(flags))


def require_checker(task) -> None:
    """Refuse ``--resample tool`` for a task that has no ``check_attempt`` (rollout/tool.has_check, the
    rule the episode's tool uses), naming the task."""
    if not has_check(task):
        raise ConfigError(f"--resample tool: task {getattr(task, 'name', task)!r} has no checker (a "
                          "check_attempt(problem, response) method whose report has .flagged)")


def flagged(task, problem: Problem, turn: Turn, tags: list[str], reads_thinking: bool) -> bool:
    """The gate's verdict on a solver turn: the task's check of exactly the text the method's tool
    checks (rollout/tool.attempt_report: the whole attempt, thinking included, unless
    ``episode.writer_reads_thinking`` is off)."""
    return bool(attempt_report(task, problem, turn, tags, reads_thinking).flagged)


@dataclass(frozen=True)
class Attempt:
    """One solver answer as the controls read it."""

    answer: str | None  # the answer the verifier extracted
    correct: bool
    turn: Turn | None = field(default=None, compare=False, repr=False)  # the stored turn, for the checker


@dataclass(frozen=True)
class ControlPlan:
    """Which controls an eval runs, matched to its feedback method's K rounds."""

    majority: int  # k, 0 = no majority vote
    resample: bool  # tool-gated resampling, up to K resamples
    rounds: int  # K

    @property
    def samples(self) -> int:
        """Sampled answers per problem the controls need (they share them)."""
        return max(self.majority, self.rounds if self.resample else 0)


def plan_controls(majority: int | None, resample: str | None, rounds: int, temperature: float) -> ControlPlan | None:
    """The plan for ``--majority K`` (0 = 1 + K rounds: the feedback method's solver generations)
    and ``--resample tool``; None when neither is asked. Refuses controls that would measure nothing."""
    if resample not in (None, "none", "tool"):
        raise ConfigError(f"invalid value {resample!r} for --resample; allowed: tool, none")
    if majority is not None and majority < 0:
        raise ConfigError(f"invalid value {majority} for --majority; must be >= 1 (0 = 1 + episode.rounds)")
    plan = ControlPlan(0 if majority is None else (majority or 1 + rounds), resample == "tool", rounds)
    if not plan.samples and not plan.resample:
        return None
    if plan.resample and rounds == 0:
        raise ConfigError("--resample tool resamples once per feedback round, and episode.rounds is 0")
    if temperature <= 0:
        raise ConfigError(f"invalid value {temperature} for field 'solver_sampling.temperature': --majority and "
                          "--resample sample the solver at it, and at 0 every sample is the greedy answer")
    return plan


def control_row(first: Attempt, samples: list[Attempt], plan: ControlPlan, flag) -> dict:
    """One problem's controls: ``first`` is the eval's turn 1, ``samples`` the sampled answers in
    order, ``flag(attempt) -> bool`` the checker's verdict (``flags``: those the gate read)."""
    row: dict = {"samples": [{"answer": s.answer, "correct": s.correct} for s in samples]}
    if plan.majority:
        pick = majority_index([s.answer for s in samples[:plan.majority]])
        row.update(majority_pick=pick, majority_correct=samples[pick].correct)
    if plan.resample:
        chain, flags = [first, *samples[:plan.rounds]], []
        for a in chain[:-1]:  # checked as a deployment would: up to the first unflagged answer (mbpp's runs code)
            flags.append(bool(flag(a)))
            if not flags[-1]:
                break
        pick = gated_index(flags)
        row.update(t1_correct=first.correct, flags=flags, resample_pick=pick, resample_correct=chain[pick].correct)
    return row


def control_summary(rows: list[dict], plan: ControlPlan) -> dict:
    """eval.json's numbers over the problems' rows; generations per problem are solver answers
    (a feedback method also makes K writer generations)."""
    n = max(len(rows), 1)
    out: dict = {"generations_per_problem": {"feedback": 1 + plan.rounds}}
    if plan.majority:
        out["majority_k"] = plan.majority
        out["acc_majority"] = sum(r["majority_correct"] for r in rows) / n
        out["generations_per_problem"]["majority"] = plan.majority
    if plan.resample:
        used = [r["resample_pick"] for r in rows]
        out.update(acc_resample=sum(r["resample_correct"] for r in rows) / n,
                   resample_flagged=sum(r["flags"][0] for r in rows),
                   resample_used=sum(p > 0 for p in used),
                   resample_fixed=sum(not r["t1_correct"] and r["resample_correct"] for r in rows),
                   resample_broke=sum(r["t1_correct"] and not r["resample_correct"] for r in rows))
        out["generations_per_problem"]["resample"] = {"max": 1 + plan.rounds, "mean": (len(rows) + sum(used)) / n}
    return out
