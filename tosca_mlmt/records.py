"""The typed records of a logged episode: its turns and where the feedback sits in a refine.

The rollout runner builds them, snapshots store them, the learners read them. Everything a
learner needs about a turn is a typed field; ``Turn.info`` holds only what the verifier and
the runner report for people and summaries (pass rates, counterfactual scores, labels).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tosca_mlmt.tasks.base import Problem


@dataclass(frozen=True)
class FeedbackSpan:
    """[start, end) of the feedback g (strategy prefix included) inside a refine's ``prompt_ids``:
    exactly the tokens the context-dependency bonus and the counterfactual refine cut out."""

    start: int
    end: int

    def cut(self, ids: list[int]) -> list[int]:
        """``ids`` without the feedback."""
        return list(ids[: self.start]) + list(ids[self.end:])


@dataclass
class Turn:
    index: int  # position in the episode: 0 = solve, then feedback/refine pairs
    round: int  # 0 for the first attempt; k for the k-th feedback round
    role: str  # "solver" | "writer"
    kind: str  # "solve" | "feedback" | "refine"
    prompt_ids: list[int]  # exactly what the engine was given (after any cut to max_prompt_tokens)
    response_ids: list[int]  # exactly what it sampled (eos included when it stopped)
    logprobs: list[float]  # raw log pi(token | context), one per response token
    finish_reason: str
    text: str
    reward: float | None = None  # solver turns: verifier reward of this attempt
    correct: bool | None = None
    extracted: str | None = None
    info: dict = field(default_factory=dict)
    # writer turns: the strategy decision (offline Q-learning reads these)
    strategy: int | None = None
    strategy_name: str | None = None
    behaviour_prob: float | None = None
    behaviour_probs: list[float] | None = None
    q_values: list[float] | None = None
    state_len: int | None = None  # prompt_ids[:state_len] is the writer's state s = (x, z, ...)
    # refine turns: where g sits in prompt_ids; None when the cut to max_prompt_tokens took part of it
    feedback_span: FeedbackSpan | None = None
    # the prompt the episode built was longer than episode.max_prompt_tokens and only its end was
    # sent: prompt_ids no longer extends the earlier turns' tokens
    truncated: bool = False


@dataclass
class Episode:
    episode_id: str
    problem: Problem
    sample: int  # index within the problem's turn-1 samples of the batch (n, or a multiple of n when drawn twice)
    turns: list[Turn] = field(default_factory=list)

    @property
    def solver_turns(self) -> list[Turn]:
        return [t for t in self.turns if t.role == "solver"]

    @property
    def r1(self) -> float:
        return self.solver_turns[0].reward

    @property
    def r_final(self) -> float:
        return self.solver_turns[-1].reward
