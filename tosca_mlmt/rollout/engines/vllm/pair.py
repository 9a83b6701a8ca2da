"""vLLM for a solver and a writer on different base models (``model.writer``).

One vLLM engine holds one base, so a pair of bases gets two engines, each serving its own role:
every turn goes to its role's engine and no turn ever swaps a base. Both run in this process on
CPU (vLLM allows several in-process engines) or as two engine-core processes on a GPU, sharing
its memory by ``engine.vllm.writer_share``. Each engine keeps its own weight sync (its role's
adapter only), prefix cache and counters; the pair reports their sums, as one engine would.
"""

from __future__ import annotations

from tosca_mlmt.config import VLLMConfig
from tosca_mlmt.rollout.engines.base import Generation, SamplingParams
from tosca_mlmt.rollout.engines.vllm.engine import VLLMEngine

# what collect and train-lower read of an engine (summed over the two)
COUNTERS = ("sync_seconds", "check_seconds", "syncs", "prompt_tokens", "cached_prompt_tokens", "decoded_tokens",
            "kept_tokens")


class VLLMPair:
    name = "vllm"

    def __init__(self, policies, cfg: VLLMConfig, seed: int = 0):
        share = {"solver": 1.0 - cfg.writer_share, "writer": cfg.writer_share}
        self.engines: dict[str, VLLMEngine] = {}
        try:
            for role in ("solver", "writer"):
                self.engines[role] = VLLMEngine(policies, cfg, seed=seed, roles=(role,), share=share[role])
        except BaseException:
            self.close()  # a writer engine that fails to start must not leave the solver's memory taken
            raise

    def __getattr__(self, name):
        if name in COUNTERS:
            return sum(getattr(e, name) for e in self.__dict__.get("engines", {}).values())
        raise AttributeError(name)

    def generate(self, prompts: list[list[int]], params: SamplingParams, policy: str) -> list[list[Generation]]:
        return self.engines[policy].generate(prompts, params, policy)

    def score(self, prompts: list[list[int]], responses: list[list[int]], policy: str) -> list[list[float]]:
        return self.engines[policy].score(prompts, responses, policy)

    def sync_weights(self, policy: str, force: bool = False) -> float:
        return self.engines[policy].sync_weights(policy, force)

    def close(self) -> None:
        for e in self.engines.values():
            e.close()
