"""Where `make demo`'s train-joint memory goes, and what each lever takes off its peak.

Runs `mlmt train-joint -c configs/demo.yaml` once per variant, each its own process, one after the
other, and records the process's peak RSS (os.wait4: vLLM runs inside it on CPU), the process's peak
after each joint step (`joint/peak_rss_gib/<step>` in metrics.jsonl: the step where it rises set it),
each step's seconds and the load average. Variants undo the demo's memory settings one at a time:

  before      glibc's malloc with its adaptive mmap threshold, 2 GiB KV cache, whole-batch scoring,
              one micro-batch
  allocator   + engine.mmap_threshold_kb 64
  demo        + kv_cache_gb 1, score_batch 4, grad_accum 2, engine.allocator lean (configs/demo.yaml
              as shipped: jemalloc where installed, else tcmalloc, else glibc at threshold 64)
  demo-fp32   the demo in fp32, as a CPU without native bf16 runs it
  defaults    the demo's sizes with every memory knob at the library's default (allocator, mmap
              threshold, KV cache, score_batch, minibatch and accumulation): the peak nobody tuned
  demo[-fp32][-kbN][-glibc|-jemalloc|-tcmalloc]   the demo (in fp32) with the mmap threshold at N
              KiB (glibc: where it sits between page faults and the heap's growth) and on that malloc
  lower-defaults[-vllm]   not the demo: `mlmt train-lower` with no config file (every knob at the
              library's default; -vllm: on the vLLM engine), two PPO iterations

The fixed mmap threshold is paid for in page faults. --ppo-pairs N times that: N pairs of offline
train-lower runs (one PPO iteration: scoring, bonus and update of 16 demo episodes from the first
variant's first collect snapshot), threshold 64 and 0 in turn, each a process of its own; wall, user
and system seconds and peak RSS from os.wait4, the ratio taken pair by pair. With --ppo-baseline REV
the pairs are this checkout against commit REV instead (the same runs, both at the demo's threshold):
what a code change does to the trainer's time and memory.

    python -m benchmarks.speed.memory                      # ~5 min per variant on 2 idle cores
    python -m benchmarks.speed.memory --variants before demo --ppo-pairs 3
    python -m benchmarks.speed.memory --variants defaults lower-defaults lower-defaults-vllm --results defaults
    python -m benchmarks.speed.memory --variants demo demo-kb2048 demo-kb8192 demo-fp32 demo-fp32-kb2048
    python -m benchmarks.speed.memory --variants demo-glibc demo-jemalloc demo-tcmalloc demo-fp32-glibc \
        demo-fp32-tcmalloc --results allocator
    python -m benchmarks.speed.memory --variants --ppo-pairs 3 --ppo-iterations 2 --ppo-baseline 0ea28b8 \
        --ppo-snapshots RUN/snapshots --results head-ab

Writes benchmarks/results/memory/<date>_<variant>.json (VARIANT). Peak RSS does not depend on machine load; the seconds do.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.common import MLMT, ROOT, label, loadavg, machine_info, result_path, run_measured
from benchmarks.common import run_peak_mib as _run

# the variants run (where not the default list), the offline PPO timing (where run), the --results label
VARIANT = ("variants", "ppo", "label")
BEFORE = {"engine.allocator": "glibc", "engine.mmap_threshold_kb": 0, "engine.vllm.kv_cache_gb": 2,
          "lower.score_batch": 0, "lower.grad_accum": 1}
# what a CPU without native bf16 runs (model.dtype and lower.autocast "auto" pick fp32 there)
FP32 = {"model.dtype": "float32", "lower.autocast": "none"}
ALLOCATORS = ("glibc", "jemalloc", "tcmalloc")
VARIANTS = {"before": BEFORE, "allocator": {**BEFORE, "engine.mmap_threshold_kb": 64}, "demo": {},
            "demo-fp32": FP32}


# `mlmt train-lower` variants: no config file, two iterations; the per-iteration peak is lower/peak_rss_gib
LOWER = {"lower-defaults": {}, "lower-defaults-vllm": {"engine.name": "vllm"}}
LOWER_ITERATIONS = 2


def library_defaults() -> dict:
    """The demo's memory knobs put back to the library's defaults (read from the config classes, so the
    variant follows them): what a train-joint of the demo's sizes peaks at when nobody tunes memory."""
    from tosca_mlmt.config import load_config

    d = load_config()
    return {"engine.allocator": d.engine.allocator, "engine.mmap_threshold_kb": d.engine.mmap_threshold_kb,
            "engine.vllm.kv_cache_gb": d.engine.vllm.kv_cache_gb, "lower.score_batch": d.lower.score_batch,
            "lower.minibatch_size": d.lower.minibatch_size, "lower.grad_accum": d.lower.grad_accum}


def variant(name: str) -> dict:
    """A named variant's overrides, or those of ``demo[-fp32][-kbN][-ALLOCATOR]``: the demo (in fp32),
    with the mmap threshold at N KiB, on malloc ALLOCATOR (engine.allocator)."""
    if name in VARIANTS:
        return VARIANTS[name]
    if name in LOWER:
        return LOWER[name]
    if name == "defaults":
        return library_defaults()
    base, *rest = name.split("-")
    sets = dict(FP32) if rest[:1] == ["fp32"] else {}
    rest = rest[1:] if sets else rest
    for part in rest:
        if part.startswith("kb") and part[2:].isdigit():
            sets["engine.mmap_threshold_kb"] = int(part[2:])
        elif part in ALLOCATORS:
            sets["engine.allocator"] = part
        else:
            base = ""
    if base != "demo":
        raise argparse.ArgumentTypeError(f"unknown variant {name!r}: one of {', '.join(VARIANTS)}, or "
                                         f"demo[-fp32][-kbN][-{'|-'.join(ALLOCATORS)}]")
    return sets


def run_variant(name: str, sets: dict, work: Path, seed: int) -> dict:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    lower = name in LOWER
    head = ["train-lower", "--set", f"lower.iterations={LOWER_ITERATIONS}"] if lower else [
        "train-joint", "--config", "configs/demo.yaml"]
    cmd = MLMT + head + ["--seed", str(seed), "--out", str(out), "--no-wandb", "--no-progress"] + [
        a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    load0, t0 = os.getloadavg(), time.time()
    peak = _run(cmd)
    steps = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if lower and "lower/peak_rss_gib" in rec:
            steps.append({"iteration": rec["lower/iteration"], "peak_rss_gib": rec["lower/peak_rss_gib"],
                          "seconds": round(rec["lower/iteration_seconds"], 1)})
        for key, v in rec.items():
            if key.startswith("joint/peak_rss_gib/"):
                step = key.rsplit("/", 1)[1]
                steps.append({"round": rec["joint/round"], "step": step, "peak_rss_gib": v,
                              "seconds": round(rec[f"joint/time/{step}"], 1)})
    malloc = json.loads((out / ("run.json" if lower else "manifest.json")).read_text())["packages"].get("malloc")
    return {"variant": name, "command": " ".join(["mlmt", *head, "--seed", str(seed), "--set <variant>"]),
            "overrides": sets, "malloc": malloc, "peak_rss_mib": peak,
            "wall_seconds": round(time.time() - t0, 1), "load_before": load0, "load_after": os.getloadavg(),
            "steps": steps}


def baseline_tree(rev: str, work: Path) -> Path:
    """A checkout of ``rev`` under ``work`` that runs as a whole from PYTHONPATH: the package gets
    links to its cli/, pipelines/ and configs/, which the editable install would otherwise take from
    this checkout."""
    tree = work / f"baseline-{rev}"
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), rev], cwd=ROOT, check=True,
                       capture_output=True)
        for sub in ("cli", "pipelines", "configs"):
            (tree / "tosca_mlmt" / sub).symlink_to(Path("..") / sub)
    return tree


def ppo_pairs(snapshots: Path, n: int, work: Path, iterations: int = 1, baseline: str | None = None) -> dict:
    """n pairs of an offline train-lower (``iterations`` PPO iterations on the first snapshot), in
    turn: mmap_threshold_kb 64 and 0, or with ``baseline`` this checkout's code and that commit's."""
    snap = sorted(p.name for p in snapshots.glob("snap-*"))[0]
    tree = baseline_tree(baseline, work) if baseline else None
    arms = ([("this", {}, None), (baseline, {}, tree)] if baseline
            else [(64, {"engine.mmap_threshold_kb": 64}, None), (0, {"engine.mmap_threshold_kb": 0}, None)])
    runs = []
    for i in range(n):
        for name, sets, code in arms:
            out = work / f"ppo-{name}-{i}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = MLMT + ["train-lower", "--config", "configs/demo.yaml", "--snapshot", snap, "--root", str(snapshots),
                          "--iterations", str(iterations), "--out", str(out), "--no-wandb", "--no-progress", "--set",
                          "lower.keep_snapshots=false"] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
            t0 = time.monotonic()
            ru = run_measured(cmd, quiet=True, pythonpath=code)
            runs.append({"pair": i, "arm": name, "wall_s": round(time.monotonic() - t0, 2),
                         "user_s": round(ru.ru_utime, 2), "sys_s": round(ru.ru_stime, 2),
                         "peak_rss_mib": round(ru.ru_maxrss / 1024, 1), "load": os.getloadavg()})
    ratio = [a["wall_s"] / b["wall_s"] for a, b in zip(runs[::2], runs[1::2])]
    return {"command": f"mlmt train-lower --config configs/demo.yaml --snapshot {snap} --iterations {iterations} "
                       "--set lower.keep_snapshots=false, each arm its own process, in turn",
            "snapshot": snap, "iterations": iterations, "arms": [str(a[0]) for a in arms], "runs": runs,
            "wall_ratio_first_over_second_per_pair": [round(r, 3) for r in ratio],
            "wall_ratio_median": round(float(statistics.median(ratio)), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), help=f"{', '.join(VARIANTS)}, defaults, "
                    f"{', '.join(LOWER)}, or demo[-fp32][-kbN][-{'|-'.join(ALLOCATORS)}]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ppo-pairs", type=int, default=0, help="time the threshold on N pairs of offline PPO "
                                                                   "iterations (0 = skip)")
    ap.add_argument("--ppo-iterations", type=int, default=1, help="PPO iterations per offline run")
    ap.add_argument("--ppo-baseline", metavar="REV", help="time this checkout against commit REV instead of the "
                                                          "threshold (a worktree of REV under --work)")
    ap.add_argument("--ppo-snapshots", metavar="DIR", help="the snapshots to train on (default: the first "
                                                           "variant's run)")
    ap.add_argument("--work", default="/tmp/tosca-bench-memory")
    ap.add_argument("--results", default=None, help="a label, last in the variant of results/memory/<date>_<variant>.json "
                                                  "(an old-style file name, e.g. memory-allocator.json, is taken as its label)")
    args = ap.parse_args()
    try:
        overrides = {name: variant(name) for name in args.variants}
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    from tosca_mlmt.runtime import git_sha

    sha = git_sha()  # before the first run: a commit may land while variants run
    machine = machine_info() | {"load_before": loadavg()}
    rows = []
    for name in args.variants:
        r = run_variant(name, overrides[name], Path(args.work), args.seed)
        rows.append(r)
        print(f"{name:>10} ({r['malloc']}): peak RSS {r['peak_rss_mib'] / 1024:.2f} GiB, "
              f"{r['wall_seconds']:.0f} s, per step {[s['peak_rss_gib'] for s in r['steps']]}", flush=True)
    ppo = None
    if args.ppo_pairs:
        if not (args.ppo_snapshots or args.variants):
            ap.error("--ppo-pairs without a variant needs --ppo-snapshots")
        snaps = Path(args.ppo_snapshots) if args.ppo_snapshots else Path(args.work) / args.variants[0] / "snapshots"
        ppo = ppo_pairs(snaps, args.ppo_pairs, Path(args.work), args.ppo_iterations, args.ppo_baseline)
        print(f"offline PPO, wall {' / '.join(ppo['arms'])} per pair: {ppo['wall_ratio_first_over_second_per_pair']}")
    ppo_name = None if not ppo else f"ppo-{args.ppo_baseline}" if args.ppo_baseline else "ppo-threshold"
    out = result_path("memory", VARIANT, variants=None if args.variants == list(VARIANTS) else "-".join(args.variants),
                      ppo=ppo_name, label=label(args.results, "memory"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "memory", "date": dt.datetime.now().isoformat(timespec="seconds"), "commit": sha,
        "machine": machine | {"load_after": loadavg()}, "seed": args.seed,
        "command": "mlmt train-joint --config configs/demo.yaml --seed S --set <variant> (each row's own command)",
        "variants": rows,
        "ppo_iteration_threshold_timing": ppo},
        indent=1))


if __name__ == "__main__":
    main()
