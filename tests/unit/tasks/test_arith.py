import json
import re

import pytest

from tosca_mlmt.tasks.arith import DATA_DIR, LEVELS, ArithTask, fact_answer, generate, fixed_test_set


def test_problems_are_a_pure_function_of_level_and_index():
    assert generate(3, 17) == generate(3, 17)
    assert generate(3, 17).id == "arith-L3-0000017"
    assert len({generate(1, i).question for i in range(200)}) > 100  # many phrasings of few facts


@pytest.mark.parametrize("level", LEVELS)
def test_test_set_is_fixed_and_shares_no_fact_with_training(level):
    t = ArithTask(level)
    test = t.load("test").problems
    assert len(test) >= 500 and len({p.id for p in test}) == len(test)
    # the shipped file is exactly what the generator makes (regenerate: python -m tosca_mlmt.tasks.arith data/arith)
    shipped = [json.loads(x) for x in (DATA_DIR / f"test-L{level}.jsonl").read_text().splitlines()]
    assert [r["question"] for r in shipped] == [p.question for p in fixed_test_set(level)]
    train = t.load("train", 5000).problems
    assert {p.meta["fact"] for p in train}.isdisjoint({p.meta["fact"] for p in test})
    assert len({p.id for p in train}) == len(train) and all(p.split == "train" for p in train)


@pytest.mark.parametrize("level", LEVELS)
def test_answers_follow_from_the_fact_and_the_question_states_it(level):
    for p in ArithTask(level).load("train", 200).problems + ArithTask(level).load("test", 100).problems:
        op, operands = p.meta["fact"].split(":")
        x = tuple(int(v) for v in operands.split(","))
        if op == "+":  # stored sorted: either order is the fact
            assert int(p.answer) == sum(x)
        else:
            assert int(p.answer) == fact_answer(op, x)
        numbers = [int(v) for v in re.findall(r"\d+", p.question)]
        assert sorted(numbers) == sorted(x), (p.question, x)


def test_verify_reads_the_final_answer():
    t = ArithTask(1)
    p = t.load("train", 1).problems[0]
    right, wrong = p.answer, str(int(p.answer) + 1)
    assert t.verify(p, f"Let me add. The answer is: {right}").correct
    assert not t.verify(p, f"The answer is: {wrong}").correct
    assert not t.verify(p, "I do not know").correct
    assert t.verify(p, f"The answer is: {right}").reward == 1.0
