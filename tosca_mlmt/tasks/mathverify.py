"""Answer extraction and equivalence checking for math word problems (GSM8K, MATH).

Pure functions shared by the math tasks. Equivalence is tried cheapest first (normalized
string, then plain numbers, then symbolic math_verify); any one match counts as correct,
and no check ever raises: a parser failure only means that check did not match.
"""

from __future__ import annotations

import math
import re
import threading
import unicodedata
from functools import lru_cache

# v2: gsm8k scores an echo of its answer-format instruction wrong; v3: an answer line's number is
# read alone (extract_answer), not with the words after it, and an unevaluated expression is no
# answer to a numeric gold (unevaluated); v4: an answer line left empty ("The answer is:" where a turn
# was cut at max_new_tokens) is no answer, not the last number the reasoning wrote before it
VERIFIER_VERSION = "math-v4"

# math_verify bounds sympy with SIGALRM, which only works on the main thread; elsewhere
# the alarm would raise, so off the main thread we run it without a timeout.
_MV_TIMEOUT_S = 5

# The answer-line instruction of the word-problem tasks (arith, gsm8k): it names the line's
# prefix but holds no number or placeholder, so an echo of it gives the verifier nothing to read.
# "Work it out step by step" first: without it smollm2-135m writes the answer line at once and
# guesses (arith L1 greedy, 64 test problems: 17 % -> 55 %; L2: 6 % -> 20 %).
ANSWER_FORMAT = ("Work it out step by step, then end with a final line that starts with 'The answer is:' "
                 "followed by your number.")
# "The answer is: 42\n", "the answer is 3.5.", "The answer is: $1,200 dollars"; not "The answer is: 7 + 5 = 12"
# (a number followed by an operator is an expression in progress, not the answer)
ANSWER_LINE = r"[Tt]he (?:final )?answer is:?\**\s*\$?\s*-?\d[\d,]*(?:\.\d+)?(?:[ \t]*\n|\.(?=\D)|[ \t]+[A-Za-z]|\*)"
_ECHO_RE = re.compile(r"starts? with\W+the answer is\W+followed by (?:your|the) number", re.IGNORECASE)


# Where a final answer's number starts: after "The answer is:" (bold, "$" and spaces allowed), before
# an optional minus sign and the first digit.
_ANSWER_SLOT_RE = re.compile(r"[Tt]he (?:final )?answer is:?[ \t]*\**[ \t]*\$?[ \t]*(?=-?\d)")


def answer_slot(response: str) -> int | None:
    """Character index where the number of the response's last "The answer is: N" line starts,
    or None when it has no such line (episode.gold_prob scores the gold answer there)."""
    last = None
    for m in _ANSWER_SLOT_RE.finditer(response):
        last = m
    return None if last is None else last.end()


def echoes_format(response: str) -> bool:
    """True when a response repeats the answer-format instruction (a template echo, not an answer)."""
    return bool(_ECHO_RE.search(response))


_BOX_RE = re.compile(r"\\(?:boxed|fbox)")
_ANSWER_IS_RE = re.compile(r"the answer is\s*:?", re.IGNORECASE)
# A thousands comma sits between a digit and exactly three digits ("1,234", not "1,2").
_THOUSANDS_COMMA_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# A minus only counts as a sign when it does not follow a word or ")" (so "5-3" gives 3).
_NUMBER_RE = re.compile(
    r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|(?:(?<![\w)])-)?\.\d+"
)
_MAX_TEXT_NESTING = 32
_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
# Trailing unit words ("18 dollars", "5 cm"). They must be space-separated words of 2+
# letters so that "5x" or "2i" are never read as the number 5 or 2.
_UNIT_WORDS_RE = re.compile(r"(?<=\d)\s+[A-Za-z]{2,}(?:\s+[A-Za-z]+)*$")
_PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")


def _strip_thousands_commas(text: str) -> str:
    return _THOUSANDS_COMMA_RE.sub("", text)


def _brace_pairs(text: str) -> dict[int, int]:
    """Position of every ``{`` that is closed -> position of its ``}``, in one pass.

    ``\\{`` and ``\\}`` are literal braces in LaTeX, so they do not open or close groups.
    (Scanning from each box to its end instead is quadratic: 28 KB of unclosed boxes took
    6 s.)
    """
    pairs: dict[int, int] = {}
    stack: list[int] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def last_boxed(text: str) -> str | None:
    """The contents of the last balanced ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``.

    A truncated last box (unbalanced) falls back to the one before it.
    """
    boxes = list(_BOX_RE.finditer(text))
    pairs = _brace_pairs(text) if boxes else {}
    for m in reversed(boxes):
        start = m.end()  # indices, not slices: a copy of the rest per box is quadratic too
        while start < len(text) and text[start].isspace():
            start += 1
        if start < len(text) and text[start] == "{":
            if start in pairs:
                return text[start + 1 : pairs[start]].strip()
        elif text[m.end() : m.end() + 1] == " " and start < len(text):
            # "\boxed 5" (no braces) boxes the next token.
            return re.split(r"[\s$]", text[start:], maxsplit=1)[0]
    return None


def _clean_tail(text: str) -> str:
    """Trim a free-text final answer: whitespace, math ``$`` delimiters, markdown bold, trailing
    periods.

    One pass from each end (stripping one layer per loop turn was quadratic on ".$.$.$")."""
    i, j = 0, len(text)
    while i < j and (text[i].isspace() or text[i] in "$*"):
        i += 1
    while j > i and (text[j - 1].isspace() or text[j - 1] in "$.*"):
        j -= 1
    return text[i:j]


# A number that opens an answer line and ends it, as ANSWER_LINE (the turn's stop rule) reads its
# end: the line's end, a full stop, a comma before a word, a bracket or other mark, a space and a
# word ("12 apples", "12. So", "5 because ..."), bold or a "$". A number followed by an operator,
# another number, a colon or LaTeX ("7 + 5 = 12", "3, 4", "3:4", "2\sqrt{3}") is not matched: the
# whole line is the answer then.
_LEADING_NUMBER_RE = re.compile(
    r"[ \t]*(?:\*\*)?[ \t]*\$?[ \t]*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?(?:[ \t]*\\?%)?)"
    r"(?=[ \t]*$|[ \t]*\n|\.(?!\d)|[ \t]*[;!?)\]]|,[ \t]*(?:[A-Za-z]|$)|[ \t]+[A-Za-z(]|[ \t]*\*\*|[ \t]*\$)")


def answer_line_value(tail: str) -> str:
    """The answer of the rest of a "The answer is" line: its leading number where one opens and
    ends the answer (what follows it is the solver's comment, or the first piece of a word the stop
    rule kept: "12. So", "21 x"), else the whole line, trimmed."""
    m = _LEADING_NUMBER_RE.match(tail)
    return _strip_thousands_commas(m.group(1)) if m else _clean_tail(tail)


def extract_gold(answer_field: str) -> str:
    """The gold final answer from a GSM8K (``#### x``) or MATH (worked solution) answer.

    Raises ValueError when the field has no recognizable final answer.
    """
    if "####" in answer_field:
        gold = _strip_thousands_commas(answer_field.rsplit("####", 1)[1].strip())
    else:
        matches = list(_ANSWER_IS_RE.finditer(answer_field))
        if matches:
            # The MATH data repeats the final answer after "The answer is: " at the end.
            gold = _clean_tail(answer_field[matches[-1].end() :].split("\n", 1)[0])
        else:
            gold = last_boxed(answer_field) or ""
    if not gold:
        raise ValueError("no final answer found (expected '#### x', 'The answer is: x' or \\boxed{x})")
    return gold


def has_answer_marker(text: str) -> bool:
    """Whether ``text`` marks where its final answer is: ``####``, "The answer is" or a ``\\boxed``."""
    return "####" in text or bool(_ANSWER_IS_RE.search(text)) or bool(_BOX_RE.search(text))


def fold_width(text: str) -> str:
    """``text`` with full-width forms (U+FF01-U+FF5E, the ideographic space) as their ASCII letters,
    digits and signs: "４２" -> "42". Only the ``<wide>`` compatibility mappings, not all of NFKC,
    which would also turn "x²" into "x2" and "½" into "1⁄2", changing what a math answer says."""
    if text.isascii():
        return text
    return "".join(unicodedata.normalize("NFKC", ch) if unicodedata.decomposition(ch).startswith("<wide>")
                   else ch for ch in text)


def gold_problem(gold: str, numeric: bool = False) -> str | None:
    """Why ``gold`` cannot serve as a gold answer the verifier compares against, or None: empty, nothing
    left once spelling is normalised (``$``, ``\\text{}``), a number that is not finite ("nan", "inf",
    "1e400", a 400-digit integer: every such answer would compare equal to every other), or, with
    ``numeric``, not a plain number at all (gsm8k's ``#### banana``)."""
    if not gold.strip():
        return "is empty"
    if not normalize_string(gold):
        return f"{_short(gold)} is empty once normalised; nothing to compare against"
    try:
        value = float(gold.strip().replace(",", ""))
    except (ValueError, OverflowError):
        value = _to_float(gold)
    if value is not None and not math.isfinite(value):
        return f"{_short(gold)} is not a finite number"
    if numeric and value is None:
        return f"{_short(gold)} is not a number"
    return None


def _short(text: str) -> str:
    r = repr(text)
    return r if len(r) <= 40 else r[:37] + "..."


def extract_answer(response: str) -> str | None:
    """What the model answered, or None when the response contains no answer at all.

    Tried in order: last balanced ``\\boxed{}``; the last "The answer is[:] x" line (its leading
    number alone where the number ends the answer: answer_line_value); ``#### x``; the last number
    in the text. When the last "The answer is" line is empty, only what follows it is read
    ("The answer is:\\n12" gives 12): the solver named its answer's place, so a number it wrote
    before is not its answer, and a turn cut at max_new_tokens right after the cue has none.
    """
    boxed = last_boxed(response)
    if boxed:
        return boxed
    matches = list(_ANSWER_IS_RE.finditer(response))
    if matches:
        after = response[matches[-1].end() :]
        tail = answer_line_value(after.split("\n", 1)[0])
        if tail:
            return tail
        response = after
    if "####" in response:
        tail = _clean_tail(response.rsplit("####", 1)[1].split("\n", 1)[0])
        if tail:
            return _strip_thousands_commas(tail)
    numbers = _NUMBER_RE.findall(response)
    return _strip_thousands_commas(numbers[-1]) if numbers else None


def _unwrap_text(text: str) -> str:
    """``\\text{abc}`` -> ``abc`` (also nested and the bold/roman variants).

    Each pass unwraps one level; the cap keeps a pathological nesting (thousands deep)
    linear instead of quadratic, far beyond any real answer's depth."""
    for _ in range(_MAX_TEXT_NESTING):
        prev, text = text, _TEXT_WRAPPER_RE.sub(r"\1", text)
        if text == prev:
            break
    return text


def normalize_string(text: str) -> str:
    """A canonical spelling of a LaTeX answer, for exact comparison."""
    out = _unwrap_text(text)
    for old, new in (
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\$", ""),
        ("$", ""),
    ):
        out = out.replace(old, new)
    return "".join(out.split()).rstrip(".")


def _to_float(text: str) -> float | None:
    """``text`` as a plain number ("1,234", "\\$18.90", "50\\%", "3/4", "18 dollars"), else None."""
    without_units = _UNIT_WORDS_RE.sub("", _unwrap_text(text).strip().rstrip("."))
    cleaned = normalize_string(without_units).replace("\\%", "").replace("%", "")
    cleaned = _strip_thousands_commas(cleaned)
    if not _PLAIN_NUMBER_RE.fullmatch(cleaned):
        return None
    try:
        if "/" in cleaned:
            top, bottom = cleaned.split("/")
            return float(top) / float(bottom)
        return float(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def _numeric_equal(pred: str, gold: str) -> bool:
    a, b = _to_float(pred), _to_float(gold)
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def _mv_timeout() -> int | None:
    return _MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=8192)
def _mv_parse(text: str, timeout_s: int | None) -> tuple:
    """math_verify's parse of a bare answer; cached because a gold is verified many times."""
    from math_verify import parse  # imported lazily: it pulls in sympy and latex2sympy

    try:
        # \boxed{} is the anchor math_verify's LaTeX extractor matches with top priority.
        return tuple(parse(f"\\boxed{{{text}}}", parsing_timeout=timeout_s))
    except Exception:  # noqa: BLE001 - any parser failure just means "no parse"
        return ()


def _math_verify_equal(pred: str, gold: str) -> bool:
    from math_verify import verify

    timeout_s = _mv_timeout()
    gold_parsed, pred_parsed = _mv_parse(gold, timeout_s), _mv_parse(pred, timeout_s)
    if not gold_parsed or not pred_parsed:
        return False
    try:
        return bool(verify(list(gold_parsed), list(pred_parsed), timeout_seconds=timeout_s))
    except Exception:  # noqa: BLE001 - a verifier crash is a non-match, never an error
        return False


# Numbers joined by an operator with no "=" ("11 + 2"), or an operator left hanging ("16 + 12 +").
_UNEVALUATED_RE = re.compile(r"\d\s*[-+*×÷]\s*-?\d|[-+*×÷/]\s*$")


def unevaluated(pred: str) -> bool:
    """An arithmetic expression with no result: "11 + 2", "16 + 12 +" (not "3/4", "-3", "11 + 2 = 13").
    math_verify evaluates "11 + 2" to 13, so a solver restating the question's own sum would be
    scored right without computing anything (1.3 % of the right verdicts in the stored arith runs,
    "16 + 12 +" for 12 among them)."""
    return "=" not in pred and bool(_UNEVALUATED_RE.search(pred))


def match_method(pred: str, gold: str) -> str | None:
    """The first check under which ``pred`` equals ``gold``: "string", "numeric",
    "math_verify"; None when none matches. Against a numeric gold, an unevaluated expression
    never matches (unevaluated)."""
    if not pred or not gold:
        return None
    if unevaluated(pred) and _to_float(gold) is not None:
        return None
    checks = (
        ("string", lambda p, g: normalize_string(p) == normalize_string(g)),
        ("numeric", _numeric_equal),
        ("math_verify", _math_verify_equal),
    )
    for name, check in checks:
        try:
            if check(pred, gold):
                return name
        except Exception:  # noqa: BLE001 - a crashing check counts as a non-match
            continue
    return None


def is_equivalent(pred: str, gold: str) -> bool:
    """Whether the predicted final answer equals the gold one (never raises)."""
    return match_method(pred, gold) is not None
