"""``arith``: procedurally generated integer problems, the embedded default task.

A problem is a *fact* (an operator and its operands, e.g. 7 + 5) put in one of many phrasings
(bare expressions, instructions, word problems with names and items). Facts, not questions,
are split: a hash of the fact sends it to train or test, so no test problem asks a fact that
training ever showed, in any phrasing. Training problems are unlimited: problem ``i`` of a
level is a pure function of (level, i). The test set of each level is fixed: 500 problems
shipped in ``data/arith/test-L{level}.jsonl`` (regenerated bit-identically by
``python -m tosca_mlmt.tasks.arith data/arith``, which a test checks).

Levels (difficulty rises with the operand range and the number of steps):
    1  a + b, a, b in 1..9
    2  a + b or a - b, a in 10..19, b in 1..9            (between 1 and 3)
    3  a + b or a - b, a in 10..40, b in 1..9
    4  add or take away, a, b in 2..20, as a story
    5  three steps: a + b - c
    6  boxes * per box + loose ones
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

from tosca_mlmt.tasks.base import LoadResult, Problem, Verdict, check_split
from tosca_mlmt.tasks.mathverify import (ANSWER_FORMAT, ANSWER_LINE, answer_slot, echoes_format, extract_answer,
                                         is_equivalent)
from tosca_mlmt.tasks.steps import StepReport, check_steps

# v2: an echo of the answer-format instruction scores wrong; v3: an answer line's number is read alone, and
# an unevaluated expression ("11 + 2") is no answer; v4: an empty last answer line reads only what follows it
VERIFIER_VERSION = "arith-v4"
GENERATOR_VERSION = "arith-gen-v2"
TEST_SIZE = 500
TEST_FRACTION = 0.2
DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "arith"

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena", "Mo", "Nia",
         "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq")
ITEMS = ("apples", "books", "coins", "pencils", "stickers", "marbles", "cards", "shells", "stamps", "beads",
         "cookies", "toy cars")

# Phrasings of a two-operand fact; {a} {b} operands, {o} the symbol, {w} the operator's word.
BARE = ("What is {a} {o} {b}?", "Compute {a} {o} {b}.", "Calculate {a} {o} {b}.", "{a} {o} {b} = ?",
        "What is the value of {a} {o} {b}?", "Work out {a} {o} {b}.", "Evaluate {a} {o} {b}.",
        "What number is {a} {w} {b}?", "Tell me {a} {w} {b}.", "How much is {a} {w} {b}?")
ADD_WORDS = ("Find the sum of {a} and {b}.", "Add {a} and {b}.", "What do you get when you add {b} to {a}?",
             "What is {b} more than {a}?")
SUB_WORDS = ("Find the difference when {b} is taken from {a}.", "Subtract {b} from {a}.",
             "What is {a} take away {b}?", "What is {b} less than {a}?")
ADD_STORY = ("{n} has {a} {i} and gets {b} more. How many {i} does {n} have now?",
             "{n} had {a} {i}. A friend gave {n} {b} more. How many {i} does {n} have?",
             "There are {a} {i} in a bag and {b} {i} on the table. How many {i} are there in all?",
             "{n} collected {a} {i} on Monday and {b} {i} on Tuesday. How many {i} did {n} collect?")
SUB_STORY = ("{n} has {a} {i} and gives away {b}. How many {i} does {n} have left?",
             "{n} had {a} {i} and lost {b} of them. How many {i} are left?",
             "There were {a} {i} in a box. {n} took out {b}. How many {i} are still in the box?",
             "{n} bought {a} {i} and used {b}. How many {i} does {n} have now?")
THREE_STEP = ("{n} has {a} {i}, buys {b} more, then loses {c}. How many {i} does {n} have?",
              "What is {a} + {b} - {c}?", "Compute {a} plus {b} minus {c}.",
              "A shelf holds {a} {i}. {n} adds {b} and then removes {c}. How many {i} are on the shelf?")
BOXES = ("{n} has {a} boxes with {b} {i} in each box and {c} loose {i}. How many {i} does {n} have in total?",
         "What is {a} * {b} + {c}?", "There are {a} bags of {b} {i} and {c} more {i}. How many {i} are there?",
         "{n} packs {b} {i} into each of {a} boxes and keeps {c} aside. How many {i} does {n} have?")
OPS = {"+": ("plus", lambda a, b: a + b), "-": ("minus", lambda a, b: a - b)}
# Phrasings only the test-unseen split uses (never the training generator nor the test set): whether what a
# method learned carries over to the same kind of fact asked in words it never saw. Same names and items.
UNSEEN = {"+": ("If you start with {a} and add {b}, what number do you end up with?",
                "Increase {a} by {b}. What is the result?", "Start at {a} and count up {b}. Where do you stop?",
                "What total do {a} and {b} make together?",
                "{n} counted {a} {i} in one jar and {b} {i} in another jar. Together, what is the count of {i}?",
                "A class has {a} {i}. The teacher brings {b} extra {i}. What is the total number of {i} now?"),
          "-": ("If you start with {a} and remove {b}, what number is left?",
                "Decrease {a} by {b}. What is the result?", "Start at {a} and count down {b}. Where do you stop?",
                "{a} is how much more than {b}?",
                "{n} owned {a} {i} but sold {b} of them at a yard sale. What number of {i} remain with {n}?",
                "A jar held {a} {i}. After {n} removed {b}, what number of {i} stayed in the jar?"),
          "+-": ("Begin with {a}, add {b}, then subtract {c}. What do you get?",
                 "{n} started the day with {a} {i}, found {b} more at noon and gave {c} to a friend in the evening. "
                 "What number of {i} does {n} end the day with?"),
          "*+": ("Multiply {a} by {b}, then add {c}. What is the result?",
                 "{n} fills {a} crates, putting {b} {i} in every crate, and has {c} {i} left over. "
                 "What is the total count of {i}?")}


def _two_operand(level: int, r: random.Random) -> tuple[str, tuple]:
    """A random fact of a one-step level: (op, operands)."""
    if level == 1:
        return "+", (r.randint(1, 9), r.randint(1, 9))
    hi = 19 if level == 2 else 40
    op = r.choice("+-")
    if level == 4:
        a, b = r.randint(2, 20), r.randint(2, 20)
        return op, ((a, b) if op == "+" else (max(a, b) + r.randint(1, 9), min(a, b)))
    return op, (r.randint(10, hi), r.randint(1, 9))


def random_fact(level: int, r: random.Random) -> tuple[str, tuple]:
    if level in (1, 2, 3, 4):
        return _two_operand(level, r)
    if level == 5:
        return "+-", (r.randint(5, 30), r.randint(2, 15), r.randint(1, 5))
    return "*+", (r.randint(2, 9), r.randint(2, 12), r.randint(1, 20))


def fact_answer(op: str, x: tuple) -> int:
    if op in OPS:
        return OPS[op][1](*x)
    return x[0] + x[1] - x[2] if op == "+-" else x[0] * x[1] + x[2]


def fact_key(op: str, x: tuple) -> str:
    """Addition is commutative: 3 + 5 and 5 + 3 are one fact, so neither order leaks into test."""
    return f"{op}:{','.join(map(str, sorted(x) if op == '+' else x))}"


def fact_split(level: int, op: str, x: tuple) -> str:
    h = int.from_bytes(hashlib.sha256(f"{GENERATOR_VERSION}:{level}:{fact_key(op, x)}".encode()).digest()[:8], "big")
    return "test" if (h % 10_000) < TEST_FRACTION * 10_000 else "train"


def phrase(level: int, op: str, x: tuple, r: random.Random) -> str:
    n, i = r.choice(NAMES), r.choice(ITEMS)
    if op in ("+-", "*+"):
        return r.choice(THREE_STEP if op == "+-" else BOXES).format(a=x[0], b=x[1], c=x[2], n=n, i=i)
    story = ADD_STORY if op == "+" else SUB_STORY
    words = ADD_WORDS if op == "+" else SUB_WORDS
    pool = story if level == 4 else BARE + words + story
    return r.choice(pool).format(a=x[0], b=x[1], o=op, w=OPS[op][0], n=n, i=i)


def phrase_unseen(op: str, x: tuple, r: random.Random) -> str:
    """``x`` in one of the UNSEEN phrasings (the test-unseen split's only)."""
    n, i = r.choice(NAMES), r.choice(ITEMS)
    return r.choice(UNSEEN[op]).format(**dict(zip("abc", x)), n=n, i=i)


def _problem(level: int, op: str, x: tuple, question: str, pid: str, split: str) -> Problem:
    return Problem("arith", pid, question, str(fact_answer(op, x)), split,
                   {"level": level, "fact": fact_key(op, x)})


def generate(level: int, index: int) -> Problem:
    """Training problem ``index`` of ``level``: a train fact in a random phrasing."""
    r = random.Random(f"{GENERATOR_VERSION}:train:{level}:{index}")
    while True:
        op, x = random_fact(level, r)
        if fact_split(level, op, x) == "train":
            return _problem(level, op, x, phrase(level, op, x, r), f"arith-L{level}-{index:07d}", "train")


def fixed_test_set(level: int, n: int = TEST_SIZE) -> list[Problem]:
    """The fixed test problems of ``level``: test facts only, distinct questions where the level has room."""
    r = random.Random(f"{GENERATOR_VERSION}:test:{level}")
    out, seen = [], set()
    tries = 0
    while len(out) < n:
        tries += 1
        op, x = random_fact(level, r)
        if fact_split(level, op, x) != "test":
            continue
        q = phrase(level, op, x, r)
        if q in seen and tries < 200 * n:  # small levels run out of distinct questions: then repeat
            continue
        seen.add(q)
        out.append(_problem(level, op, x, q, f"arith-L{level}-test-{len(out):04d}", "test"))
    return out


def unseen_test_set(level: int) -> list[Problem]:
    """The test-unseen problems of ``level``: problem k asks the fact of the fixed test set's problem k (test
    facts only, paired by position) in an UNSEEN phrasing."""
    r = random.Random(f"{GENERATOR_VERSION}:test-unseen:{level}")
    out = []
    for k, p in enumerate(fixed_test_set(level)):
        op, x = _fact_of(p)
        out.append(_problem(level, op, x, phrase_unseen(op, x, r), f"arith-L{level}-unseen-{k:04d}", "test-unseen"))
    return out


def _fact_of(p: Problem) -> tuple[str, tuple]:
    """(op, operands) of a problem's stored fact; a sum's operands are stored sorted and asked larger first,
    as levels 2 and 3 generate them."""
    op, operands = p.meta["fact"].split(":")
    x = tuple(int(v) for v in operands.split(","))
    return op, (tuple(sorted(x, reverse=True)) if op == "+" else x)


TEST_FILES = {"test": ("test-L{level}.jsonl", fixed_test_set), "test-unseen": ("test-unseen-L{level}.jsonl",
                                                                                unseen_test_set)}


def _read_test_file(level: int, split: str = "test") -> list[Problem] | None:
    path = DATA_DIR / TEST_FILES[split][0].format(level=level)
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [Problem("arith", r["id"], r["question"], r["answer"], split, r["meta"]) for r in rows]


def facts_of(ids: list[str]) -> list[str]:
    """The fact of each test problem id (test or test-unseen, any level): the cluster a fact-level bootstrap
    resamples. An id of no shipped test set raises ValueError naming it."""
    known: dict[str, str] = {}
    for level in sorted({_level_of(i) for i in ids}):
        for split, (_, make) in TEST_FILES.items():
            known.update((p.id, p.meta["fact"]) for p in (_read_test_file(level, split) or make(level)))
    missing = next((i for i in ids if i not in known), None)
    if missing is not None:
        raise ValueError(f"problem id {missing!r} is no arith test problem")
    return [known[i] for i in ids]


def _level_of(pid: str) -> int:
    level = pid.split("-")[1][1:] if pid.startswith("arith-L") else ""
    if not level.isdigit() or int(level) not in LEVELS:
        raise ValueError(f"problem id {pid!r} is no arith test problem")
    return int(level)


def write_test_files(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for level in LEVELS:
        for name, make in TEST_FILES.values():
            lines = [json.dumps({"id": p.id, "question": p.question, "answer": p.answer, "meta": p.meta},
                                sort_keys=True) for p in make(level)]
            (folder / name.format(level=level)).write_text("\n".join(lines) + "\n", encoding="utf-8")


LEVELS = (1, 2, 3, 4, 5, 6)


class ArithTask:
    name = "arith"
    verifier_version = VERIFIER_VERSION
    # No placeholder a verifier could read as an answer, and a line the engines can stop on.
    answer_format = ANSWER_FORMAT
    stop_regex = ANSWER_LINE
    answer_slot = staticmethod(answer_slot)  # where episode.gold_prob scores the gold answer

    def __init__(self, level: int = 1):
        if level not in LEVELS:
            from tosca_mlmt.errors import ConfigError

            raise ConfigError(f"invalid value {level!r} for field 'task.level'; allowed: 1..{LEVELS[-1]}")
        self.level = level

    def load(self, split: str, limit: int | None = None, skip_bad_rows: bool = False) -> LoadResult:
        """train: the first ``limit`` generated problems (1000 when no limit: the generator has no end);
        test: the level's fixed test set (the shipped file; generated when the package has no data/);
        test-unseen: the same test facts in phrasings training never uses (UNSEEN)."""
        if split in TEST_FILES:
            problems = _read_test_file(self.level, split) or TEST_FILES[split][1](self.level)
            return LoadResult(problems[:limit] if limit else problems)
        check_split(split)
        return LoadResult([generate(self.level, i) for i in range(limit or 1000)])

    def instruction(self, problem: Problem) -> str:
        return f"{problem.question}\n{self.answer_format}"

    def verify(self, problem: Problem, response: str) -> Verdict:
        if echoes_format(response):  # repeating the instruction is not an answer, whatever number follows
            return Verdict(False, 0.0, None, {"echo": True})
        pred = extract_answer(response)
        ok = pred is not None and is_equivalent(pred, problem.answer)
        return Verdict(ok, 1.0 if ok else 0.0, pred)

    def check_attempt(self, problem: Problem, response: str) -> StepReport:
        """The step checker's report on ``response`` (tasks/steps.py), with the answer this task's own
        extraction reads; it sees the question and the attempt only, never the gold answer."""
        return check_steps(problem.question, response, extract_answer(response))


if __name__ == "__main__":
    write_test_files(Path(sys.argv[1]) if len(sys.argv) > 1 else DATA_DIR)
