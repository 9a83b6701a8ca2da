"""``arith``: procedurally generated integer word problems, the embedded default task.

Problems are a pure function of (level, index): the same id always means the same
problem on every machine. A problem belongs to the test split when a hash of its
*content* says so, so train and test never share a question even when two indices
happen to generate the same numbers.
"""

from __future__ import annotations

import random

from tosca_mlmt.tasks.base import LoadResult, Problem, Verdict, check_split, stable_split
from tosca_mlmt.engines.stop import ANSWER_LINE
from tosca_mlmt.tasks.mathverify import ANSWER_FORMAT, echoes_format, extract_answer, is_equivalent

VERIFIER_VERSION = "arith-v2"  # v2: an echo of the answer-format instruction scores wrong
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo")
ITEMS = ("apples", "books", "coins", "pencils", "stickers", "marbles", "cards", "shells")


def _level1(r: random.Random) -> tuple[str, int]:
    a, b = r.randint(1, 9), r.randint(1, 9)
    return f"What is {a} + {b}?", a + b


def _level2(r: random.Random) -> tuple[str, int]:
    a, b = r.randint(10, 40), r.randint(1, 9)
    if r.random() < 0.5:
        return f"What is {a} + {b}?", a + b
    return f"What is {a} - {b}?", a - b


def _level3(r: random.Random) -> tuple[str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(2, 20), r.randint(2, 20)
    if r.random() < 0.5:
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
    a, b = max(a, b) + r.randint(1, 9), min(a, b)
    return f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?", a - b


def _level4(r: random.Random) -> tuple[str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b, c = r.randint(5, 30), r.randint(2, 15), r.randint(1, 5)
    return (f"{name} has {a} {item}, buys {b} more, then loses {c}. How many {item} does {name} have?",
            a + b - c)


def _level5(r: random.Random) -> tuple[str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    boxes, per, extra = r.randint(2, 9), r.randint(2, 12), r.randint(1, 20)
    return (f"{name} has {boxes} boxes with {per} {item} in each box and {extra} loose {item}. "
            f"How many {item} does {name} have in total?", boxes * per + extra)


LEVELS = {1: _level1, 2: _level2, 3: _level3, 4: _level4, 5: _level5}


def generate(level: int, index: int) -> Problem:
    r = random.Random(f"arith-v1:{level}:{index}")
    question, answer = LEVELS[level](r)
    return Problem("arith", f"arith-L{level}-{index:06d}", question, str(answer), stable_split(question),
                   {"level": level})


class ArithTask:
    name = "arith"
    verifier_version = VERIFIER_VERSION
    # No placeholder a verifier could read as an answer, and a line the engines can stop on.
    answer_format = ANSWER_FORMAT
    stop_regex = ANSWER_LINE

    def __init__(self, level: int = 1):
        if level not in LEVELS:
            from tosca_mlmt.errors import ConfigError

            raise ConfigError(f"invalid value {level!r} for field 'task.level'; allowed: 1..5")
        self.level = level

    def load(self, split: str, limit: int | None = None, skip_bad_rows: bool = False) -> LoadResult:
        check_split(split)
        want = limit or 1000  # "the whole split" of an infinite generator: a fixed 1000 problems
        out, seen, index = [], set(), 0
        while len(out) < want:
            p = generate(self.level, index)
            index += 1
            if p.split == split and p.question not in seen:  # small levels repeat; keep ids unique per question
                seen.add(p.question)
                out.append(Problem(p.task, p.id, p.question, p.answer, split, p.meta))
            if index > 20 * want + 2_000:
                break  # level 1 has only 81 distinct questions: stop once new ones stop appearing
        return LoadResult(out)

    def instruction(self, problem: Problem) -> str:
        return f"{problem.question}\n{self.answer_format}"

    def verify(self, problem: Problem, response: str) -> Verdict:
        if echoes_format(response):  # repeating the instruction is not an answer, whatever number follows
            return Verdict(False, 0.0, None, {"echo": True})
        pred = extract_answer(response)
        ok = pred is not None and is_equivalent(pred, problem.answer)
        return Verdict(ok, 1.0 if ok else 0.0, pred)
