"""The step checker: honest, test-time information about an arithmetic attempt (pure).

It reads only the question and the attempt, never the gold answer, so a writer that sees its
report knows nothing it could not know at test time. It does two things:

* re-evaluates every ``a + b = c`` the attempt writes (``+ - * / × ÷``, several operands,
  ordinary precedence) and reports each one whose stated result is wrong: a *slip*;
* flags a final answer equal to a number the question gives (a copied operand: "18 - 1" answered
  "18"), the other common way a small solver fails, unless a step of the attempt that holds arrives at it
  ("18 - 9 = 9" is worked out, not copied).

Model text is never evaluated as Python: a regular expression finds candidate equations made
of digits and operators only, and a small parser over exact fractions computes them, with
bounds on operand count and digits so hostile text costs nothing. A report says *where* the
attempt went wrong; ``hint`` turns it into feedback that names the step without its value
("Recheck 7 + 10."), which is what the tool template writes and what a learned writer is
compared with.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from tosca_mlmt.leak import number_value, numbers_in

MAX_OPERANDS = 12  # longer chains are not checked: nothing a solver writes by hand needs more
MAX_DIGITS = 24  # per operand; bounds the cost of exact arithmetic on hostile text

_NUM = r"\$?\d+(?:,\d{3})*(?:\.\d+)?"
_OP = r"(?:[-+*/×÷]|(?<=\s)[x×](?=\s))"
# An operand chain with at least one operator, "=", a number. A digit or "." just before the
# chain or just after the result means we cut through a longer number: no match. The chain's
# length is bounded in the pattern so that scanning hostile text stays linear in its length.
_EQUATION_RE = re.compile(rf"(?<![\d.,])(?P<lhs>-?{_NUM}(?:\s*{_OP}\s*{_NUM}){{1,{MAX_OPERANDS - 1}}})\s*=\s*"
                          rf"(?P<rhs>-?{_NUM})(?![\d]|\.\d)")
_CHAIN_BEFORE_RE = re.compile(rf"{_OP}\s*$")
_TOKEN_RE = re.compile(rf"\s*(?:(?P<num>{_NUM})|(?P<op>[-+*/×÷x]))")


@dataclass(frozen=True)
class Slip:
    """One equation the attempt wrote whose result is wrong."""

    expression: str  # the left side as written, spacing normalised: "7 + 10"
    written: str  # what the attempt says it equals: "18"


@dataclass(frozen=True)
class StepReport:
    equations: int  # how many equations were checked
    slips: tuple[Slip, ...]
    copied: str | None  # the final answer, when it equals a number the question gives

    @property
    def flagged(self) -> bool:
        return bool(self.slips) or self.copied is not None

    def features(self) -> tuple[float, float, float]:
        """A compact state for the writer's Q: (flagged, a slip found, a copied operand)."""
        return float(self.flagged), float(bool(self.slips)), float(self.copied is not None)

    def to_json(self) -> dict:
        return {"equations": self.equations, "flagged": self.flagged, "copied": self.copied,
                "slips": [{"expression": s.expression, "written": s.written} for s in self.slips]}

    def describe(self) -> str:
        """The writer's line (episode.writer_sees: tool): the attempt's own numbers, never a recomputed one."""
        found = []
        if self.slips:
            first, more = self.slips[0], len(self.slips) - 1
            found.append(f"`{first.expression} = {first.written}` does not hold"
                         + (f" (nor {more} later step(s))" if more else ""))
        if self.copied is not None:
            found.append(f"the final answer {self.copied} is a number the question gives")
        if found:
            return f"Step check: {'; '.join(found)}."
        if self.equations:
            return f"Step check: all {self.equations} equation(s) in the attempt hold."
        return "Step check: no arithmetic to check."

    def hint(self) -> str:
        return hint(self)


def evaluate(expression: str) -> Fraction | None:
    """The exact value of ``a op b op c ...`` (digits and ``+ - * / × ÷ x`` only; ``*`` and ``/``
    bind tighter), or None when it is not such an expression, is too long, or divides by zero."""
    tokens = _tokens(expression)
    if tokens is None:
        return None
    operands, ops = tokens[0::2], tokens[1::2]
    if len(operands) != len(ops) + 1 or len(operands) > MAX_OPERANDS:
        return None
    values = [_operand(t) for t in operands]
    if any(v is None for v in values) or any(_is_op(t) is False for t in ops):
        return None
    terms, signs, current = [], [], values[0]
    for op, v in zip(ops, values[1:]):
        if op in "+-":
            terms.append(current)
            signs.append(op)
            current = v
        elif op in "*×x":
            current = current * v
        elif v == 0:
            return None
        else:
            current = current / v
    total = terms[0] if terms else current
    for sign, term in zip(signs, terms[1:] + [current]):
        total = total + term if sign == "+" else total - term
    return total


def _tokens(expression: str) -> list[str] | None:
    """Numbers and operators in order (a leading minus joined to the first number), or None
    when anything else is in the text."""
    tokens, at, end = [], 0, len(expression.rstrip())
    while at < end:
        m = _TOKEN_RE.match(expression, at)
        if m is None:
            return None
        tokens.append(m.group("num") or m.group("op"))
        at = m.end()
    if len(tokens) > 1 and tokens[0] == "-":
        tokens = ["-" + tokens[1], *tokens[2:]]
    return tokens


def _operand(text: str) -> Fraction | None:
    if len(re.sub(r"\D", "", text)) > MAX_DIGITS:
        return None
    return number_value(text)


def _is_op(token: str) -> bool:
    return token in {"+", "-", "*", "/", "×", "÷", "x"}


def _matches(written: Fraction, value: Fraction, rhs: str) -> bool:
    """Exact for whole numbers; a decimal result counts when it is the value rounded to its places."""
    places = len(rhs.partition(".")[2])
    return written == value if not places else abs(written - value) <= Fraction(1, 2 * 10 ** places)


def check_steps(question: str, attempt: str, answer: str | None) -> StepReport:
    """The report on ``attempt`` (its extracted final ``answer``, None when it gave none)."""
    checked, slips, derived = 0, [], set()
    for m in _EQUATION_RE.finditer(attempt):
        lhs, rhs = m.group("lhs"), m.group("rhs")
        if _CHAIN_BEFORE_RE.search(attempt[max(0, m.start() - 8):m.start()]):
            continue  # the tail of a longer chain than we check: its left side is not all here
        value, written = evaluate(lhs), number_value(rhs)
        if value is None or written is None:
            continue
        checked += 1
        if not _matches(written, value, rhs):
            slips.append(Slip(" ".join(_tokens(lhs) or [lhs]), rhs))
        else:
            derived.add(written)
    final = number_value(answer) if answer else None
    # an answer a step that holds arrives at is worked out, not copied ("18 - 9 = 9" asked of 18 and 9)
    copied = answer.strip() if final is not None and final in numbers_in(question) and final not in derived else None
    return StepReport(checked, tuple(slips), copied)


def hint(report: StepReport) -> str:
    """Feedback that points at the flagged step without stating its value (the tool template)."""
    if report.slips:
        return f"Recheck {report.slips[0].expression}."
    if report.copied is not None:
        return "Your answer is a number the question gives; recheck which operation the question asks for."
    if not report.equations:  # nothing was checked: "check out" would vouch for an answer nobody verified
        return "Write out the calculation that gives your answer."
    return "Your steps check out."
