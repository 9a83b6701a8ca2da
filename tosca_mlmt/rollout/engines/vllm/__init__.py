"""The vLLM rollout engine (``engine.name=vllm``) and its weight sync.

* ``engine.py``: :class:`VLLMEngine`, generation and scoring on one base, and when and what to sync.
* ``launch.py``: starting vLLM: the process it runs in and the arguments ``LLM(...)`` gets; the
  policies' LoRA ids (:data:`LORA_IDS`).
* ``pair.py``: :class:`VLLMPair`, one engine per base when solver and writer have different bases.
* ``placement.py``: which GPU a rank's engine starts on under a launcher.
* ``sync.py``: how merged weights travel into a running engine (in memory, a shared staging
  buffer, bytes or a file), and which modules a delta carries.
* ``worker.py``: what runs inside vLLM's worker processes (the worker extension) and the formats
  both sides of its RPCs share.
* ``kernels.py``: the direct sync of in-process CPU engines (packed kernels kept per policy).
* ``norm.py``: vLLM's C++ RMSNorm on eager CPU engines.
* ``stop.py``: the logits processor that ends a turn at its answer line.

vLLM itself is an optional extra and is imported only where a function needs it (``stop.py``, which
subclasses a vLLM class, only when an engine starts), so importing this package does not import it;
``rollout.engines.make_engine`` checks that it is installed first.
"""

from tosca_mlmt.rollout.engines.vllm.engine import VLLMEngine
from tosca_mlmt.rollout.engines.vllm.launch import LORA_IDS
from tosca_mlmt.rollout.engines.vllm.pair import VLLMPair

__all__ = ["LORA_IDS", "VLLMEngine", "VLLMPair"]
