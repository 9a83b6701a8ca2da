"""What the benchmark scripts share: where results go and how they are named, the machine line every
result records, and the helpers more than one script runs. Imports nothing from the scripts (they
import this), so there is no import circle; stdlib only at import time (numpy, torch and the package
are imported inside the functions that need them).

Results: ``benchmarks/results/<benchmark>/<date>_<variant>.json`` (and ``.md`` beside, where a script
writes one), <date> YYYY-MM-DD, <variant> the script's variant keys joined in the order the script
declares (its ``VARIANT``; :func:`result_path`). A run that supersedes an earlier one of the same
variant leaves the older under ``results/<benchmark>/archive/``.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
# the installed console script beside this interpreter (what `make demo` runs)
MLMT = [str(Path(sys.executable).with_name("mlmt"))]
# what `make demo` exports
ENV = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
           WANDB_MODE="offline", WANDB_SILENT="true")


# ---------------------------------------------------------------- result names

def today() -> str:
    return dt.date.today().isoformat()


def _slug(value) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", str(value)).strip("-")


def variant_name(order: Sequence[str], **variant) -> str:
    """``variant``'s values joined by ``_`` in ``order`` (the script's ``VARIANT``): a key left out, None,
    False or "" adds nothing, True adds the key's name; no value at all is ``default``. A key outside
    ``order`` is an error: every script names its keys, in a fixed order, once."""
    unknown = set(variant) - set(order)
    if unknown:
        raise ValueError(f"variant keys {sorted(unknown)} are not in this benchmark's order {list(order)}")
    parts = []
    for key in order:
        v = variant.get(key)
        if v is None or v is False or v == "":
            continue
        parts.append(_slug(key if v is True else v))
    return "_".join(p for p in parts if p) or "default"


def result_path(benchmark: str, order: Sequence[str], date: str | None = None, suffix: str = ".json",
                **variant) -> Path:
    """``benchmarks/results/<benchmark>/<date>_<variant><suffix>`` (date: today)."""
    return RESULTS / benchmark / f"{date or today()}_{variant_name(order, **variant)}{suffix}"


def label(name: str | None, *prefixes: str) -> str | None:
    """A ``--results``/``--label`` value as a variant value: a .json suffix and a leading ``<prefix>-``
    (the old flat names, e.g. ``memory-allocator.json``) dropped."""
    if not name:
        return None
    name = name.removesuffix(".json")
    for p in prefixes:
        if name.startswith(p + "-"):
            return name[len(p) + 1:]
    return None if name in prefixes else name


def out_path(out: str | None, benchmark: str, order: Sequence[str], **variant) -> Path:
    """``--out`` where given, else today's :func:`result_path`; its folder exists. A default name an earlier
    run of the same day and variant holds is left alone: this run takes the first free ``-2``, ``-3``, ...
    (2026-12-06: an evening profile overwrote the afternoon's JSON of the same variant). Taken once, at the
    start, so a script that rewrites its result after every unit keeps writing its own file."""
    path = Path(out) if out else result_path(benchmark, order, **variant)
    base, k = path, 2
    while not out and (path.exists() or path.with_suffix(".md").exists()):
        path, k = base.with_name(f"{base.stem}-{k}{base.suffix}"), k + 1
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------- the machine

def machine_info() -> dict:
    cpuinfo, meminfo = _proc_lines("cpuinfo"), _proc_lines("meminfo")
    cpu = next((x.split(":", 1)[1].strip() for x in cpuinfo if x.startswith("model name")), "")
    mem_gb = next((round(int(x.split()[1]) / 2**20, 1) for x in meminfo if x.startswith("MemTotal")), None)
    return {"cpu_model": cpu, "cpu_flags": cpu_flags(cpuinfo), "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)), "mem_gb": mem_gb, "platform": platform.platform(),
            "python": platform.python_version()}


def _proc_lines(name: str) -> list[str]:
    try:
        return Path("/proc", name).read_text().splitlines()
    except OSError:
        return []


# The flags that pick the bf16 kernels (oneDNN's AMX tiles, avx512_bf16 dot products, or emulation):
# they round differently, so sampled bf16 runs, and what a short training run learns from them,
# differ between two CPUs that share a model name ("AMD EPYC", "Intel Xeon") but not these.
BF16_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_flags(cpuinfo: list[str]) -> list[str]:
    """Which of BF16_FLAGS /proc/cpuinfo's lines (``cpuinfo``) name."""
    line = next((x for x in cpuinfo if x.startswith("flags")), "")
    present = set(line.split(":", 1)[-1].split())
    return [f for f in BF16_FLAGS if f in present]


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------- shared by several scripts

def perturb(policies, role: str, scale: float, gen) -> None:
    """``role``'s LoRA B matrices moved by ``scale`` N(0, 1): a trained-looking adapter, or one more step."""
    import torch

    with torch.no_grad():
        for n, p in policies.model(role).named_parameters():
            if f"lora_B.{role}." in n:
                p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def run_peak_mib(cmd: list[str]) -> float:
    """Runs one command to the end; its peak RSS in MiB."""
    return round(run_measured(cmd).ru_maxrss / 1024, 1)  # Linux: KiB


def run_measured(cmd: list[str], quiet: bool = False, pythonpath: Path | None = None):
    """Runs one command to the end under ENV; the child's own resource usage (os.wait4): its ru_maxrss
    is the command's peak, vLLM included (it runs inside the process on CPU). ``pythonpath``: run
    another checkout's code (speed.memory.baseline_tree)."""
    out = subprocess.DEVNULL if quiet else None
    env = ENV if pythonpath is None else dict(ENV, PYTHONPATH=str(pythonpath))
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=out)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise subprocess.CalledProcessError(p.returncode, cmd)
    return usage
