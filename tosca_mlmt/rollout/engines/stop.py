"""Stop at the first complete answer line: one rule for every engine (the pattern is the task's
``stop_regex``, e.g. ``tasks.mathverify.ANSWER_LINE``).

A solver turn is over once it has written "The answer is: <a number>" and something after the
number shows the number is complete (a newline, a full stop not followed by a digit, a space and
a word). Text after that line is never trained on and never verified, so both engines cut the
sampled ids right after the token that completed the line and report ``finish_reason="answer"``.
Both engines also stop decoding there by the same test (AnswerLine): the HF engine as a stopping
criterion, vLLM as a logits processor that forces eos (vllm/stop.py, engine.vllm.stop_in_engine;
vLLM's own stop strings are literal). Without it the turn decodes on and the cut is applied
afterwards: same ids, same logprobs, more compute.
"""

from __future__ import annotations

import re
from typing import Callable

from tosca_mlmt.rollout.engines.base import Generation

# Decoding the last few tokens is enough to see a whole answer line appear.
TAIL_TOKENS = 32


def shortest_prefix(token_ids: list[int], decode: Callable[[list[int]], str],
                    holds: Callable[[str], bool]) -> int | None:
    """Smallest n such that ``holds(decode(token_ids[:n]))``, or None where the whole text does not hold;
    ``holds`` must stay true once true (text is decoded from the start, so multi-token characters are
    whole). A binary search: O(log n) decodes."""
    if not holds(decode(token_ids)):
        return None
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(decode(token_ids[:mid])):
            hi = mid
        else:
            lo = mid + 1
    return lo


def stop_index(token_ids: list[int], decode: Callable[[list[int]], str], pattern: str) -> int | None:
    """Smallest n such that ``decode(token_ids[:n])`` contains a match of ``pattern``, or None."""
    rx = re.compile(pattern)
    return shortest_prefix(token_ids, decode, lambda text: bool(rx.search(text)))


def apply_stop(gen: Generation, decode: Callable[[list[int]], str], pattern: str | None) -> Generation:
    """Cut ``gen`` after its first complete answer line (finish_reason "answer")."""
    if not pattern:
        return gen
    n = stop_index(list(gen.token_ids), decode, pattern)
    if n is None or (n == len(gen.token_ids) and gen.finish_reason == "stop"):
        return gen  # no answer line, or the eos itself ended it: keep eos semantics
    return Generation(gen.token_ids[:n], gen.logprobs[:n], "answer")


class AnswerLine:
    """The engines' early stop: whether the ids sampled so far end a turn under ``pattern``. Run after
    every decoded token, so the test is cheap first: the last TAIL_TOKENS tokens must hold an answer
    line (the one that just completed lies there), and only then is the whole text searched. The
    whole-text search confirms a hit a tail decoded mid-character could fake, and finds the thinking
    block's close tag (after_reasoning) wherever it lies. The exact cut is apply_stop's."""

    def __init__(self, pattern: str):
        self.tail, self.full = re.compile(tail_pattern(pattern)), re.compile(pattern)

    def done(self, ids: list[int], decode: Callable[[list[int]], str]) -> bool:
        return bool(ids) and bool(self.tail.search(decode(ids[-TAIL_TOKENS:]))) and bool(self.full.search(decode(ids)))


# ---------------------------------------------------------------- reasoning models (episode.reasoning_tags)

# what after_reasoning puts between the close tag and the answer-line pattern (a group name no task uses)
_AFTER_CLOSE = "[\\s\\S]*?(?P<after_reasoning>"


def after_reasoning(pattern: str, tags: list[str]) -> str:
    """``pattern`` matched only after the close tag of a thinking block (``tags``: [open, close]; [] = as
    it is): an answer line the model writes while still thinking does not end its turn."""
    return f"{re.escape(tags[1])}{_AFTER_CLOSE}{pattern})" if tags else pattern


def tail_pattern(pattern: str) -> str:
    """The part of a stop pattern the last tokens hold when it has just matched: after_reasoning's
    answer line without its close tag, which may lie any distance back; any other pattern whole."""
    _, sep, inner = pattern.partition(_AFTER_CLOSE)
    return inner[:-1] if sep and inner.endswith(")") else pattern


def thinking_end(token_ids: list[int], decode: Callable[[list[int]], str], close: str) -> int | None:
    """The ids' index just after the token that completes their last ``close`` tag (what final_text reads
    begins there), or None where no close tag was written."""
    count = decode(token_ids).count(close)  # the shortest prefix holding every close tag
    return shortest_prefix(token_ids, decode, lambda text: text.count(close) >= count) if count else None


def final_text(text: str, tags: list[str]) -> str:
    """What a verifier reads of a turn: the text after the last close tag, and nothing where the
    thinking never closed (the turn ran out inside it; a template may open the block in the prompt,
    so a reply need not hold the open tag); the whole text without ``tags``."""
    if not tags:
        return text
    closed = text.rfind(tags[1])
    return text[closed + len(tags[1]):] if closed >= 0 else ""
