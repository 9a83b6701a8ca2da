"""A turn-aware reward for arith (examples/multiturn_reward), in two forms:

* ``score(problem, response, context)``: one turn at a time;
* ``score_batch(problems, responses, contexts)``: the same scores, one call per batch of turns, which lets
  it look across a problem's samples (here: how many different answers they gave).

``context`` (tosca_mlmt.tasks.reward.RewardContext) says which attempt is scored: ``context.turn`` is 1 for
the solve and 2 for the refine after the first feedback; ``previous_correct`` and ``feedback`` describe the
attempt before it and what the writer said about it.
"""

from __future__ import annotations

from tosca_mlmt.tasks.mathverify import extract_answer, is_equivalent
from tosca_mlmt.tasks.reward import RewardContext, batched

FORMAT_CREDIT = 0.1  # turn 1: a readable but wrong answer still beats no answer line
BROKE_RIGHT = -0.5  # a refine that turns a right answer wrong: worse than staying wrong


def score(problem, response: str, context: RewardContext) -> float:
    answer = extract_answer(response)
    right = answer is not None and is_equivalent(answer, problem.answer)
    context.log_metric("answered", float(answer is not None))  # logged as reward/answered
    if context.turn == 1:
        return 1.0 if right else (FORMAT_CREDIT if answer is not None else 0.0)
    broke = bool(context.previous_correct) and not right
    context.log_metric("broke_right", float(broke))
    return BROKE_RIGHT if broke else float(right)


@batched
def score_batch(problems: list, responses: list[str], contexts: list[RewardContext]) -> list[float]:
    """``score`` for every turn of the batch, plus ``reward/distinct_answers``: the share of different
    answers among the samples of each problem in the batch (1: all differ; low: the group has collapsed)."""
    groups: dict[str, list[str | None]] = {}
    for p, r in zip(problems, responses):
        groups.setdefault(p.id, []).append(extract_answer(r))
    for p, c in zip(problems, contexts):
        answers = groups[p.id]
        c.log_metric("distinct_answers", len(set(answers)) / len(answers))
    return [score(p, r, c) for p, r, c in zip(problems, responses, contexts)]
