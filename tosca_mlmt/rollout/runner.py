"""The batched three-turn (K-round) episode runner.

Turn order per episode: solve (solver) -> [feedback (writer) -> refine (solver)] x K.
All episodes of a batch advance together, one engine call per turn, and every turn of
an episode is scored against that episode's own problem. The turns themselves (prompts,
sampling, records, scores, the writer's state and strategy) are turns.py's, shared with
continuous episodes (continuous.py), which the runner plays instead where they apply.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import numpy as np

from tosca_mlmt.records import Episode, FeedbackSpan
from tosca_mlmt.rollout import continuous
from tosca_mlmt.rollout.engines.base import Generation, SamplingParams
from tosca_mlmt.rollout.turns import Turns, new_episodes
from tosca_mlmt.seeds import stream
from tosca_mlmt.tasks.base import Problem


class EpisodeRunner(Turns):
    """Plays episodes on an engine: one engine call per turn for the whole batch, or continuous
    episodes (continuous.py) where the engine and ``engine.vllm.continuous_episodes`` allow.
    ``refines`` > 1 (train-lower's refine groups, lower.refine_samples): the last refine is sampled
    that many times per (x, z, g), each in an episode of its own (``branch_episodes``)."""

    def __init__(self, *args, refines: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.refines = refines

    def _gen(self, prompts: list[list[int]], params: SamplingParams, role: str,
             kind: str) -> tuple[list[list[Generation]], list[list[int]]]:
        """The generations, and each prompt as the engine was given it (what turns record)."""
        seen = [self.cut_prompt(p) for p in prompts]
        t0 = time.perf_counter()
        out = self.engine.generate(seen, params, policy=role)
        self.gen_seconds += time.perf_counter() - t0
        self.gen_tokens += sum(len(g.token_ids) for gs in out for g in gs)
        self.on_turn(kind, len(prompts) * params.n)
        return out, seen

    def run(self, problems: list[Problem], batch_index: int = 0, firsts: list[int] | None = None) -> list[Episode]:
        """Episodes of ``problems``; ``firsts``: their first sample numbers when they are a piece of a
        larger batch (first_samples of the whole), so ids stay unique across the pieces."""
        if continuous.applies(self):
            return continuous.run(self, problems, batch_index, firsts)
        cfg = self.cfg
        n = cfg.episode.n_samples
        p1 = self.first_prompts(problems)
        gens, seen = self._gen(p1, self.solve_params(batch_index, n), "solver", "solve")
        episodes: list[Episode] = []
        contexts: list[list[int]] = []  # solver context so far (prompt + all turns), per episode
        for ep, (prompt, cut, g) in zip(new_episodes(problems, n, firsts),
                                        ((pr, c, g) for pr, c, gs in zip(p1, seen, gens) for g in gs)):
            contexts.append(self.record_solve(ep, prompt, cut, g, score=False))
            episodes.append(ep)
        self.score_turns([(ep, ep.turns[-1]) for ep in episodes])
        rng = stream(cfg.seed, "strategy", batch_index)
        for rnd in range(1, cfg.episode.rounds + 1):
            self._feedback_round(episodes, contexts, rnd, batch_index, rng)
        if cfg.episode.gold_prob:
            self.score_gold(episodes)
        return episodes

    def _feedback_round(self, episodes: list[Episode], contexts: list[list[int]], rnd: int, batch_index: int,
                        rng: np.random.Generator) -> None:
        # ---- turn 2: the writer's state, its strategy choice, and the feedback (written or fixed)
        plans = self.plan_feedback(episodes, rng)
        written = {}
        write = [i for i, pl in enumerate(plans) if pl.fixed is None]
        if write:
            params = self.feedback_params(rnd, batch_index)
            # each written feedback seeded by its episode's row, as the refines are (SamplingParams.seeds)
            params = dataclasses.replace(params, seeds=tuple(params.seed + i for i in write))
            gens, seen = self._gen([plans[i].prompt for i in write], params, "writer", "feedback")
            written = {i: (gs[0], sn) for i, gs, sn in zip(write, gens, seen)}
        if len(write) < len(episodes):
            self.on_turn("feedback", len(episodes) - len(write))
        for i, (ep, pl) in enumerate(zip(episodes, plans)):
            g, seen = written.get(i, (pl.fixed, pl.prompt))  # a fixed turn made no engine call: nothing was cut
            self.record_feedback(ep, rnd, pl, g, seen)
        # ---- turn 3: the solver refines with the feedback appended to its own context
        refine = [self.refine_prompt(ep, ctx) for ep, ctx in zip(episodes, contexts)]
        prompts = [p for p, _ in refine]
        k = self.refines if rnd == self.cfg.episode.rounds else 1
        params = dataclasses.replace(self.refine_params(rnd, batch_index), n=k)
        ref_gens, ref_seen = self._gen(prompts, params, "solver", "refine")
        if k > 1:  # every list from here on has one entry per branch, an attempt's k branches adjacent
            episodes[:] = branch_episodes(episodes, k)
            contexts[:], prompts, refine, ref_seen = ([x for x in xs for _ in range(k)]
                                                      for xs in (list(contexts), prompts, refine, ref_seen))
            ref_gens = [[g] for gs in ref_gens for g in gs]
        for i, (ep, gs) in enumerate(zip(episodes, ref_gens)):
            contexts[i] = self.record_refine(ep, rnd, prompts[i], ref_seen[i], gs[0], refine[i][1], score=False)
        self.score_turns([(ep, ep.turns[-1]) for ep in episodes])
        if k > 1:  # after scoring, which sets a turn's info
            for i, ep in enumerate(episodes):
                ep.turns[-1].info["branch"] = i % k
        if self.cfg.episode.counterfactual:
            self._counterfactual_refines(episodes, prompts, [sp for _, sp in refine], rnd, batch_index)

    def _counterfactual_refines(self, episodes: list[Episode], prompts: list[list[int]], spans: list[FeedbackSpan],
                                rnd: int, batch_index: int) -> None:
        """The same solver refines once more with g cut out of its prompt (the bonus's context);
        the score goes to the refine's info as ``counterfactual_reward``: what the solver would
        have got without the feedback (upper.reward=counterfactual)."""
        cut = [span.cut(p) for p, span in zip(prompts, spans)]
        params = self.refine_params(rnd, batch_index, "counterfactual")
        gens = self._gen(cut, params, "solver", "counterfactual")[0]
        self.record_counterfactuals([(ep, ep.turns[-1], gs[0]) for ep, gs in zip(episodes, gens)])


def branch_episodes(episodes: list[Episode], k: int) -> list[Episode]:
    """Each episode followed by k - 1 copies of its turns so far (``<id>/b<j>``, the same sample
    number): the k episodes of one attempt and feedback that its k sampled refines complete."""
    return [ep if j == 0 else Episode(f"{ep.episode_id}/b{j}", ep.problem, ep.sample, copy.deepcopy(ep.turns))
            for ep in episodes for j in range(k)]
