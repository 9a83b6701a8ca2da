"""The solver's probability of the gold answer where it gave its own (``episode.gold_prob``).

A greedy refine of a small solver rarely flips under one feedback sentence or another, so a
writer rewarded by the refine's 0/1 outcome sees almost nothing (docs/results/log/).
The sentence still moves the solver's answer distribution. Teacher-forcing the gold answer
after the attempt's own reasoning reads that movement:

    p_gold(y) = pi_L(gold | prompt, y[:slot])

where ``slot`` is where y's last "The answer is: N" line puts its number (all of y when it has
none, after an appended answer-line opener, so an attempt that lost the format scores the
probability that it would have ended with the gold answer there). This is the reference-
likelihood reward of RLPR / VeriFree, applied to every solver turn; ``upper.reward=gold_prob``
turns it into the writer's reward p_gold(y_k) - p_gold(y_{k-1}).

Known bias, kept for one forward per turn: the gold's digits are scored without a terminator, so
a longer number that starts with the gold's digits (gold 6, answer 68) shares its probability.
"""

from __future__ import annotations

import math
from typing import Callable

# What an attempt without an answer line is continued with before the gold (the task's own format).
OPENER = "The answer is: "


def gold_continuation(response_ids: list[int], decode: Callable[[list[int]], str], encode: Callable[[str], list[int]],
                      slot_of: Callable[[str], int | None], gold: str) -> tuple[list[int], list[int]]:
    """(prefix ids, target ids): the attempt's own tokens up to its answer slot, kept as sampled
    (no re-tokenization of what the solver wrote), and the tokens to score there: whatever text
    separates the last kept token from the slot, then the gold (pure given the tokenizer).

    ``response_ids`` must not end in eos."""
    text = decode(response_ids)
    slot = slot_of(text)
    if slot is None:
        sep = "" if not text or text.endswith("\n") else "\n"
        return list(response_ids), encode(sep + OPENER + gold)
    # The longest token prefix whose text ends at or before the slot; a token that straddles the
    # slot (e.g. ": 1") is dropped and its text before the slot re-encoded with the gold.
    j = 0
    for n in range(1, len(response_ids) + 1):
        if len(decode(response_ids[:n])) > slot:
            break
        j = n
    kept = decode(response_ids[:j])
    return list(response_ids[:j]), encode(text[len(kept):slot] + gold)


def gold_prob(target_logprobs: list[float]) -> float:
    """exp of the summed teacher-forced log-probs of the target tokens (pure)."""
    return math.exp(sum(target_logprobs)) if target_logprobs else 0.0
