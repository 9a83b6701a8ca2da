"""What train-upper logs under ``upper/``: the typed record of one Q-learning step and the
metrics rows built from it.

Separate from the learner and the stage so that the rows are a pure function of the record
(records in, rows out, nothing read from a learner or stage object): docs/reference/metrics.md
names what they hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from tosca_mlmt.upper.report import QEvaluation

PREFIX = "upper/"


@dataclass(frozen=True)
class UpperStep:
    """One train-upper iteration: one optimiser step of the writer and its Q head."""

    step: int  # 1-based: the learner's step count after it (the metrics' step)
    metrics: dict[str, float]  # UpperLearner.update's scalars: losses, Q, advantages, grad norm, samples/s
    evaluation: QEvaluation | None = None  # when the step was due an evaluation (upper.eval_every, the last)


def step_row(record: UpperStep) -> dict[str, float]:
    """The ``upper/`` row of the step's update (logged every upper.log_every steps and at the last)."""
    return {PREFIX + k: v for k, v in record.metrics.items()}


def eval_row(evaluation: QEvaluation) -> dict[str, float]:
    """The ``upper/`` row of an evaluation: ``q/<strategy>``, ``ope/*``, ``v_mean``, agreement."""
    return {PREFIX + k: v for k, v in evaluation.metrics.items()}


def scalars(metrics: dict) -> dict[str, int | float]:
    """The numbers of a metrics dict (what a model card and train-joint's manifest keep)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
