from tosca_mlmt.tasks.arith import ArithTask, generate


def test_problems_are_a_pure_function_of_level_and_index():
    assert generate(3, 17) == generate(3, 17)
    assert generate(3, 17).id == "arith-L3-000017"
    assert generate(3, 17).question != generate(3, 18).question


def test_splits_disjoint_ids_stable_answers_correct():
    for level in range(1, 6):
        t = ArithTask(level)
        train = t.load("train", 60).problems
        test = t.load("test", 30).problems
        assert {p.question for p in train}.isdisjoint({p.question for p in test})
        assert [p.id for p in t.load("train", 60).problems] == [p.id for p in train]
        assert len({p.id for p in train}) == len(train)
    # the answer is what the question says (checked by evaluating the bare expression)
    for p in ArithTask(2).load("train", 50).problems:
        expr = p.question.removeprefix("What is ").removesuffix("?")
        assert int(p.answer) == eval(expr)  # noqa: S307 - our own generated expression


def test_verify_reads_the_final_answer():
    t = ArithTask(1)
    p = t.load("train", 1).problems[0]
    right, wrong = p.answer, str(int(p.answer) + 1)
    assert t.verify(p, f"Let me add. The answer is: {right}").correct
    assert not t.verify(p, f"The answer is: {wrong}").correct
    assert not t.verify(p, "I do not know").correct
    assert t.verify(p, f"The answer is: {right}").reward == 1.0
