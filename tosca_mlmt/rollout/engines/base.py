"""The rollout-engine interface: token ids in, token ids + logprobs out.

Engines never see text. Keeping ids end to end is what lets the episode build every
next prompt from the exact tokens that were sampled (no decode/re-encode drift).

``Generation.logprobs`` are log pi(token | context) of the *unwarped* model
distribution (temperature 1, no top-k/top-p), the quantity PPO's old-logprobs and the
context-dependency bonus need. vLLM calls these ``raw_logprobs``; the HF engine
records the same thing before applying its own sampling warpers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1  # samples per prompt
    seed: int = 0
    # Per-prompt seeds: prompt i's n samples take seeds[i] + k; None = seed + i * n. An engine that
    # seeds each request (vLLM) must not give one seed to a whole call: identical prompts (samples of
    # one problem with the same attempt and strategy) would then come out identical, and all others
    # would share one noise sequence. The HF engine draws every row of a chunk from one generator,
    # whose rows already differ, and reads only ``seed``.
    seeds: tuple[int, ...] | None = None
    stop_regex: str | None = None  # end the turn at the first match (rollout/engines/stop.py), finish_reason "answer"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def prompt_seed(self, i: int) -> int:
        """The seed of prompt i's request (its sample k takes this + k, as vLLM seeds n children)."""
        return self.seeds[i] if self.seeds is not None else self.seed + i * self.n


@dataclass(frozen=True)
class Generation:
    token_ids: tuple[int, ...]  # includes the stop token when finish_reason == "stop"
    logprobs: tuple[float, ...]  # one per token in token_ids
    finish_reason: str  # "stop" (eos), "length", or "answer" (cut after the answer line: rollout/engines/stop.py)


class Engine(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], params: SamplingParams, policy: str) -> list[list[Generation]]:
        """Return ``[len(prompts)][params.n]`` generations sampled from ``policy`` ("solver"/"writer")."""
        ...

    def score(self, prompts: list[list[int]], responses: list[list[int]], policy: str) -> list[list[float]]:
        """Teacher-forced raw log pi(response[i] | prompt + response[:i]) under ``policy``'s current
        weights, one list per pair: the same quantity as ``Generation.logprobs``, for given tokens."""
        ...

    def sync_weights(self, policy: str) -> float:
        """Make the engine serve the policy's current weights; returns seconds spent."""
        ...

    def close(self) -> None: ...


def prefix_counts(engine) -> tuple[int, int] | None:
    """(prompt tokens handed to ``engine`` so far, those its prefix cache served), or None for an
    engine without a prefix cache (hf). Differences of two readings give a stage's hit rate."""
    if not hasattr(engine, "cached_prompt_tokens"):
        return None
    return engine.prompt_tokens, engine.cached_prompt_tokens


def hit_rate(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Share of the prompt tokens between two prefix_counts readings that the cache served."""
    if before is None or after is None:
        return None
    return round((after[1] - before[1]) / max(after[0] - before[0], 1), 4)
