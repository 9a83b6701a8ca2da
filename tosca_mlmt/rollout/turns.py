"""The turns of an episode: how each is prompted, sampled, recorded and scored.

An episode is solve (solver) -> [feedback (writer) -> refine (solver)] x K. :class:`Turns` holds
each step of a turn: its prompt, its sampling (and seed), its record on the episode and its score
against the episode's own problem. Two schedules play these steps: the batched runner (runner.py:
every episode's turn in one engine call) and continuous episodes (continuous.py: each episode's
next turn as soon as its last one ends). Both take their turns from here, so they record the same
episodes; continuous.py imports nothing else of rollout/, and the runner imports it to pick it.

What the writer sees (``episode.writer_sees``) besides the problem and the attempts:
``none``; ``confidence``, the solver's mean token log-prob on each attempt bucketed into
low/medium/high (honest: available at test time); ``verdict``, the verifier's right/wrong on
each attempt; ``tool``, what the task's own check of each attempt found (rollout/tool.py; honest).
``verdict`` (and ``episode.feedback: verdict``) is a privileged sanity environment, like a critic
that sees test results: summaries carry ``environment`` so its numbers are never mixed with honest ones.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from tosca_mlmt.config import Config, SamplingConfig
from tosca_mlmt.config.episode import TOOL_HINT, WRITER_SIGNALS
from tosca_mlmt.errors import ConfigError
from tosca_mlmt.prompts import (REFINE_USER_PREFIX, REFINE_USER_SUFFIX, WRITER_STATE, WRITER_STRATEGY,
                                WRITER_SYSTEM, ChatFormat)
from tosca_mlmt.records import Episode, FeedbackSpan, Turn
from tosca_mlmt.rollout.engines.base import Engine, Generation, SamplingParams
from tosca_mlmt.rollout.engines.stop import after_reasoning, final_text, thinking_end
from tosca_mlmt.rollout.gold import gold_continuation, gold_prob
from tosca_mlmt.rollout.tool import AttemptReports, require_check, uses_tool
from tosca_mlmt.strategies import behaviour_distribution, sample_strategies
from tosca_mlmt.tasks.base import Problem, Task, Verdict
from tosca_mlmt.tasks.reward import RewardContext
from tosca_mlmt.tasks.sandbox import clean_text


def to_params(s: SamplingConfig, seed: int, n: int = 1, max_new_tokens: int | None = None,
              stop_regex: str | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=s.max_new_tokens if max_new_tokens is None else max_new_tokens,
                          temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, n=n, seed=seed,
                          stop_regex=stop_regex)


def first_samples(problems: list[Problem], n: int) -> list[int]:
    """Each problem's first sample number in a batch of n episodes per problem. A problem drawn twice
    (an iteration that crosses an epoch of the problem walk, or more problems than the pool holds)
    continues its sample numbers, so every episode id stays unique: a snapshot joins turns by it.
    Computed on the whole batch before it is split into engine batches or rank shards, whose
    pieces then keep the numbers the whole batch gives them."""
    seen: dict[str, int] = {}
    out = []
    for p in problems:
        out.append(seen.get(p.id, 0))
        seen[p.id] = out[-1] + n
    return out


def new_episodes(problems: list[Problem], n: int, firsts: list[int] | None = None) -> list[Episode]:
    """n episodes per problem, in order, numbered from ``firsts`` (default: first_samples of ``problems``)."""
    firsts = first_samples(problems, n) if firsts is None else firsts
    return [Episode(f"{p.id}/s{k}", p, k) for p, f in zip(problems, firsts, strict=True) for k in range(f, f + n)]


def reward_context(ep: Episode, turn: Turn, kind: str, tags: list[str]) -> RewardContext:
    """Where ``turn`` (a solver turn of ``ep``, appended or not) sits, for a task.reward function: the
    turns before it give the previous attempt and the feedback it answered. A counterfactual is the
    refine ``turn`` replayed without its feedback, so it gets the refine's place and no feedback."""
    before = ep.turns[:turn.index]
    attempts = [t for t in before if t.role == "solver"]
    prev = attempts[-1] if attempts else None
    fb = before[-1] if before and before[-1].kind == "feedback" and kind != "counterfactual" else None
    return RewardContext(turn=len(attempts) + 1, round=turn.round, kind=kind,
                         previous_response=None if prev is None else final_text(prev.text, tags),
                         previous_reward=None if prev is None else prev.reward,
                         previous_correct=None if prev is None else prev.correct,
                         feedback=None if fb is None else fb.text, strategy=None if fb is None else fb.strategy_name,
                         episode_id=ep.episode_id, sample=ep.sample)


def verify_turns(task: Task, tags: list[str], items: list[tuple[Episode, Turn, str]],
                 texts: list[str] | None = None) -> list[Verdict]:
    """The verdicts of (episode, turn, kind) items on ``texts`` (default: what the verifier reads of each
    turn's text): one ``verify_batch`` call where the task has one (task.reward's hook, which gets each
    turn's RewardContext), else ``verify`` per item."""
    texts = [final_text(t.text, tags) for _, t, _ in items] if texts is None else texts
    batch = getattr(task, "verify_batch", None)
    if batch is None:
        return [task.verify(ep.problem, text) for (ep, _, _), text in zip(items, texts)]
    return batch([ep.problem for ep, _, _ in items], texts, [reward_context(ep, t, k, tags) for ep, t, k in items])


def apply_verdict(turn: Turn, v: Verdict) -> None:
    turn.reward, turn.correct, turn.extracted = v.reward, v.correct, v.extracted
    # Verifier text can be the model's own code's (a sandbox error): made valid UTF-8 (the tokenizer
    # raises on lone surrogates) and bounded, so a flood cannot push the question out of the prompt.
    fc = clean_text(v.feedback_context or "")
    turn.info = dict(v.info, feedback_context=fc) if fc else dict(v.info)


@dataclasses.dataclass
class FeedbackPlan:
    """One episode's writer decision before g is written (Turns.plan_feedback)."""
    action: int  # the strategy a
    chosen_p: float  # pi_b(a | s)
    probs: list[float]  # pi_b(. | s), [A]
    q: list[float] | None  # Q(s, .), [A]; None while selection is uniform
    prompt: list[int]  # the writer's prompt: state s, then the strategy's instruction
    state_len: int  # tokens of s at the prompt's start (h(s) reads them)
    signal: int  # what episode.writer_sees told the writer about the last attempt
    fixed: Generation | None  # feedback that needs no writer model (_feedback_text), else None
    cut: int = 0  # ids cut from the state's left before Q read it, so that every strategy's prompt fits
    tool: object = None  # the task's check of the last attempt (a ToolReport) under writer_sees/feedback: tool


class Turns:
    """Every kind of turn of an episode on an engine; ``policies`` supplies tokenizers, eos ids and
    Q-values. EpisodeRunner plays them in batched order, continuous.run as each episode is ready."""

    def __init__(self, cfg: Config, task: Task, engine: Engine, policies,
                 on_turn: Callable[[str, int], None] | None = None, solve_temperature: float = -1.0,
                 refine_temperature: float = -1.0, writer_temperature: float = -1.0):
        """``solve_temperature`` / ``refine_temperature`` >= 0 decode turn 1 / the refine (and
        counterfactual) turns at that temperature instead of solver_sampling's, ``writer_temperature``
        the feedback text instead of writer_sampling's (collect.*). ``on_turn(kind, k)``: k episodes
        finished a turn of that kind (solve, feedback, refine, counterfactual)."""
        self.cfg, self.task, self.engine, self.policies = cfg, task, engine, policies
        at = lambda s, t: s if t < 0 else dataclasses.replace(s, temperature=t)  # noqa: E731
        self.solve_sampling = at(cfg.solver_sampling, solve_temperature)
        self.refine_sampling = at(cfg.solver_sampling, refine_temperature)
        self.writer_sampling = at(cfg.writer_sampling, writer_temperature)
        self.fmt = {r: ChatFormat(policies.tokenizer(r), policies.eos_ids(r), cfg.model.chat_template_kwargs)
                    for r in ("solver", "writer")}
        self.strategies = policies.strategies or cfg.episode.strategies
        # each strategy's instruction, as the last piece of the writer's user message (plan_feedback)
        self.strategy_ids = [self.fmt["writer"].encode(WRITER_STRATEGY.format(instruction=s["instruction"]))
                             for s in self.strategies]
        self.on_turn = on_turn or (lambda kind, n: None)
        self.gen_tokens = 0
        self.gen_seconds = 0.0
        self.truncated_prompts = 0
        # solver turns end at the task's first complete answer line (rollout/engines/stop.py)
        self.stop_regex = getattr(task, "stop_regex", None) if cfg.episode.stop_at_answer else None
        self.tags = cfg.episode.reasoning_tags  # a reasoning model's [open, close] thinking tags, or []
        # under a tool the writer reads the task's own check of the attempt, never the verifier's context
        self.tool_informed = uses_tool(cfg.episode)
        self.reports = (AttemptReports(task, self.tags, cfg.episode.writer_reads_thinking)
                        if self.tool_informed else None)
        if self.stop_regex:
            self.stop_regex = after_reasoning(self.stop_regex, self.tags)
        if cfg.episode.gold_prob and not hasattr(task, "answer_slot"):
            raise ConfigError(f"invalid value true for field 'episode.gold_prob': task {task.name!r} has no "
                              "'The answer is: N' line to score the gold answer at (arith and gsm8k have one)")
        require_check(cfg.episode, task)

    # ------------------------------------------------------------------ helpers
    def _seed(self, round_: int, kind: str, batch_index: int) -> int:
        return (self.cfg.seed * 7919 + batch_index * 104729 + round_ * 31 + {"solve": 1, "feedback": 2, "refine": 3, "counterfactual": 4}[kind]) % (2**31)

    def cut_prompt(self, prompt: list[int]) -> list[int]:
        """The prompt as the engine gets it: its last episode.max_prompt_tokens ids (the end holds
        the instruction and the generation prompt)."""
        seen = list(prompt[-self.cfg.episode.max_prompt_tokens:])
        self.truncated_prompts += len(seen) < len(prompt)
        return seen

    def _solver_text(self, ids) -> str:
        return self.policies.tokenizer("solver").decode(self.fmt["solver"].strip_eos(ids), skip_special_tokens=True)

    def _score(self, ep: Episode, turn: Turn) -> None:
        """One solver turn scored alone (a batch of one: score_turns)."""
        apply_verdict(turn, verify_turns(self.task, self.tags, [(ep, turn, turn.kind)])[0])

    def score_turns(self, scored: list[tuple[Episode, Turn]]) -> None:
        """Solver turns that ended together, scored together: a task with ``verify_batch`` (task.reward)
        gets them in one call, so a batched reward function runs once per batch of turns."""
        for (_, t), v in zip(scored, verify_turns(self.task, self.tags, [(ep, t, t.kind) for ep, t in scored])):
            apply_verdict(t, v)

    def _writer_signal(self, turn: Turn, report=None) -> tuple[int, str]:
        """What ``episode.writer_sees`` tells the writer about one attempt (module doc): the level's
        index o in WRITER_SIGNALS[sees] (the Q head's signal table row) and the sentence its state gets."""
        sees = self.cfg.episode.writer_sees
        if sees == "confidence":
            lp = float(np.mean(turn.logprobs)) if turn.logprobs else float("-inf")
            lo, hi = self.cfg.episode.confidence_edges
            o = 0 if lp < lo else (1 if lp < hi else 2)
            return o, f"The student's confidence in this attempt: {WRITER_SIGNALS[sees][o]}."
        if sees == "verdict":
            o = int(bool(turn.correct))
            return o, f"Checker's verdict on this attempt: {WRITER_SIGNALS[sees][o]}."
        if sees == "tool":  # the task's own check (``report``, a ToolReport): flagged or not
            return int(bool(report.flagged)), report.describe()
        return 0, ""

    def _tool_report(self, ep: Episode, turn: Turn):
        """The task's check of an attempt under writer_sees/feedback: tool (rollout/tool.py), else None."""
        return self.reports.of(ep.problem, turn) if self.reports is not None else None

    def _feedback_info(self, signal: int, report=None) -> dict:
        """Labels on each feedback turn that say what the writer saw and who wrote g (metrics.environment),
        the state's writer signal (upper.q_signal reads it) when it saw one, and the tool's report if any."""
        e = self.cfg.episode
        info = {k: v for k, v in (("writer_sees", e.writer_sees), ("feedback", e.feedback)) if v not in ("none", "generate")}
        info |= {"tool_report": report.to_json()} if report is not None else {}
        return info | ({"writer_signal": signal} if e.writer_sees != "none" else {})

    def _feedback_text(self, ep: Episode, action: int, report=None) -> str | None:
        """Fixed feedback that replaces the writer model: the strategy's instruction (static), the
        verifier's verdict on the last attempt (verdict: a privileged control), the task's check's hint
        (tool: ``report``) or, for a strategy in episode.prefix_only, its prefix alone; None = the writer writes it."""
        mode = self.cfg.episode.feedback
        if mode == "static":
            return self.strategies[action]["instruction"]
        if mode == "verdict":
            right = ep.solver_turns[-1].correct
            return "Your answer is right." if right else "Your answer is wrong."
        if mode == "tool":  # the task's check's hint on the last attempt: a fixed rule, honest
            return report.hint()
        if self._prefix_only(action):
            prefix = self.strategies[action]["prefix"]
            if TOOL_HINT not in prefix:
                return prefix
            if report is None:  # the config check refuses this; a loaded writer's own strategy list is not checked
                raise ConfigError(f"strategy {self.strategies[action]['name']!r} sends {TOOL_HINT}, which needs "
                                  "episode.writer_sees=tool")
            return prefix.replace(TOOL_HINT, report.hint())
        return None

    def _prefix_only(self, action: int) -> bool:
        e = self.cfg.episode
        s = self.strategies[action]  # a loaded writer's own list may lack the prefix the config checked
        return e.feedback == "generate" and s["name"] in e.prefix_only and "prefix" in s

    def _attempt_ids_for_writer(self, ids: list[int]) -> list[int]:
        ids = self.fmt["solver"].strip_eos(ids)
        if self.tags and not self.cfg.episode.writer_reads_thinking:  # what follows the thinking, or nothing
            end = thinking_end(ids, self._solver_text, self.tags[1])
            ids = [] if end is None else ids[end:]
        if self.policies.shared_base:
            return list(ids)
        # Different tokenizers: the writer must re-encode the attempt's text (unavoidable).
        return self.fmt["writer"].encode(self._solver_text(ids))

    def first_prompts(self, problems: list[Problem]) -> list[list[int]]:
        return [self.fmt["solver"].first_prompt(self.task.instruction(p)) for p in problems]

    def solve_params(self, batch_index: int, n: int) -> SamplingParams:
        return to_params(self.solve_sampling, self._seed(0, "solve", batch_index), n=n, stop_regex=self.stop_regex)

    def feedback_params(self, rnd: int, batch_index: int) -> SamplingParams:
        return to_params(self.writer_sampling, self._seed(rnd, "feedback", batch_index),
                         max_new_tokens=self.cfg.episode.max_feedback_tokens)

    def refine_params(self, rnd: int, batch_index: int, kind: str = "refine") -> SamplingParams:
        """The refine's sampling, or with ``kind="counterfactual"`` its g-less twin's."""
        return to_params(self.refine_sampling, self._seed(rnd, kind, batch_index), stop_regex=self.stop_regex)

    def record_solve(self, ep: Episode, prompt: list[int], seen: list[int], g: Generation,
                     score: bool = True) -> list[int]:
        """Turn 1 of ``ep``, scored (unless ``score`` is False: the caller scores a batch of turns with
        score_turns) and appended; returns the solver's context after it."""
        t = Turn(0, 0, "solver", "solve", list(seen), list(g.token_ids), list(g.logprobs), g.finish_reason,
                 self._solver_text(g.token_ids), truncated=len(seen) < len(prompt))
        if score:
            self._score(ep, t)
        ep.turns.append(t)
        return list(prompt) + list(g.token_ids)

    def plan_feedback(self, episodes: list[Episode], rng) -> list[FeedbackPlan]:
        """Turn 2 up to the writing: each episode's writer state s = (x, z [, earlier rounds]), Q(s, .)
        when the writer has seen enough decisions, the strategy drawn from ``rng`` (one
        ``rng.random(len(episodes))`` draw, via choose_strategies) and the writer's prompt."""
        cfg, wfmt = self.cfg, self.fmt["writer"]
        states, signals, reports = [], [], []
        for ep in episodes:
            pieces: list = [WRITER_STATE.format(question=ep.problem.question)]
            solver_turns = ep.solver_turns
            for i, st in enumerate(solver_turns):
                pieces += [f"Student's attempt {i + 1}:\n", self._attempt_ids_for_writer(st.response_ids), "\n\n"]
                report = self._tool_report(ep, st)
                signal, seen = self._writer_signal(st, report)
                if seen:
                    pieces.append(f"{seen}\n\n")
                fc = st.info.get("feedback_context")
                if fc and not self.tool_informed:  # the grading tests' error: with a tool, only the public check
                    pieces.append(f"Result of checking attempt {i + 1}:\n{fc}\n\n")
                if i < len(solver_turns) - 1:
                    fb = [t for t in ep.turns if t.kind == "feedback"][i]
                    pieces += [f"Feedback after attempt {i + 1}:\n", wfmt.strip_eos(fb.response_ids), "\n\n"]
            states.append(pieces)
            signals.append(signal)  # about the last attempt: the one this feedback is on
            reports.append(report)
        rendered = [wfmt.user_prompt_with_ids(WRITER_SYSTEM, pieces) for pieces in states]  # (ids, cuts)
        # A prompt over episode.max_prompt_tokens loses its left end. The cut is taken here, before Q
        # reads the state, and sized for the longest strategy text, so whichever strategy is drawn its
        # prompt fits and Q read the very state train-upper will read from the recorded prompt.
        longest = max(map(len, self.strategy_ids))  # pieces are encoded one by one: lengths add up
        cuts_left = [min(max(len(ids) + longest - cfg.episode.max_prompt_tokens, 0), cuts[-1] - 1)
                     for ids, cuts in rendered]  # a cut that takes the whole state leaves one token of it
        self.truncated_prompts += sum(c > 0 for c in cuts_left)
        # a Q fitted on too few decisions is noise: selection stays uniform until it has seen enough
        q = (self.policies.q_values([ids[c:cuts[-1]] for (ids, cuts), c in zip(rendered, cuts_left)], signals)
             if cfg.episode.q_steers(self.policies.q_decisions) else None)
        q_np = None if q is None else q.numpy()
        actions, chosen_p, probs = self.choose_strategies(q_np, len(episodes), rng)
        plans = []
        for i, (ep, (ids, cuts), a) in enumerate(zip(episodes, rendered, actions)):
            # the rendered state with the strategy as one more piece: user_prompt_with_ids(pieces + [text])
            ids, c = ids[:cuts[-1]] + self.strategy_ids[a] + ids[cuts[-1]:], cuts_left[i]
            # Fixed feedback needs no writer model (SCoRe's static instruction, the verdict control, a
            # prefix_only strategy): finish_reason "fixed", no log-probs, nothing for the text loss to clone.
            t = self._feedback_text(ep, a, reports[i])
            fixed = None if t is None else Generation(tuple(wfmt.encode(t) + [wfmt.close_id]), (), "fixed")
            plans.append(FeedbackPlan(int(a), float(chosen_p[i]), [float(x) for x in probs[i]],
                                      None if q_np is None else [float(x) for x in q_np[i]], ids[c:],
                                      cuts[-1] - c, signals[i], fixed, c, reports[i]))
        return plans

    def record_feedback(self, ep: Episode, rnd: int, plan: FeedbackPlan, g: Generation, seen: list[int]) -> None:
        """Turn 2 of round ``rnd``: the feedback ``g`` written (or fixed) for ``plan``, appended to ``ep``."""
        shift = len(plan.prompt) - len(seen)  # 0 unless the strategy texts outgrew the plan's own cut
        s = self.strategies[plan.action]
        ep.turns.append(Turn(
            len(ep.turns), rnd, "writer", "feedback", list(seen), list(g.token_ids), list(g.logprobs),
            g.finish_reason,
            self.policies.tokenizer("writer").decode(self.fmt["writer"].strip_eos(g.token_ids), skip_special_tokens=True),
            strategy=plan.action, strategy_name=s["name"], behaviour_prob=plan.chosen_p,
            behaviour_probs=plan.probs, q_values=plan.q,
            # a cut that took the whole state leaves one token of it, so h(s) stays defined
            state_len=max(plan.state_len - shift, 1), truncated=plan.cut + shift > 0,
            info=self._feedback_info(plan.signal, plan.tool)))

    def refine_prompt(self, ep: Episode, ctx: list[int]) -> tuple[list[int], FeedbackSpan]:
        """Turn 3's prompt: the solver's context ``ctx`` with the last feedback appended, and where g
        (prefix + feedback) sits in it: the bonus removes exactly this span."""
        sfmt, wfmt = self.fmt["solver"], self.fmt["writer"]
        fb = ep.turns[-1]
        # Same tokenizer: the feedback's exact ids; otherwise its text, re-encoded once.
        fb_ids = wfmt.strip_eos(fb.response_ids) if self.policies.shared_base else sfmt.encode(fb.text)
        suffix = REFINE_USER_SUFFIX.format(question=ep.problem.question,
                                           answer_format=getattr(self.task, "answer_format", ""))
        # episode.strategy_prefix: the strategy's fixed sentence opens written g, so the decision reaches the
        # solver even when the writer's own text is poor. Fixed feedback (static, verdict, tool) is sent alone:
        # before 2026-12-07 a uniformly drawn sentence opened it too ("Your answer looks right..." before a hint)
        prefix = (self.strategies[fb.strategy].get("prefix", "") if self.cfg.episode.strategy_prefix
                  and self.cfg.episode.feedback == "generate" and not self._prefix_only(fb.strategy) else "")
        cont, cut = sfmt.continue_with_user(ctx, [REFINE_USER_PREFIX, prefix + " " if prefix else "", fb_ids, suffix])
        return ctx + cont, FeedbackSpan(len(ctx) + cut[0], len(ctx) + cut[2])

    def record_refine(self, ep: Episode, rnd: int, prompt: list[int], seen: list[int], g: Generation,
                      span: FeedbackSpan, score: bool = True) -> list[int]:
        """Turn 3 of round ``rnd``, scored (unless ``score`` is False, as record_solve) and appended;
        returns the solver's context after it."""
        shift = len(prompt) - len(seen)
        t = Turn(len(ep.turns), rnd, "solver", "refine", list(seen), list(g.token_ids), list(g.logprobs),
                 g.finish_reason, self._solver_text(g.token_ids), truncated=shift > 0,
                 feedback_span=FeedbackSpan(span.start - shift, span.end - shift) if span.start >= shift else None)
        if score:
            self._score(ep, t)
        ep.turns.append(t)
        return prompt + list(g.token_ids)

    def record_counterfactuals(self, items: list[tuple[Episode, Turn, Generation]]) -> None:
        """The g-less twins ``g`` of refine turns, scored together; each score goes to its refine's info."""
        texts = [final_text(self._solver_text(g.token_ids), self.tags) for _, _, g in items]
        verdicts = verify_turns(self.task, self.tags, [(ep, t, "counterfactual") for ep, t, _ in items], texts)
        for (_, turn, _), v in zip(items, verdicts):
            turn.info.update(counterfactual_reward=float(v.reward), counterfactual_extracted=v.extracted)

    def choose_strategies(self, q: np.ndarray | None, n_states: int,
                          rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(actions [B], their probabilities [B], pi_b [B, A]) under ``episode.strategy_selection``.
        A method so that ``mlmt chat --strategy`` can pin the choice and keep the rest of the turn."""
        e = self.cfg.episode
        probs = behaviour_distribution(q, len(self.strategies), e.strategy_selection, e.strategy_temperature,
                                       e.epsilon)
        actions, chosen_p = sample_strategies(probs, n_states, rng)
        return actions, chosen_p, np.broadcast_to(probs, (n_states, len(self.strategies)))

    def score_gold(self, episodes: list[Episode]) -> None:
        """Every solver turn's ``info["gold_prob"]``: the solver's teacher-forced probability of the
        gold answer at the turn's answer slot (rollout/gold.py), one batched scoring pass."""
        sfmt = self.fmt["solver"]
        turns, prompts, targets = [], [], []
        for ep in episodes:
            for t in ep.solver_turns:
                # _solver_text decodes as the verifier reads turns, so the slot is found in the same text
                prefix, target = gold_continuation(sfmt.strip_eos(t.response_ids), self._solver_text, sfmt.encode,
                                                   self.task.answer_slot, ep.problem.answer)
                turns.append(t)
                prompts.append(list(t.prompt_ids) + prefix)
                targets.append(target)
        for t, lps in zip(turns, self.engine.score(prompts, targets, "solver")):
            t.info["gold_prob"] = gold_prob(lps)
