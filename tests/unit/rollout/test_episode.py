"""The three-turn episode on the hf engine: its structure on the debug base, what reads the text on the embedded model."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from tosca_mlmt.lower.trajectory import episode_to_trajectory
from tosca_mlmt.rollout.engines.base import Generation
from tosca_mlmt.rollout.engines.hf import HFEngine
from tosca_mlmt.rollout.runner import EpisodeRunner
from tosca_mlmt.tasks.arith import ArithTask

pytestmark = pytest.mark.slow


class RecordingTask(ArithTask):
    """arith, but remembers which problem every verify call was made for."""

    def __init__(self):
        super().__init__(level=1)
        self.calls = []

    def verify(self, problem, response):
        self.calls.append((problem.id, response))
        return super().verify(problem, response)


@pytest.fixture(scope="module")
def run(debug_cfg, debug_policies):
    """Two rounds on the debug base: the structure, contexts and log-probs checked on it do not depend on
    what the model knows (its turns run to their limits, every context at its longest)."""
    from dataclasses import replace

    cfg = replace(debug_cfg, episode=replace(debug_cfg.episode, rounds=2, n_samples=2))
    task = RecordingTask()
    problems = task.load("train", 2).problems  # two: a verify call can go to the wrong one
    runner = EpisodeRunner(cfg, task, HFEngine(debug_policies, batch_size=8), debug_policies)
    return cfg, task, problems, runner.run(problems), runner


def test_structure_same_problem_every_turn(run):
    cfg, task, problems, episodes, _ = run
    assert len(episodes) == len(problems) * 2
    for ep in episodes:
        assert [t.kind for t in ep.turns] == ["solve", "feedback", "refine", "feedback", "refine"]
        assert [t.round for t in ep.turns] == [0, 1, 1, 2, 2]
        assert ep.problem.id in ep.episode_id
    # every verify call of an episode's turns used that episode's problem, and only it
    by_text = {}
    for pid, text in task.calls:
        by_text.setdefault(text, set()).add(pid)
    for ep in episodes:
        for t in ep.solver_turns:
            assert ep.problem.id in by_text[t.text]
            assert t.reward == task.__class__.__mro__[1].verify(task, ep.problem, t.text).reward


def test_token_exact_contexts(run):
    _, _, _, episodes, runner = run
    for ep in episodes:
        solve, fb1, ref1, fb2, ref2 = ep.turns
        t1 = solve.prompt_ids + solve.response_ids
        assert ref1.prompt_ids[: len(t1)] == t1
        t2 = ref1.prompt_ids + ref1.response_ids
        assert ref2.prompt_ids[: len(t2)] == t2
        # the feedback ids sit verbatim inside the refine prompt; the attempt inside the writer prompt
        fb_ids = runner.fmt["writer"].strip_eos(fb1.response_ids)
        assert not any(t.truncated for t in ep.turns)
        span = ref1.feedback_span
        assert ref1.prompt_ids[span.start:span.end] == fb_ids and "feedback_span" not in ref1.info
        z = runner.fmt["solver"].strip_eos(solve.response_ids)
        assert _contains(fb1.prompt_ids[: fb1.state_len], z)
        # round-2 writer state holds both attempts and the first feedback
        assert _contains(fb2.prompt_ids[: fb2.state_len], runner.fmt["solver"].strip_eos(ref1.response_ids))


def test_writer_logs_behaviour_policy(run):
    _, _, _, episodes, _ = run
    for ep in episodes:
        for t in ep.turns:
            if t.kind == "feedback":
                assert t.behaviour_prob == pytest.approx(1 / 6)
                assert len(t.behaviour_probs) == 6 and t.q_values is None
                assert 0 <= t.strategy < 6 and t.strategy_name


def test_engine_logprobs_equal_a_teacher_forced_forward(run, debug_policies):
    """The engine's sampling logprobs are log pi(token|context) of the model: recompute them
    independently with one forward pass over prompt + response."""
    _, _, _, episodes, _ = run
    policies = debug_policies
    model = policies.model("solver")
    for t in [episodes[0].turns[0], episodes[1].turns[2], episodes[0].turns[1]]:
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with policies.use(t.role), torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(t.prompt_ids) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t.response_ids)[:, None]).squeeze(-1)
        np.testing.assert_allclose(t.logprobs, ref.numpy(), atol=2e-3)


def _contains(seq, sub):
    n = len(sub)
    return any(seq[i : i + n] == sub for i in range(len(seq) - n + 1))


@pytest.mark.parametrize("sees", ["verdict", "confidence"])
def test_writer_sees_its_signal_and_the_strategy_prefix_opens_g(tiny_cfg, policies, sees):
    """writer_sees puts one line per attempt into the writer's state (the verdict is the
    verifier's, the confidence the bucketed mean logprob); strategy_prefix puts the strategy's
    sentence at the start of the span the context bonus removes; summaries label the verdict.
    The attempts are scripted (AnsweringEngine) so that both verdicts and all three confidence
    levels occur, which a few sampled attempts of the embedded model do not promise."""
    from dataclasses import replace

    from tosca_mlmt.metrics import summarize

    cfg = replace(tiny_cfg, episode=replace(tiny_cfg.episode, rounds=1, n_samples=2, writer_sees=sees,
                                            strategy_prefix=True))
    task = ArithTask(1)
    problems = task.load("train", 3).problems
    engine = AnsweringEngine(policies, mixed_answers(problems), "Check the sum once more, digit by digit.")
    runner = EpisodeRunner(cfg, task, engine, policies)
    episodes = runner.run(problems)
    assert {ep.turns[0].correct for ep in episodes} == {True, False}
    assert {round(ep.turns[0].logprobs[0], 1) for ep in episodes} == {-0.1, -0.4, -1.0}  # high, medium, low
    wtok, stok = policies.tokenizer("writer"), policies.tokenizer("solver")
    for ep in episodes:
        z, fb, ref = ep.turns
        state = wtok.decode(fb.prompt_ids[: fb.state_len])
        if sees == "verdict":
            assert f"verdict on this attempt: {'correct' if z.correct else 'incorrect'}." in state
        else:
            lp = float(np.mean(z.logprobs))
            lo, hi = cfg.episode.confidence_edges
            assert f"confidence in this attempt: {'low' if lp < lo else 'medium' if lp < hi else 'high'}." in state
        g = stok.decode(ref.prompt_ids[ref.feedback_span.start:ref.feedback_span.end])
        prefix = cfg.episode.strategies[fb.strategy]["prefix"]
        assert g.startswith(prefix) and g.endswith(fb.text.strip()[-10:])
    want = "privileged:writer_sees_verdict" if sees == "verdict" else "honest"
    assert summarize(episodes)["environment"] == want


def test_verdict_feedback_is_labelled_and_counterfactual_refines_are_scored(tiny_cfg, policies):
    from dataclasses import replace

    from tosca_mlmt.metrics import summarize

    cfg = replace(tiny_cfg, episode=replace(tiny_cfg.episode, rounds=1, n_samples=2, feedback="verdict",
                                            counterfactual=True))
    task = ArithTask(1)
    problems = task.load("train", 2).problems
    # scripted attempts, one problem right and one wrong: both labels and both counterfactual scores occur
    engine = AnsweringEngine(policies, mixed_answers(problems), "unused: verdict feedback is fixed")
    episodes = EpisodeRunner(cfg, task, engine, policies).run(problems)
    assert {ep.turns[2].info["counterfactual_reward"] for ep in episodes} == {0.0, 1.0}
    for ep in episodes:
        z, fb, ref = ep.turns
        assert fb.text == ("Your answer is right." if z.correct else "Your answer is wrong.")
        # episode.counterfactual: the refine was also sampled without g and scored by the same verifier
        cf = ref.info["counterfactual_reward"]
        assert cf in (0.0, 1.0) and (cf == 1.0) == (ref.info["counterfactual_extracted"] == ep.problem.answer)
    assert summarize(episodes)["environment"] == "privileged:verdict_feedback"


def test_hf_sampling_ignores_a_checkpoints_own_generation_config(debug_policies):
    """A base whose generation_config.json sets sampling fields (Qwen's set repetition_penalty, some
    min_p) must still sample as configured: transformers fills every field our config leaves unset
    from the checkpoint's, and the penalty would also change the recorded raw log-probs."""
    from tosca_mlmt.rollout.engines.base import SamplingParams

    inner = debug_policies.model("solver").get_base_model()
    engine = HFEngine(debug_policies, batch_size=4)
    prompts = [debug_policies.tokenizer("solver").encode(q) for q in ("What is 2 + 3?", "Say 7 7 7 7 7.")]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)
    clean = engine.generate(prompts, params, "solver")
    saved = inner.generation_config
    inner.generation_config = poisoned = type(saved).from_dict({**saved.to_dict(), "repetition_penalty": 50.0,
                                                                      "min_p": 0.5})
    try:
        assert engine.generate(prompts, params, "solver") == clean
        assert inner.generation_config is poisoned  # handed back untouched
    finally:
        inner.generation_config = saved


def scripted_replies(policies, feedback: str) -> dict[str, list[int]]:
    """ScriptedEngine's replies: the solver answers 3, the writer says ``feedback``; both end at eos."""
    eos = policies.eos_ids("solver")[0]
    return {"solver": policies.tokenizer("solver").encode("The answer is 3.") + [eos],
            "writer": policies.tokenizer("writer").encode(feedback) + [eos]}


class ScriptedEngine:
    """Answers every prompt with fixed tokens and keeps what it was given."""

    name = "scripted"

    def __init__(self, replies: dict[str, list[int]]):
        self.replies, self.given = replies, []

    def generate(self, prompts, params, policy):
        self.given += [list(p) for p in prompts]
        g = Generation(tuple(self.replies[policy]), (-0.5,) * len(self.replies[policy]), "stop")
        return [[g] * params.n for _ in prompts]


class AnsweringEngine(ScriptedEngine):
    """ScriptedEngine whose solver answers each problem (found by its question in the prompt) as
    ``answers`` says, question -> (answer, per-token log-prob)."""

    def __init__(self, policies, answers: dict[str, tuple[str, float]], feedback: str):
        super().__init__(scripted_replies(policies, feedback))
        self.tok, self.eos, self.answers = policies.tokenizer("solver"), policies.eos_ids("solver")[0], answers

    def generate(self, prompts, params, policy):
        if policy != "solver":
            return super().generate(prompts, params, policy)
        self.given += [list(p) for p in prompts]
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            ((answer, lp),) = [v for q, v in self.answers.items() if q in text]
            ids = self.tok.encode(f"The answer is {answer}.") + [self.eos]
            out.append([Generation(tuple(ids), (lp,) * len(ids), "stop")] * params.n)
        return out


def mixed_answers(problems) -> dict[str, tuple[str, float]]:
    """AnsweringEngine's answers: the first problem right and confident (high under the default
    confidence_edges), the others wrong, at medium and low confidence."""
    levels = [-0.1, -0.4, -1.0]
    return {p.question: (p.answer if i == 0 else str(int(p.answer) + 1), levels[i % 3])
            for i, p in enumerate(problems)}


def test_a_cut_prompt_is_recorded_as_the_engine_saw_it(tiny_cfg, policies):
    """episode.max_prompt_tokens keeps a prompt's end: the turn records those ids, says it was cut,
    and its feedback span and writer state are counted in them; train-lower skips the episode."""
    from dataclasses import replace

    task = ArithTask(1)
    problems = task.load("train", 1).problems
    replies = scripted_replies(policies, "Check the sum once more, digit by digit.")

    def run(limit):
        cfg = replace(tiny_cfg, episode=replace(tiny_cfg.episode, rounds=1, n_samples=1, max_prompt_tokens=limit))
        engine = ScriptedEngine(replies)
        runner = EpisodeRunner(cfg, task, engine, policies)
        return runner.run(problems)[0], engine, runner

    full, _, _ = run(10**6)
    full_z, full_fb, full_ref = full.turns
    cut = 3
    limit = len(full_ref.prompt_ids) - cut
    assert len(full_z.prompt_ids) < limit and full_ref.feedback_span.start >= cut
    ep, engine, runner = run(limit)
    z, fb, ref = ep.turns
    assert engine.given == [t.prompt_ids for t in ep.turns]  # each turn holds exactly what the engine got
    assert not z.truncated and z.prompt_ids == full_z.prompt_ids
    assert ref.truncated and ref.prompt_ids == full_ref.prompt_ids[cut:]
    assert (ref.feedback_span.start, ref.feedback_span.end) == (full_ref.feedback_span.start - cut,
                                                                 full_ref.feedback_span.end - cut)
    w = len(full_fb.prompt_ids) - len(fb.prompt_ids)
    assert fb.truncated == (w > 0) and fb.prompt_ids[: fb.state_len] == full_fb.prompt_ids[w: full_fb.state_len]
    assert runner.truncated_prompts == 1 + (w > 0)
    assert episode_to_trajectory(ep) is None and episode_to_trajectory(full) is not None


class QSpy:
    """The policies, with a Q that steers from the first decision and keeps every state it read."""

    q_decisions = 10**9

    def __init__(self, inner, n_actions: int):
        self.inner, self.n_actions, self.states = inner, n_actions, []

    def q_values(self, states, signals):
        self.states += [list(s) for s in states]
        return torch.arange(self.n_actions, dtype=torch.float32).repeat(len(states), 1)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_q_reads_the_writer_state_the_recorded_prompt_holds_when_the_prompt_is_cut(tiny_cfg, policies):
    """A writer prompt over episode.max_prompt_tokens is cut before Q reads the state, sized for the
    longest strategy text: the state Q chose from at collect is the state train-upper reads from the
    recorded prompt (prompt_ids[:state_len]), whichever strategy was drawn."""
    task = ArithTask(1)
    problems = task.load("train", 2).problems
    replies = scripted_replies(policies, "Check the sum once more.")

    def run(limit):
        cfg = replace(tiny_cfg, episode=replace(tiny_cfg.episode, rounds=1, n_samples=2, max_prompt_tokens=limit))
        spy = QSpy(policies, 0)
        runner = EpisodeRunner(cfg, task, ScriptedEngine(replies), spy)
        spy.n_actions = len(runner.strategies)
        return runner.run(problems), spy

    full, _ = run(10**6)
    limit = min(len(e.turns[1].prompt_ids) for e in full) - 4
    assert max(len(e.turns[0].prompt_ids) for e in full) < limit
    eps, spy = run(limit)
    fbs = [e.turns[1] for e in eps]
    assert all(fb.truncated and len(fb.prompt_ids) <= limit for fb in fbs)
    assert spy.states == [fb.prompt_ids[: fb.state_len] for fb in fbs]
    # the cut only takes the state's left end: the state read is the end of the uncut one
    for fb, whole in zip(fbs, (e.turns[1] for e in full)):
        assert whole.prompt_ids[: whole.state_len][-fb.state_len:] == fb.prompt_ids[: fb.state_len]


def test_a_problem_drawn_twice_in_a_batch_continues_its_sample_numbers(tiny_cfg, policies, tmp_path):
    """A batch can hold one problem twice (an iteration crossing an epoch of the problem walk): its
    episodes must keep unique ids, or a snapshot, which joins turns by episode id, reloads them with
    each other's turns (train-upper then refused the snapshot)."""
    from tosca_mlmt.store import load_snapshot, write_snapshot

    task = ArithTask(1)
    p = task.load("train", 1).problems[0]
    replies = scripted_replies(policies, "Check the sum.")
    cfg = replace(tiny_cfg, episode=replace(tiny_cfg.episode, rounds=1, n_samples=2))
    eps = EpisodeRunner(cfg, task, ScriptedEngine(replies), policies).run([p, p])
    assert [(e.episode_id, e.sample) for e in eps] == [(f"{p.id}/s{k}", k) for k in range(4)]
    sid, _ = write_snapshot(tmp_path, eps, {"task": {"name": "arith", "split": "train"}})
    back = load_snapshot(tmp_path, sid).episodes()
    assert [[t.kind for t in e.turns] for e in back] == [["solve", "feedback", "refine"]] * 4


def test_a_problem_in_two_engine_batches_of_one_collect_keeps_unique_ids(tiny_cfg, policies, tmp_path):
    """collect splits its problems into engine batches (HF: engine.batch_size / n_samples problems each)
    and ranks into shards: a problem in two of them continues its sample numbers across the pieces, as
    within one, so the snapshot's episode ids stay unique and it reloads every turn."""
    from tosca_mlmt.pipelines.collect import collect
    from tosca_mlmt.store import load_snapshot

    task = ArithTask(1)
    p, q = task.load("train", 2).problems
    replies = scripted_replies(policies, "Check the sum.")
    cfg = replace(tiny_cfg, episode=replace(tiny_cfg.episode, rounds=1, n_samples=2),
                  engine=replace(tiny_cfg.engine, name="hf", batch_size=2))  # one problem per engine batch
    res = collect(cfg, tmp_path, policies=policies, engine=ScriptedEngine(replies), problems=[p, q, p])
    back = load_snapshot(tmp_path, res.snapshot_id).episodes()
    assert [e.episode_id for e in back] == [f"{p.id}/s0", f"{p.id}/s1", f"{q.id}/s0", f"{q.id}/s1",
                                            f"{p.id}/s2", f"{p.id}/s3"]
    assert [[t.kind for t in e.turns] for e in back] == [["solve", "feedback", "refine"]] * 6


def test_a_collect_that_fails_closes_the_engine_it_started(tiny_cfg, policies, monkeypatch, tmp_path):
    """A caller running collect in a loop (a sweep, a notebook) must get an in-process vLLM engine's
    memory back when one collect raises, not only when it returns."""
    from tosca_mlmt.pipelines import collect as collect_mod

    started = []

    class Engine(HFEngine):
        closed = False

        def close(self):
            self.closed = True
            super().close()

    def make_engine(cfg, pol):
        started.append(Engine(pol, batch_size=8))
        return started[-1]

    def fail(self, problems, batch_index=0, firsts=None):
        raise RuntimeError("verifier crashed")

    monkeypatch.setattr(collect_mod, "make_engine", make_engine)
    monkeypatch.setattr(collect_mod.EpisodeRunner, "run", fail)
    cfg = replace(tiny_cfg, task=replace(tiny_cfg.task, limit=2))
    with pytest.raises(RuntimeError, match="verifier crashed"):
        collect_mod.collect(cfg, tmp_path / "snaps", policies=policies)
    assert len(started) == 1 and started[0].closed
    # an engine the caller passed in stays the caller's to close
    mine = Engine(policies, batch_size=8)
    with pytest.raises(RuntimeError, match="verifier crashed"):
        collect_mod.collect(cfg, tmp_path / "snaps", policies=policies, engine=mine)
    assert not mine.closed and len(started) == 1


class OtherTemplate:
    """``policies`` with the solver's tokenizer under another chat template (tests/unit/test_prompts.py's
    TEMPLATES) for both roles, and <|endoftext|> listed before the <|im_end|> its turns close with."""

    def __init__(self, inner, template: str):
        from factories import with_template

        self.inner, self.tok = inner, with_template(inner.tokenizer("solver"), template)

    def tokenizer(self, role):
        return self.tok

    def eos_ids(self, role):
        return [0, 2]

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _scripted_episode(cfg, policies):
    task = ArithTask(1)
    tok = policies.tokenizer("solver")
    replies = {"solver": tok.encode("The answer is 3.") + [2], "writer": tok.encode("Add again.") + [2]}
    return EpisodeRunner(cfg, task, ScriptedEngine(replies), policies).run(task.load("train", 1).problems)[0].turns


def test_an_episode_under_a_template_without_a_system_turn_and_a_later_listed_close(tiny_cfg, policies):
    """A Gemma-shaped template (refuses the system role; turns close with an eos listed second):
    the writer's system text opens its user message, each turn is closed once, and fixed feedback
    ends with the template's close, not eos_ids[0]."""
    from dataclasses import replace

    from tosca_mlmt.prompts import WRITER_SYSTEM

    other = OtherTemplate(policies, "refuses_system")
    tok = other.tok
    for feedback in ("generate", "static"):
        cfg = replace(tiny_cfg, episode=replace(tiny_cfg.episode, rounds=1, n_samples=1, feedback=feedback))
        z, fb, ref = _scripted_episode(cfg, other)
        text = lambda ids: tok.decode(ids)  # noqa: E731
        if feedback == "generate":
            assert text(fb.prompt_ids).startswith(f"<|im_start|>user\n{WRITER_SYSTEM}\n\nProblem:")
        else:
            assert fb.response_ids[-1] == 2 and 0 not in fb.response_ids
        g = tok.decode(ref.prompt_ids[ref.feedback_span.start:ref.feedback_span.end])
        turns = [{"role": "user", "content": text(z.prompt_ids).split("user\n", 1)[1].split("<|im_end|>")[0]},
                 {"role": "assistant", "content": "The answer is 3."},
                 {"role": "user", "content": text(ref.prompt_ids).rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]}]
        assert g in turns[2]["content"]
        assert text(ref.prompt_ids) == tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)


def test_chat_template_kwargs_open_every_turn(tiny_cfg, policies):
    """model.chat_template_kwargs reaches the runner's renderings: with a Qwen3-shaped template and
    enable_thinking=false, the solve, feedback and refine prompts all open the reply with an empty block."""
    from dataclasses import replace

    other = OtherTemplate(policies, "thinks")
    empty = "<|im_start|>model\n<think>\n\n</think>\n\n"
    for kwargs in ({}, {"enable_thinking": False}):
        cfg = replace(tiny_cfg, episode=replace(tiny_cfg.episode, rounds=1, n_samples=1),
                      model=replace(tiny_cfg.model, chat_template_kwargs=kwargs))
        for t in _scripted_episode(cfg, other):
            assert other.tok.decode(t.prompt_ids).endswith(empty) == bool(kwargs), (t.kind, kwargs)


def test_a_reasoning_models_turn_is_cut_and_scored_after_its_thinking(tiny_cfg, policies):
    """episode.reasoning_tags: the solver's answer line inside its thinking neither ends the turn (the
    engine gets a stop pattern that matches after the close tag) nor is scored; the one after it is."""
    from dataclasses import replace

    from tosca_mlmt.rollout.engines.stop import apply_stop

    task = ArithTask(1)
    problem = task.load("train", 1).problems[0]
    tok = policies.tokenizer("solver")
    wrong = int(problem.answer) + 1
    reply = f"<think>The answer is: {problem.answer}.\nNo, recheck.</think>\nThe answer is: {wrong}.\nThen more."

    class CuttingEngine(ScriptedEngine):  # cuts at the stop pattern it is given, as both real engines do
        def generate(self, prompts, params, policy):
            out = super().generate(prompts, params, policy)
            return [[apply_stop(g, tok.decode, params.stop_regex) for g in gs] for gs in out]

    replies = {"solver": tok.encode(reply) + [2], "writer": tok.encode("Add again.") + [2]}
    for tags, kept, right in (([], f"<think>The answer is: {problem.answer}.\n", True),
                              (["<think>", "</think>"], f"</think>\nThe answer is: {wrong}.\n", False)):
        cfg = replace(tiny_cfg, episode=replace(tiny_cfg.episode, rounds=1, n_samples=1, reasoning_tags=tags))
        z = EpisodeRunner(cfg, task, CuttingEngine(replies), policies).run([problem])[0].turns[0]
        assert z.finish_reason == "answer" and z.text.endswith(kept)
        assert z.correct == right  # without tags the thinking's answer is read; with them, the final one


def test_the_writer_reads_the_thinking_unless_told_not_to(tiny_cfg, policies):
    """episode.writer_reads_thinking: the writer's state holds the solver's whole attempt, thinking included,
    or with false only the exact ids after the last close tag; an attempt that never closed its thinking
    reaches the writer empty."""
    from dataclasses import replace

    task = ArithTask(1)
    problem = task.load("train", 1).problems[0]
    tok = policies.tokenizer("solver")
    thinking, final = "<think>First 2 + 2 is 5, no, 4.</think>", "\nThe answer is: 4.\n"
    eos = policies.eos_ids("solver")[0]

    def writer_prompt(reply: str, reads: bool) -> list[int]:
        ep = replace(tiny_cfg.episode, rounds=1, n_samples=1, reasoning_tags=["<think>", "</think>"],
                     writer_reads_thinking=reads)
        engine = ScriptedEngine({"solver": tok.encode(reply) + [eos], "writer": tok.encode("Add again.") + [eos]})
        EpisodeRunner(replace(tiny_cfg, episode=ep), task, engine, policies).run([problem])
        return engine.given[1]

    def holds(prompt: list[int], ids: list[int]) -> bool:
        return any(prompt[i: i + len(ids)] == ids for i in range(len(prompt) - len(ids) + 1))

    ids = tok.encode(thinking + final)
    whole, after = writer_prompt(thinking + final, True), writer_prompt(thinking + final, False)
    assert holds(whole, ids)
    end = len(whole) - len(after)  # the thinking's ids are all that is left out
    assert end > 0 and tok.decode(ids[:end]).endswith("</think>") and holds(after, ids[end:])
    assert "</think>" not in tok.decode(after) and "2 + 2 is 5" in tok.decode(whole)
    # never closed: the attempt is empty for the writer, whole otherwise
    open_only = "<think>Still thinking about 2 + 2"
    assert len(writer_prompt(open_only, True)) - len(writer_prompt(open_only, False)) == len(tok.encode(open_only))


def test_refine_groups_branch_each_attempt_into_k_sampled_refines(debug_cfg, debug_policies):
    cfg = replace(debug_cfg, episode=replace(debug_cfg.episode, n_samples=2, rounds=1))
    task = RecordingTask()
    problems = task.load("train", 2).problems
    eps = EpisodeRunner(cfg, task, HFEngine(debug_policies, batch_size=8), debug_policies, refines=3).run(problems)
    assert len(eps) == 2 * 2 * 3 and len({e.episode_id for e in eps}) == len(eps)
    refines = set()
    for a in range(0, len(eps), 3):
        branches = eps[a: a + 3]
        first = branches[0]
        assert [e.episode_id for e in branches[1:]] == [f"{first.episode_id}/b1", f"{first.episode_id}/b2"]
        assert {(e.problem.id, e.sample) for e in branches} == {(first.problem.id, first.sample)}
        for e in branches:  # one attempt, one feedback: the turns before the refine are the same records
            for t, u in zip(e.turns[:2], first.turns[:2]):
                assert (t.prompt_ids, t.response_ids, t.text, t.strategy) == (u.prompt_ids, u.response_ids, u.text,
                                                                              u.strategy)
            assert e.turns[2].prompt_ids == first.turns[2].prompt_ids
            assert e.turns[2].reward == ArithTask(level=1).verify(e.problem, e.turns[2].text).reward
            assert episode_to_trajectory(e) is not None
        assert [e.turns[2].info["branch"] for e in branches] == [0, 1, 2]
        refines |= {tuple(e.turns[2].response_ids) for e in branches}
    assert len(refines) > 4  # sampled: an attempt's refines are not copies of one another
