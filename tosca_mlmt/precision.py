"""The one place that decides numeric precision: model dtype and bf16 autocast (the LM head always
runs in fp32: ``tosca_mlmt.tensors.fp32_logits``).

Imports nothing of ours. Every caller that needs to know whether bf16 is native goes through
``native_bf16`` so a CPU with and without avx512_bf16/amx_bf16 take the same decision everywhere.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    """True where bf16 matmuls are native: a CUDA device that supports them, or a CPU with
    AMX/avx512_bf16 (elsewhere torch emulates bf16, slower than fp32)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def model_dtype(name: str) -> torch.dtype:
    """``model.dtype``: float32 | bfloat16 | auto (bf16 where native; fp16 on a CUDA device without bf16)."""
    if name in DTYPES:
        return DTYPES[name]
    if name != "auto":
        raise ValueError(f"model.dtype: {name!r} is not one of auto, float32, bfloat16")
    if native_bf16():
        return torch.bfloat16
    return torch.float16 if torch.cuda.is_available() else torch.float32


def use_bf16_autocast(setting: str) -> bool:
    """``lower.autocast``: bf16 | none | auto (= bf16 where native)."""
    return setting == "bf16" or (setting == "auto" and native_bf16())

