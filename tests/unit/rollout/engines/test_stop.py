"""Solver turns end at the first complete answer line, on both engines, token-exactly."""

from dataclasses import replace

import pytest

from tosca_mlmt.rollout.engines.base import Generation
from tosca_mlmt.rollout.engines.stop import apply_stop, stop_index
from tosca_mlmt.tasks.arith import ArithTask
from tosca_mlmt.tasks.mathverify import ANSWER_FORMAT, ANSWER_LINE


def _chars(text):  # a "tokenizer" with one token per character
    return [ord(c) for c in text], lambda ids: "".join(map(chr, ids))


@pytest.mark.parametrize("text, kept", [
    ("3 + 4 = 7.\nThe answer is: 7\nThen more text", "3 + 4 = 7.\nThe answer is: 7\n"),
    ("the answer is 3.5. And", "the answer is 3.5. "),  # a full stop counts once a non-digit follows
    ("The answer is: 1,200 apples in all", "The answer is: 1,200 a"),
    ("The answer is: 12 then The answer is: 13\n", "The answer is: 12 t"),
])
def test_cut_right_after_the_token_that_completes_the_answer_line(text, kept):
    ids, decode = _chars(text)
    n = stop_index(ids, decode, ANSWER_LINE)
    assert decode(ids[:n]) == kept
    g = apply_stop(Generation(tuple(ids), tuple(float(i) for i in range(len(ids))), "length"), decode, ANSWER_LINE)
    assert g.finish_reason == "answer" and g.token_ids == tuple(ids[:n]) and g.logprobs == tuple(map(float, range(n)))


@pytest.mark.parametrize("text, number", [
    ("3 + 4 = 7.\nThe answer is: 7\nThen more text", "7"),
    ("the answer is 3.5. And", "3.5"),
    ("The answer is: 1,200 apples in all", "1200"),
    ("The answer is 12. So Ana has 12.", "12"),
    ("The answer is: 25, but I am not sure", "25"),
    ("The answer is 12 Kofi keeps", "12"),
    ("**The answer is: 12** because", "12"),
    ("The answer is: 5 because 7 + 5 = 12", "5"),
])
def test_the_verifier_reads_the_number_the_stop_rule_cut_after(text, number):
    """The cut keeps the first piece of the word after the answer ("12. So", "12 K"): the verifier
    must read the number the rule ended the line at, not the line with that piece (which math_verify
    read as "12 K" or as the last number of "5 because 7 + 5 = 12")."""
    ids, decode = _chars(text)
    cut = decode(ids[:stop_index(ids, decode, ANSWER_LINE)])
    task = ArithTask(1)
    problem = task.load("train", 1).problems[0]
    for seen in (cut, text):
        for gold, right in ((number, True), ("13", False)):
            v = task.verify(replace(problem, answer=gold), seen)
            assert (v.extracted, v.correct) == (number, right), (seen, gold)


@pytest.mark.parametrize("text", ["The answer is: 12", "The answer is: <number>", "I think 12.", "",
                                  "The answer is: 7 + 5"])
def test_no_complete_answer_line_keeps_the_generation(text):
    ids, decode = _chars(text)
    g = Generation(tuple(ids), tuple(0.0 for _ in ids), "length")
    assert apply_stop(g, decode, ANSWER_LINE) is g


def test_a_template_echo_scores_wrong_and_the_format_has_no_readable_answer():
    t = ArithTask(1)
    p = t.load("train", 1).problems[0]
    assert t.verify(p, f"The answer is: {p.answer}\n").correct
    echo = f"{ANSWER_FORMAT}\nThe answer is: {p.answer}"
    v = t.verify(p, echo)
    assert not v.correct and v.info["echo"]
    assert t.verify(p, ANSWER_FORMAT).extracted is None


THINK = ["<think>", "</think>"]


@pytest.mark.parametrize("text, kept, read", [
    # an answer line inside the thinking neither ends the turn nor is verified
    ("<think>The answer is: 3.\nNo.</think>\nThe answer is: 5.\nMore", "<think>The answer is: 3.\nNo.</think>\nThe answer is: 5.\n",
     "\nThe answer is: 5.\n"),
    # a turn that ran out while thinking has no answer to verify
    ("<think>The answer is: 3.\nStill thinking", None, ""),
    # the template opened the block in the prompt (R1 distills): the reply holds only the close tag
    ("Hm, 2 + 2. The answer is: 4.\n</think>The answer is: 4.\nMore", "Hm, 2 + 2. The answer is: 4.\n</think>The answer is: 4.\n",
     "The answer is: 4.\n"),
])
def test_a_reasoning_models_turn_ends_and_is_read_after_its_thinking(text, kept, read):
    """episode.reasoning_tags: the stop pattern matches only after the close tag, and the verifier reads
    what follows it (stop.after_reasoning, stop.final_text)."""
    from tosca_mlmt.rollout.engines.stop import after_reasoning, final_text

    ids, decode = _chars(text)
    n = stop_index(ids, decode, after_reasoning(ANSWER_LINE, THINK))
    assert (None if n is None else decode(ids[:n])) == kept
    assert final_text(kept or text, THINK) == read
    assert after_reasoning(ANSWER_LINE, []) == ANSWER_LINE and final_text(text, []) == text  # [] = no block


@pytest.mark.slow
def test_hf_engine_stops_at_the_answer_line_token_exactly(policies):
    """Greedy decoding with and without the stop rule: each stopped turn is exactly the prefix of
    the unstopped one that ends at its first answer line, logprobs included."""
    from tosca_mlmt.prompts import ChatFormat
    from tosca_mlmt.rollout.engines.base import SamplingParams
    from tosca_mlmt.rollout.engines.hf import HFEngine

    tok = policies.tokenizer("solver")
    fmt = ChatFormat(tok, policies.eos_ids("solver"))
    # the rule is pattern-agnostic; a pattern greedy decoding reaches mid-turn tests the mechanics
    prompts = [fmt.first_prompt(f"Count from {a} to {a + 9}, separated by commas.") for a in (1, 2, 11, 21)]
    pattern = r"\d+, \d+, \d+,"
    eng = HFEngine(policies, 4)
    full = [g[0] for g in eng.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0), "solver")]
    cut = [g[0] for g in eng.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0,
                                                               stop_regex=pattern), "solver")]
    n_cut = 0
    for f, c in zip(full, cut):
        n = stop_index(list(f.token_ids), tok.decode, pattern)
        if n is None or (n == len(f.token_ids) and f.finish_reason == "stop"):
            assert c.token_ids == f.token_ids and c.finish_reason == f.finish_reason
            continue
        n_cut += 1
        assert c.finish_reason == "answer" and c.token_ids == f.token_ids[:n]
        assert c.logprobs == pytest.approx(f.logprobs[:n], abs=1e-5)
    assert n_cut >= 1, [tok.decode(list(f.token_ids)) for f in full]


def test_early_stop_finds_an_answer_line_far_after_the_thinking():
    """stop.AnswerLine, the early stop both engines run per token: it fires at exactly the token
    apply_stop cuts after, also where the close tag lies further back than the TAIL_TOKENS it reads
    first (a reasoning model's summary between its thinking and its answer), and never for an
    answer line written while still thinking."""
    import re
    import types

    import torch

    from tosca_mlmt.rollout.engines.hf import _AnswerLineStop
    from tosca_mlmt.rollout.engines.stop import TAIL_TOKENS, AnswerLine, after_reasoning

    pattern = after_reasoning(ANSWER_LINE, THINK)
    text = ("<think>2 + 2. The answer is: 4.\nYes.</think>" + "So, adding the two numbers step by step, " * 3
            + "The answer is: 4.\nDone")
    ids, decode = _chars(text)
    cut = stop_index(ids, decode, pattern)
    assert cut is not None and decode(ids[:cut]).endswith("The answer is: 4.\n")
    assert cut - text.index("</think>") > TAIL_TOKENS  # the case a tail-only test missed
    assert not re.search(pattern, decode(ids[:cut][-TAIL_TOKENS:]))
    line = AnswerLine(pattern)
    fired = [n for n in range(1, len(ids) + 1) if line.done(ids[:n], decode)]
    assert fired[0] == cut  # not at the answer line inside the thinking, and not later than the cut
    # without reasoning tags the pattern is read whole, in the tail as before
    plain = AnswerLine(ANSWER_LINE)
    assert plain.tail.pattern == plain.full.pattern == ANSWER_LINE
    # the HF engine's stopping criterion runs the same test on each row's sampled ids (after the prompt)
    width = 5
    rows = torch.tensor([[0] * width + ids[:cut], [0] * (width + 1) + ids[:cut - 1]])  # left-padded, as HF
    stop = _AnswerLineStop(types.SimpleNamespace(decode=decode), width, pattern)
    assert stop(rows, None).tolist() == [True, False]


@pytest.mark.parametrize("text, kept", [
    ("<think>a</think>rest", "rest"),
    ("<think>a</think>b</think>tail", "tail"),  # the last close tag, as final_text reads
    ("</think>", ""),
    ("<think>never closed", None),
])
def test_thinking_end_is_where_final_text_begins(text, kept):
    from tosca_mlmt.rollout.engines.stop import final_text, thinking_end

    ids, decode = _chars(text)
    end = thinking_end(ids, decode, THINK[1])
    assert (None if end is None else decode(ids[end:])) == kept
    assert end is None or final_text(text, THINK) == kept
