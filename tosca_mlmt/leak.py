"""Answer leakage: does the writer's feedback g give the gold answer away? (pure)

A writer that says "The answer is 15." teaches the solver to copy, not to correct; its refine
is right for the wrong reason and the writer's reward for that decision is unearned. This
module measures it, so collect can log ``leak_rate`` and train-upper can subtract
``episode.leak_penalty`` from a leaking decision's reward.

Rules:
* a numeric gold ("15", "15.0", "$1,500", "-3", "0.5", "3/4") leaks when a number in g has
  the same value ("15", "15.00", "$15", "15." all count; "150" and "1.5" do not), written in
  digits or in words ("fifteen", "twenty-one", "one hundred and five"): a writer penalised for
  digits could otherwise learn to spell the answer out. Words for zero to nine are prose as
  often as numbers ("one of the numbers", "the two steps"), so they count only after an answer
  cue ("the answer is seven", "equals two", "= three");
* any other gold (math500's "\\frac{1}{2}", "x^2+1") leaks when it appears in g with spaces
  and ``$`` removed, as a whole token for purely alphanumeric golds (so a gold "x" does not
  match every "x" in prose);
* it is not measured (None) for code tasks, whose gold is a reference program: a writer
  quoting the student's own line would match the reference too and count as a leak; nor
  when the gold already appears in the question (mentioning a number the question gives,
  as "reread_question" asks, gives nothing away); nor for an empty gold.
Quoting a right attempt back ("your 15 is right") counts too: it tells the solver the answer.
Rates are taken over measured feedback turns only.
"""

from __future__ import annotations

import re
from fractions import Fraction

# Tasks whose gold answer is a program, not a value (see the module doc for why they are skipped).
CODE_TASKS = frozenset({"mbpp"})

# A number as a writer may spell it: optional sign and currency, thousands commas, decimals,
# a fraction "a/b". A minus is a sign only when it follows no word character or ")", so the
# "3" of "10-3" is read as 3, not -3.
_NUMBER_RE = re.compile(r"(?:(?<![\w)])-)?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"
                        r"|(?:(?<![\w)])-)?\$?\.\d+")
_GOLD_NUMBER_RE = re.compile(r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:/\d+)?|-?\$?\.\d+")


def number_value(text: str) -> Fraction | None:
    """The exact value of a number as written ("$1,500.00" -> 1500), or None if it is not one."""
    s = text.strip().rstrip(".").replace("$", "").replace(",", "")
    if not s:
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_in(text: str) -> list[Fraction]:
    """The values of every number written in ``text``, in order."""
    out = []
    for m in _NUMBER_RE.finditer(text):
        v = number_value(m.group())
        if v is not None:
            out.append(v)
    return out


_UNIT_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
               "sixteen seventeen eighteen nineteen").split()
_WORD_VALUE = {w: i for i, w in enumerate(_UNIT_WORDS)} | {
    w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), start=2)}
_SCALE = {"hundred": 100, "thousand": 1000, "million": 1_000_000}
_WORD_RE = re.compile(r"[A-Za-z]+")
# What makes a following small number word an answer rather than prose.
_CUE_RE = re.compile(r"(?:\b(?:answer|result|total|sum|difference|product)\s+(?:is|should\s+be|would\s+be|will\s+be)"
                     r"|\bequals|=)\s*:?\s*$", re.IGNORECASE)


def _spelled_runs(text: str) -> list[tuple[int, int]]:
    """(value, start) of each number written in words, left to right. A unit after a unit or a
    teen starts a new number ("two three" is 2 and 3); "and" and hyphens join the parts of one
    ("one hundred and five", "twenty-one")."""
    out: list[tuple[int, int]] = []
    total = current = 0
    start = last = None  # last: "unit" (0-19), "tens", "scale"; None outside a number

    def flush():
        nonlocal total, current, start, last
        if start is not None:
            out.append((total + current, start))
        total = current = 0
        start = last = None

    words = list(_WORD_RE.finditer(text))
    for k, m in enumerate(words):
        w = m.group().lower()
        gap = text[words[k - 1].end():m.start()] if k else ""
        if start is not None and gap.strip(" -") != "":  # punctuation between words ends a number
            flush()
        if w in _WORD_VALUE:
            v = _WORD_VALUE[w]
            tens = v >= 20
            if last == "unit" or (last == "tens" and (tens or current % 10)):
                flush()
            if start is None:
                start = m.start()
            current += v
            last = "tens" if tens else "unit"
        elif w in _SCALE and start is not None and (last != "scale" or (_SCALE[w] > 100 and current)):
            if _SCALE[w] == 100:
                current *= 100
            else:
                total, current = total + current * _SCALE[w], 0
            last = "scale"
        elif w == "and" and last == "scale" and k + 1 < len(words) and words[k + 1].group().lower() in _WORD_VALUE:
            continue
        else:
            flush()
    flush()
    return out


def spelled_numbers_in(text: str, cue_small: bool = True) -> list[int]:
    """The values of the numbers ``text`` writes in words, in order. ``cue_small``: a number below
    ten counts only after an answer cue (the module doc says why)."""
    return [v for v, at in _spelled_runs(text) if v >= 10 or not cue_small or _CUE_RE.search(text[:at])]


def _squash(text: str) -> str:
    return re.sub(r"[\s$]+", "", text)


def _contains(haystack: str, gold: str) -> bool:
    """Whether the gold (already squashed) is in the squashed haystack; whole-token for
    alphanumeric golds."""
    if gold.isalnum():  # spaces are the token boundaries here: keep them
        return re.search(rf"(?<![A-Za-z0-9]){re.escape(gold)}(?![A-Za-z0-9])", haystack.replace("$", "")) is not None
    return gold in _squash(haystack)


def answer_leaked(gold: str, feedback: str, question: str = "", task: str = "") -> bool | None:
    """True when the feedback gives the gold answer away, False when it does not, None when
    leakage is not measured for this problem (module doc: code tasks, gold in the question)."""
    if task in CODE_TASKS or not gold or not gold.strip():
        return None
    g = gold.strip()
    if _GOLD_NUMBER_RE.fullmatch(g.rstrip(".")):
        value = number_value(g)
        if value is not None:
            if value in numbers_in(question) or value in spelled_numbers_in(question, cue_small=False):
                return None
            return value in numbers_in(feedback) or value in spelled_numbers_in(feedback)
    squashed = _squash(g)
    if _contains(question, squashed):
        return None
    return _contains(feedback, squashed)


def episode_leaks(ep) -> list[bool | None]:
    """``answer_leaked`` for each feedback turn of an episode (round order). ``ep`` is an
    Episode; only its problem and turns are read, so this module needs nothing of ours."""
    p = ep.problem
    return [answer_leaked(p.answer, t.text or "", p.question, p.task) for t in ep.turns if t.kind == "feedback"]


def leak_rate(episodes) -> float | None:
    """Share of measured feedback turns that leak the answer; None when none was measured
    (no feedback turns, or only code tasks)."""
    flags = [f for ep in episodes for f in episode_leaks(ep) if f is not None]
    return sum(flags) / len(flags) if flags else None
