"""``mlmt chat``: one solver and writer pair playing solve -> feedback -> refine on typed problems.

The episode is the one collect and eval play (:class:`~tosca_mlmt.rollout.runner.EpisodeRunner`
on a :class:`~tosca_mlmt.tasks.base.Problem` built from the text), so what the terminal shows is
what training sees: the same prompts, strategy selection and verifier. Nothing is written.

The writer's Q-values are shown whenever it has a Q head, also while they do not steer the choice
yet (fitted on fewer than ``episode.min_q_decisions`` decisions): then they are computed on the
logged writer state, exactly as the runner would have, and labelled as unused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from tosca_mlmt import runtime
from tosca_mlmt.config import Config
from tosca_mlmt.errors import ConfigError
from tosca_mlmt.records import Episode
from tosca_mlmt.rollout.runner import EpisodeRunner
from tosca_mlmt.tasks.base import Problem


@dataclass
class Decision:
    """One feedback round's strategy choice, as the terminal shows it."""
    round: int
    names: list[str]
    q: list[float] | None  # None: the writer has no Q head
    probs: list[float]  # pi(a | s) under episode.strategy_selection
    picked: int
    how: str  # why this strategy: the selection rule, or --strategy


@dataclass
class Exchange:
    episode: Episode
    decisions: list[Decision]
    gold: str  # "" = no verdicts


class _PinnedRunner(EpisodeRunner):
    """The runner with ``--strategy``'s choice in place of the sampled one; pi_b stays the
    configured rule's, so the table still says what the selection would have weighed."""

    def __init__(self, *a, pinned: int, **kw):
        super().__init__(*a, **kw)
        self.pinned = pinned

    def choose_strategies(self, q, n_states, rng):
        _, _, probs = super().choose_strategies(q, n_states, rng)
        return np.full(n_states, self.pinned), np.ones(n_states), probs


def chat_config(cfg: Config, greedy: bool = True) -> Config:
    """One sample per problem; greedy decoding unless asked to sample."""
    ep = replace(cfg.episode, n_samples=1, rounds=max(cfg.episode.rounds, 1))
    if not greedy:
        return replace(cfg, episode=ep)
    return replace(cfg, episode=ep, solver_sampling=replace(cfg.solver_sampling, temperature=0.0),
                   writer_sampling=replace(cfg.writer_sampling, temperature=0.0))


class ChatSession:
    """Loads the pair and the engine once; :meth:`play` runs one problem."""

    def __init__(self, cfg: Config, strategy: str | None = None, console=None):
        from tosca_mlmt.models.policies import PolicyPair, saved_strategies
        from tosca_mlmt.rollout.engines import make_engine
        from tosca_mlmt.tasks import make_task

        runtime.setup(cfg)
        self.cfg = cfg
        self.task = make_task(cfg.task)
        # the writer's own list when it saved one (as PolicyPair will load it), checked before any
        # weights load: a mistyped --strategy costs an import, not a model load
        saved = saved_strategies(cfg.model.writer_adapter) if cfg.model.writer_adapter else None
        names = [s["name"] for s in (saved or cfg.episode.strategies)]
        pinned = None
        if strategy is not None:
            if strategy not in names:
                raise ConfigError(f"--strategy {strategy!r} is not in the writer's strategy set; allowed: "
                                  f"{', '.join(names)}")
            pinned = names.index(strategy)
        if console is not None:
            console.print(f"chat: loading solver {cfg.model.solver_adapter or '(base)'} and writer "
                          f"{cfg.model.writer_adapter or '(base)'} on {cfg.model.solver}", highlight=False)
        self.policies = PolicyPair(cfg.model, seed=cfg.seed)
        self.engine = make_engine(cfg, self.policies)
        args = (cfg, self.task, self.engine, self.policies)
        self.runner = EpisodeRunner(*args) if pinned is None else _PinnedRunner(*args, pinned=pinned)
        self.count = 0

    def play(self, question: str, gold: str = "") -> Exchange:
        problem = Problem(self.task.name, f"chat-{self.count}", question, gold, "test")
        with self.policies.full_weights():
            # batch_index = the problem's number: the selection draws differ from problem to problem
            ep = self.runner.run([problem], batch_index=self.count)[0]
        self.count += 1
        return Exchange(ep, [self._decision(t) for t in ep.turns if t.kind == "feedback"], gold)

    def _decision(self, turn) -> Decision:
        e = self.cfg.episode
        names = [s["name"] for s in self.runner.strategies]
        q, how = turn.q_values, e.strategy_selection
        if q is None and self.policies.q_head is not None:
            q = self.policies.q_values([turn.prompt_ids[:turn.state_len]],
                                       [turn.info.get("writer_signal", 0)])[0].tolist()
            how = (f"{e.strategy_selection}, uniform: Q fitted on {self.policies.q_decisions} decisions "
                   f"< episode.min_q_decisions={e.min_q_decisions}")
        elif q is None:
            how = f"{e.strategy_selection}, uniform: the writer has no Q head"
        if isinstance(self.runner, _PinnedRunner):
            how = f"--strategy (selection: {how})"
        return Decision(turn.round, names, q, list(turn.behaviour_probs), int(turn.strategy), how)

    def close(self) -> None:
        self.engine.close()
