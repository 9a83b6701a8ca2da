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


def _skeleton(question: str) -> str:
    """A question with its numbers, names and items blanked: the phrasing template it came from."""
    from tosca_mlmt.tasks.arith import ITEMS, NAMES

    text = re.sub(r"\d+", "#", question)
    for word in sorted(NAMES + ITEMS, key=len, reverse=True):  # "toy cars" before "cars"-like overlaps
        text = re.sub(rf"\b{re.escape(word)}\b", "_", text)
    return text


def _template_skeleton(template: str) -> str:
    return re.sub(r"\{[a-z]\}", lambda m: "_" if m.group() in ("{n}", "{i}") else "#", template)


@pytest.mark.parametrize("level", LEVELS)
def test_unseen_split_asks_test_facts_in_phrasings_training_never_uses(level):
    from tosca_mlmt.tasks import arith

    unseen = ArithTask(level).load("test-unseen").problems
    test = ArithTask(level).load("test").problems
    assert len(unseen) == len(test) and all(p.split == "test-unseen" for p in unseen)
    # paired by position with the test set: the same fact, so only the phrasing differs
    assert [p.meta["fact"] for p in unseen] == [p.meta["fact"] for p in test]
    assert [p.answer for p in unseen] == [p.answer for p in test]
    assert all(arith.fact_split(level, *arith._fact_of(p)) == "test" for p in unseen)
    train_skeletons = {_skeleton(generate(level, i).question) for i in range(20_000)}
    train_skeletons |= {_skeleton(p.question) for p in test}
    # every template the generator has, not only those 20,000 indices happened to draw
    generator = arith.BARE + arith.ADD_WORDS + arith.SUB_WORDS + arith.ADD_STORY + arith.SUB_STORY
    generator += arith.THREE_STEP + arith.BOXES
    seen_templates = {_template_skeleton(t).replace("{o}", o).replace("{w}", arith.OPS[o][0])
                      for t in generator for o in arith.OPS}
    unseen_skeletons = {_skeleton(p.question) for p in unseen}
    assert len(unseen_skeletons) >= 2 and unseen_skeletons.isdisjoint(train_skeletons | seen_templates)
    assert unseen_skeletons <= {_template_skeleton(t) for pool in arith.UNSEEN.values() for t in pool}
    for p in unseen:  # the question states the fact's operands and nothing else
        op, x = arith._fact_of(p)
        assert sorted(int(v) for v in re.findall(r"\d+", p.question)) == sorted(x)
        assert int(p.answer) == arith.fact_answer(op, x)


@pytest.mark.parametrize("level", LEVELS)
def test_shipped_unseen_file_is_what_the_generator_makes(level, tmp_path):
    """Regenerate: python -m tosca_mlmt.tasks.arith data/arith (the test files stay byte for byte)."""
    from tosca_mlmt.tasks.arith import write_test_files

    write_test_files(tmp_path)
    for name in (f"test-L{level}.jsonl", f"test-unseen-L{level}.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA_DIR / name).read_bytes(), name


def test_unseen_split_is_arith_only_and_eval_accepts_it():
    from tosca_mlmt.config import load_config
    from tosca_mlmt.errors import ConfigError

    assert load_config(None, {"task.split": "test-unseen"}).task.split == "test-unseen"
    with pytest.raises(ConfigError, match="task.split"):
        load_config(None, {"task.name": "gsm8k", "task.split": "test-unseen"})
