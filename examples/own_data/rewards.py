"""A partial-credit reward for examples/own_data: `task.reward: examples/own_data/rewards.py:score`.

A 135M solver rarely gets a word problem exactly right, so a 0/1 reward leaves most GRPO groups
without any spread (every sample scores 0, the advantage is 0, the batch teaches nothing). Credit
for a close number and for answering in the requested form gives those groups a gradient.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
ANSWER_LINE = re.compile(r"the (?:final )?answer is:?\**\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def final_number(response: str) -> tuple[float | None, bool]:
    """(the response's final number, whether it stood on a 'The answer is' line): the last such
    line wins; without one, the last number anywhere in the text."""
    stated = ANSWER_LINE.findall(response)
    if stated:
        return _number(stated[-1]), True
    numbers = NUMBER.findall(response)
    return (_number(numbers[-1]), False) if numbers else (None, False)


def score(problem, response: str) -> float:
    """1.0 for the gold number, 0.5 for a number within 10 % of it (at least 1 either way), 0.1 for
    another number on a 'The answer is' line, else 0. problem.answer is the row's `ans` as text."""
    gold = _number(problem.answer)
    guess, on_answer_line = final_number(response)
    if guess is None:
        return 0.0
    if guess == gold:
        return 1.0
    if abs(guess - gold) <= max(1.0, 0.1 * abs(gold)):
        return 0.5
    return 0.1 if on_answer_line else 0.0


# recorded in every manifest: bump it when the scoring changes, so old and new snapshots never mix
score.verifier_version = "own-data-partial-v1"
