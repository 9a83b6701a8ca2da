"""episode.gold_prob: where the gold answer is scored, and that the score is the solver's own probability."""

import math
from dataclasses import replace

import pytest

from tosca_mlmt.rollout.gold import OPENER, gold_continuation, gold_prob
from tosca_mlmt.tasks.mathverify import answer_slot

# a toy tokenizer: a fixed vocabulary, longest match first; one id per piece
VOCAB = ["The", " answer", " is", ":", ": 1", " ", "1", "2", "3", "4", "+", "=", ".", "\n", "7", "so"]


def _encode(text):
    out, i = [], 0
    while i < len(text):
        piece = max((v for v in VOCAB if text.startswith(v, i)), key=len)
        out.append(VOCAB.index(piece))
        i += len(piece)
    return out


def _decode(ids):
    return "".join(VOCAB[i] for i in ids)


def test_answer_slot_is_where_the_last_answer_lines_number_starts():
    assert answer_slot("3+4=7. The answer is: 7\n") == len("3+4=7. The answer is: ")
    two = "The answer is: 1\nso The final answer is **$-12"
    assert answer_slot(two) == len(two) - len("-12")
    assert answer_slot("3+4=7.") is None and answer_slot("the answer is seven") is None


def test_continuation_keeps_the_sampled_prefix_and_scores_the_gold_at_the_slot():
    ids = _encode("1+2=3.\nThe answer is: 3\n")
    prefix, target = gold_continuation(ids, _decode, _encode, answer_slot, "4")
    assert _decode(prefix) == "1+2=3.\nThe answer is: " and prefix == ids[:len(prefix)]
    assert _decode(target) == "4"
    # its own answer as the gold: prefix + target are the sampled tokens themselves
    prefix, target = gold_continuation(ids, _decode, _encode, answer_slot, "3")
    assert prefix + target == ids[:len(prefix) + len(target)]


def test_a_token_straddling_the_slot_is_re_encoded_with_the_gold():
    ids = _encode("The answer is: 1\n")  # ": 1" is one token, straddling the slot
    assert _decode([ids[3]]) == ": 1"
    prefix, target = gold_continuation(ids, _decode, _encode, answer_slot, "7")
    assert _decode(prefix) == "The answer is" and _decode(target) == ": 7"


def test_no_answer_line_appends_the_tasks_opener():
    ids = _encode("1+2=3.")
    prefix, target = gold_continuation(ids, _decode, _encode, answer_slot, "3")
    assert prefix == ids and _decode(target) == "\n" + OPENER + "3"
    assert gold_prob([]) == 0.0 and gold_prob([math.log(0.5), math.log(0.5)]) == pytest.approx(0.25)


@pytest.mark.slow
def test_runner_scores_the_gold_with_the_solvers_own_probability(tiny_cfg, policies):
    """With each problem's gold set to what the greedy solver answered, gold_prob must equal the
    product of the probabilities the engine sampled those answer tokens with (a reference from
    generation, not from scoring)."""
    from tosca_mlmt.rollout.engines.hf import HFEngine
    from tosca_mlmt.rollout.runner import EpisodeRunner
    from tosca_mlmt.tasks.arith import ArithTask

    cfg = replace(tiny_cfg, solver_sampling=replace(tiny_cfg.solver_sampling, temperature=0.0, max_new_tokens=48),
                  episode=replace(tiny_cfg.episode, rounds=0, n_samples=1))
    task = ArithTask(1)
    engine = HFEngine(policies, batch_size=8)
    problems = task.load("train", 6).problems
    first = EpisodeRunner(cfg, task, engine, policies).run(problems)
    tok = policies.tokenizer("solver")
    own = {}
    for ep in first:
        z = ep.solver_turns[0]
        slot = answer_slot(z.text)
        if slot is not None:
            own[ep.problem.id] = z.text[slot:].split("\n")[0].rstrip(".").strip()
    assert own, "the greedy solver wrote no answer line on 6 level-1 problems"
    relabelled = [replace(p, answer=own.get(p.id, p.answer)) for p in problems]
    scored = replace(cfg, episode=replace(cfg.episode, gold_prob=True))
    eps = EpisodeRunner(scored, task, engine, policies).run(relabelled)
    checked = 0
    for ep, ep0 in zip(eps, first):
        z = ep.solver_turns[0]
        assert z.response_ids == ep0.solver_turns[0].response_ids  # greedy: the same attempt
        assert 0.0 <= z.info["gold_prob"] <= 1.0
        if ep.problem.id not in own:
            continue
        ids = list(z.response_ids)
        if ids and ids[-1] in policies.eos_ids("solver"):
            ids = ids[:-1]
        prefix, target = gold_continuation(ids, lambda i: tok.decode(i, skip_special_tokens=True),
                                           lambda t: list(tok.encode(t, add_special_tokens=False)), answer_slot,
                                           ep.problem.answer)
        if prefix + target != ids[:len(prefix) + len(target)]:
            continue  # the number was sampled in a non-canonical tokenization: no sampled reference
        sampled = z.logprobs[len(prefix):len(prefix) + len(target)]
        assert z.info["gold_prob"] == pytest.approx(math.exp(sum(sampled)), rel=1e-4, abs=1e-6)
        checked += 1
    assert checked >= 1


@pytest.mark.slow
def test_gold_prob_refuses_a_task_without_an_answer_line(tiny_cfg, policies):
    from tosca_mlmt.errors import ConfigError
    from tosca_mlmt.rollout.runner import EpisodeRunner

    class NoLine:
        name = "noline"

    cfg = replace(tiny_cfg, episode=replace(tiny_cfg.episode, gold_prob=True))
    with pytest.raises(ConfigError, match="episode.gold_prob"):
        EpisodeRunner(cfg, NoLine(), engine=None, policies=policies)
