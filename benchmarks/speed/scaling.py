"""Step time and train tokens/s of offline train-lower: 1 process vs 2 processes (DDP, ZeRO-2) on CPU.

What is measured. One snapshot (arith, P problems x S samples, one feedback round, fp32) is
collected once and cached under ``--work``. Then ``tests/dist_worker.py`` runs offline
train-lower on it through the real pipeline (old/ref log-probs, context bonus, GAE advantages,
PPO update), launched by ``python -m torch.distributed.run --nproc_per_node N``, once per
configuration and repeat:

* ``single-2t``: 1 process x 2 threads (the same 2 cores as the two-process runs: the reference);
* ``single-1t``: 1 process x 1 thread (the per-process compute of the two-process runs);
* ``ddp``:       2 processes x 1 thread, plain DDP (accelerate, gloo);
* ``zero2``:     2 processes x 1 thread, DeepSpeed ZeRO-2 (``configs/deepspeed/zero2.json``).

Every configuration trains on the SAME global batch: the same trajectories per iteration,
``lower.minibatch_size`` rows per optimizer step and ``lower.grad_accum`` micro-batch slots per
step (one process runs all slots; two processes half each), so only the work split and the
communication differ. OMP_NUM_THREADS and ``engine.threads`` are set explicitly per
configuration (``OMP_WAIT_POLICY=PASSIVE`` throughout).

From rank 0's ``lower/metrics.jsonl`` it reads per iteration ``lower/time/update`` (the PPO
update: forward + backward + gradient all-reduce / reduce-scatter + optimizer step),
``lower/time/old_ref_logprobs`` and ``lower/time/bonus`` (no-grad forwards sharded over the
ranks and gathered) and ``lower/train_tokens``; the first iteration is a warm-up and dropped.
Steady-state figures are per optimizer step (update seconds / optimizer steps per iteration) and
train tokens/s = train tokens / update seconds. Separately, per process launch: whole wall time,
start-up (launch -> first iteration starts: imports, model load, process group, DDP/DeepSpeed
init) and tear-down (last iteration -> exit: final checkpoint and adapter save), plus the CPU
seconds the launch used (user + sys of all its processes) and the load average before it.

Repeats run round-robin (A B C D, A B C D, ...) so that drift of the shared machine hits every
configuration alike; the tables give the median and min-max over repeats. While a launch runs, the
CPU time of its processes and of the whole machine is sampled each second, so every launch records
the cores it got and the cores other work took during its timed iterations. Launches during which
other work used at most ``--quiet`` cores get a table of their own, and the overhead paragraph is
computed from them: on a shared 2-core box, one busy core distorts a 2-thread process more than
two 1-thread processes, so the all-launch medians partly measure the load.

    .venv/bin/python -m benchmarks.speed.scaling           # full run: benchmarks/results/scaling/<date>_<variant>.{json,md}
    .venv/bin/python -m benchmarks.speed.scaling --quick --repeats 1   # smoke run, writes under --work
    .venv/bin/python -m benchmarks.speed.scaling --report-only benchmarks/results/scaling/DATE_default.json  # re-render
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import itertools
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from benchmarks.common import ROOT as REPO, loadavg, machine_info as base_info, result_path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("WANDB_MODE", "disabled")

# the configurations (where not all four), repeats (where not 3)
VARIANT = ("configs", "repeats")
WORKER = REPO / "tests" / "dist_worker.py"
ZERO2 = REPO / "configs" / "deepspeed" / "zero2.json"

CONFIGS = {
    "single-2t": {"label": "1 process x 2 threads", "nproc": 1, "threads": 2, "deepspeed": None},
    "single-1t": {"label": "1 process x 1 thread", "nproc": 1, "threads": 1, "deepspeed": None},
    "ddp": {"label": "2 processes x 1 thread, DDP (gloo)", "nproc": 2, "threads": 1, "deepspeed": None},
    "zero2": {"label": "2 processes x 1 thread, DeepSpeed ZeRO-2", "nproc": 2, "threads": 1, "deepspeed": str(ZERO2)},
}
QUIET = 0.25  # cores of other work during the timed iterations, at most, for a launch to count as quiet
REFERENCE = "single-2t"  # the speed-up column is relative to 1 process on the same two cores
PACKAGES = ("torch", "deepspeed", "accelerate", "transformers", "peft", "numpy")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: a small snapshot (2 problems x 4 samples, 16 new tokens), 4 trajectories per "
                         "iteration, 2 iterations, minibatch 4; results go under --work, not benchmarks/results")
    ap.add_argument("--repeats", type=int, default=3, help="launches per configuration (round-robin)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list from {', '.join(CONFIGS)}")
    ap.add_argument("--problems", type=int, default=4, help="problems in the snapshot")
    ap.add_argument("--problems-per-iteration", type=int, default=2,
                    help="lower.problems_per_iteration (x samples = trajectories per iteration; iterations cycle "
                         "through the snapshot)")
    ap.add_argument("--samples", type=int, default=4, help="samples per problem (episode.n_samples)")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="solver max_new_tokens when collecting")
    ap.add_argument("--feedback-tokens", type=int, default=32, help="writer max tokens when collecting")
    ap.add_argument("--iterations", type=int, default=3, help="train-lower iterations per launch (first = warm-up)")
    ap.add_argument("--minibatch", type=int, default=8, help="lower.minibatch_size (rows per optimizer step)")
    ap.add_argument("--grad-accum", type=int, default=2, help="lower.grad_accum (micro-batch slots per step)")
    ap.add_argument("--epochs", type=int, default=1, help="lower.epochs")
    ap.add_argument("--work", default="/tmp/tosca-bench-scaling", help="snapshot cache and run folders")
    ap.add_argument("--out", default=None, help="results JSON (the .md goes beside it); default "
                                                "benchmarks/results/scaling/<date>_<variant>.json, or under --work with --quick")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per launch")
    ap.add_argument("--retries", type=int, default=1, help="relaunches of a failed launch (recorded in the JSON)")
    ap.add_argument("--quiet", type=float, default=QUIET,
                    help="a launch is 'quiet' when other work used at most this many cores during its timed "
                         "iterations; quiet launches get their own table")
    ap.add_argument("--report-only", metavar="JSON", default=None,
                    help="launch nothing: re-summarize an existing results JSON (also a .partial.json) and "
                         "rewrite its .md beside --out")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in {"problems": 2, "problems_per_iteration": 1, "samples": 4, "max_new_tokens": 16,
                     "feedback_tokens": 16, "iterations": 2, "minibatch": 4, "grad_accum": 2}.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown configuration(s) {bad}; choose from {list(CONFIGS)}")
    if args.minibatch % args.grad_accum or args.grad_accum % 2:
        ap.error("--minibatch must divide by --grad-accum, and --grad-accum must be even (split over 2 processes)")
    if args.iterations < 2:
        ap.error("--iterations must be >= 2 (the first is a warm-up)")
    if args.out is None:
        args.out = str(Path(args.work) / "scaling-quick.json") if args.quick else str(result_path(
            "scaling", VARIANT, configs=None if args.configs == list(CONFIGS) else "-".join(args.configs),
            repeats=None if args.repeats == 3 else f"x{args.repeats}"))
    return args


# ------------------------------------------------------------------ machine
def machine_info() -> dict:
    versions = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            versions[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            versions[p] = None
    from tosca_mlmt.train.distributed import default_build_dir

    ext = Path(os.environ.get("TORCH_EXTENSIONS_DIR", default_build_dir()))
    return base_info() | {
        # DeepSpeed JIT-builds its CPU comm op on first use (~30 s of the first ZeRO start-up)
        "deepspeed_cpu_op_prebuilt": any(ext.glob("deepspeed_shm_comm*/*.so")), "versions": versions,
        "omp": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "set per configuration (see configs)"}}


def _cpu_ticks() -> tuple[int, int]:
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(f), f[3] + f[4]  # total, idle + iowait


def busy_cores(seconds: float = 3.0) -> float | None:
    """Cores kept busy by everything else on the machine, sampled just before a launch."""
    try:
        t0, i0 = _cpu_ticks()
        time.sleep(seconds)
        t1, i1 = _cpu_ticks()
    except (OSError, ValueError, IndexError):
        return None
    return round((1 - (i1 - i0) / max(t1 - t0, 1)) * os.cpu_count(), 2)


# ------------------------------------------------------------------ snapshot
def collect_overrides(args) -> dict:
    return {"model.dtype": "float32", "logging.wandb": False, "logging.progress": False, "task.name": "arith",
            "task.level": 1, "task.limit": args.problems, "episode.n_samples": args.samples, "episode.rounds": 1,
            "solver_sampling.max_new_tokens": args.max_new_tokens,
            "writer_sampling.max_new_tokens": args.feedback_tokens,
            "episode.max_feedback_tokens": args.feedback_tokens, "engine.threads": 2, "seed": 0}


def snapshot(args) -> tuple[str, str, dict]:
    """(snapshot root, snapshot id, collect info), collected once per collect configuration."""
    over = collect_overrides(args)
    key = hashlib.sha256(json.dumps(over, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(args.work) / f"snapshot-{key}"
    stamp = root / "snapshot.json"
    if stamp.exists():
        info = json.loads(stamp.read_text())
        return str(root), info["snapshot"], {**info, "cached": True}
    from tosca_mlmt.pipelines.collect import collect

    from tosca_mlmt.config import load_config

    print(f"collecting the snapshot ({args.problems} problems x {args.samples} samples) into {root} ...", flush=True)
    t0 = time.perf_counter()
    res = collect(load_config(overrides={**over, "collect.out": str(root)}))
    info = {"snapshot": res.snapshot_id, "overrides": over, "collect_s": round(time.perf_counter() - t0, 1),
            "summary": res.summary}
    stamp.write_text(json.dumps(info, indent=2, default=str))
    return str(root), res.snapshot_id, {**info, "cached": False}


# ------------------------------------------------------------------ one launch
def train_overrides(args, conf: dict) -> dict:
    over = {"model.dtype": "float32", "logging.wandb": False, "logging.progress": False, "seed": 0,
            "engine.threads": conf["threads"], "episode.n_samples": args.samples, "episode.rounds": 1,
            "lower.iterations": args.iterations, "lower.problems_per_iteration": args.problems_per_iteration,
            "lower.minibatch_size": args.minibatch, "lower.grad_accum": args.grad_accum, "lower.epochs": args.epochs,
            "lower.advantage": "gae", "lower.kl_coef": 0.05, "lower.bonus.coef": 0.2,
            "lower.save_every": 10**6, "lower.keep_snapshots": False}
    if conf["deepspeed"]:
        over["distributed.deepspeed"] = conf["deepspeed"]
    return over



def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_sampled(cmd: list[str], log, env: dict, timeout: float, every: float = 1.0):
    """Run ``cmd``; every ``every`` s record (time, CPU seconds of its process tree, busy CPU
    seconds of the whole machine), so CPU use can be read for any window of the run."""
    import psutil

    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    root, seen, samples = psutil.Process(p.pid), {}, []
    deadline = time.time() + timeout
    while p.poll() is None:
        if time.time() > deadline:
            for q in [*root.children(recursive=True), root]:  # torchrun and its workers
                try:
                    q.kill()
                except psutil.Error:
                    pass
            raise subprocess.TimeoutExpired(cmd, timeout)
        try:
            for q in [root, *root.children(recursive=True)]:
                try:
                    t = q.cpu_times()
                    seen[q.pid] = t.user + t.system  # an exited process keeps its last reading
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        try:
            total, idle = _cpu_ticks()
            machine = (total - idle) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            machine = float("nan")
        samples.append((time.time(), sum(seen.values()), machine))
        time.sleep(every)
    return p.returncode, samples


def _window(samples: list, t0: float, t1: float) -> dict:
    """Cores this launch used, and cores everything else used, between t0 and t1."""
    def at(t, i):
        pts = [(s[0], s[i]) for s in samples]
        for (ta, va), (tb, vb) in itertools.pairwise(pts):
            if ta <= t <= tb:
                return va + (vb - va) * (t - ta) / max(tb - ta, 1e-9)
        return pts[0][1] if t < pts[0][0] else pts[-1][1]
    dt_ = max(t1 - t0, 1e-9)
    ours = (at(t1, 1) - at(t0, 1)) / dt_
    machine = (at(t1, 2) - at(t0, 2)) / dt_
    return {"cores_used": round(ours, 2), "other_cores": round(max(machine - ours, 0.0), 2)}


def launch(args, name: str, rep: int, snap: tuple[str, str]) -> dict:
    conf = CONFIGS[name]
    out = Path(args.work) / "runs" / dt.datetime.now().strftime("%Y%m%d-%H%M%S") / f"{name}-r{rep}"
    out.mkdir(parents=True, exist_ok=True)
    overrides = train_overrides(args, conf)
    (out / "spec.json").write_text(json.dumps({"out": str(out), "snapshot_root": snap[0], "snapshot": snap[1],
                                               "stages": ["lower"], "overrides": overrides}))
    threads = str(conf["threads"])
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OMP_WAIT_POLICY="PASSIVE",
               TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    from tosca_mlmt.parallel import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(conf["nproc"]),
           "--master_port", str(free_port()), str(WORKER), str(out / "spec.json")]
    busy0, load0, cpu0 = busy_cores(), loadavg(), _children_cpu()
    t_launch = time.time()
    with open(out / "worker.log", "w") as log:
        rc, samples = run_sampled(cmd, log, env, args.timeout)
    t_end = time.time()
    cpu_s = _children_cpu() - cpu0
    if rc != 0:
        tail = (out / "worker.log").read_text()[-6000:]
        raise RuntimeError(f"{name} repeat {rep} failed ({rc}); log {out / 'worker.log'}:\n{tail}")
    rows = [json.loads(x) for x in (out / "lower" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "lower/iteration" in r]
    if len(rows) != args.iterations:
        raise RuntimeError(f"{name}: {len(rows)} metric lines, expected {args.iterations} ({out})")
    iters = []
    for r in rows:
        episodes = int(r["lower/episodes"])
        steps = args.epochs * math.ceil(episodes / args.minibatch)
        iters.append({"iteration": r["lower/iteration"], "update_s": r["lower/time/update"],
                      "old_ref_logprobs_s": r.get("lower/time/old_ref_logprobs", 0.0),
                      "bonus_s": r.get("lower/time/bonus", 0.0), "iteration_s": round(r["lower/iteration_seconds"], 4),
                      "train_tokens": r["lower/train_tokens"], "episodes": episodes, "optimizer_steps": steps,
                      "train_tokens_per_s": round(r["lower/train_tokens_per_s"], 2), "end_time": r["time"]})
    timed = iters[1:]  # the first iteration is a warm-up
    upd = sum(i["update_s"] for i in timed)
    steps = sum(i["optimizer_steps"] for i in timed)
    first_start = iters[0]["end_time"] - iters[0]["iteration_s"]
    steady = _window(samples, timed[0]["end_time"] - timed[0]["iteration_s"], timed[-1]["end_time"])
    run = {"config": name, "repeat": rep, "folder": str(out), "other_busy_cores_before": busy0,
           "load_avg_before": load0, "load_avg_after": loadavg(),
           "wall_s": round(t_end - t_launch, 2), "startup_s": round(first_start - t_launch, 2),
           "teardown_s": round(t_end - iters[-1]["end_time"], 2), "cpu_s": round(cpu_s, 2),
           "cores_used": round(cpu_s / (t_end - t_launch), 2),
           "steady_cores_used": steady["cores_used"], "steady_other_cores": steady["other_cores"],
           "cpu_s_per_step": round(upd / steps * steady["cores_used"], 4),
           "update_s_per_step": round(upd / steps, 4),
           "update_s_per_iteration": round(upd / len(timed), 4),
           "old_ref_logprobs_s_per_iteration": round(sum(i["old_ref_logprobs_s"] for i in timed) / len(timed), 4),
           "bonus_s_per_iteration": round(sum(i["bonus_s"] for i in timed) / len(timed), 4),
           "iteration_s": round(sum(i["iteration_s"] for i in timed) / len(timed), 4),
           "train_tokens_per_iteration": sum(i["train_tokens"] for i in timed) / len(timed),
           "train_tokens_per_s": round(sum(i["train_tokens"] for i in timed) / upd, 2),
           "iterations": iters}
    print(f"  {name:<10} r{rep}: update {run['update_s_per_step']:.2f} s/step, {run['train_tokens_per_s']:.0f} tok/s, "
          f"iteration {run['iteration_s']:.1f} s, start-up {run['startup_s']:.1f} s, wall {run['wall_s']:.1f} s, "
          f"steady state: {run['steady_cores_used']:.2f} cores ours, {run['steady_other_cores']:.2f} other", flush=True)
    return run


# ------------------------------------------------------------------ summary + report
SUMMARY_KEYS = ("update_s_per_step", "update_s_per_iteration", "old_ref_logprobs_s_per_iteration",
                "bonus_s_per_iteration", "iteration_s", "train_tokens_per_s", "startup_s", "teardown_s", "wall_s",
                "cpu_s", "cores_used", "steady_cores_used", "steady_other_cores", "cpu_s_per_step")


def mmm(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def summarize(runs: list[dict], names: list[str]) -> dict:
    out = {}
    for name in names:
        mine = [r for r in runs if r["config"] == name]
        if not mine:
            continue
        out[name] = {k: mmm([r[k] for r in mine]) for k in SUMMARY_KEYS}
        out[name]["repeats"] = len(mine)
    ref = out.get(REFERENCE)
    one = out.get("single-1t")
    for name, s in out.items():
        med = s["update_s_per_step"]["median"]
        if ref:
            s["speedup_update_vs_single_2t"] = round(ref["update_s_per_step"]["median"] / med, 3)
            s["speedup_iteration_vs_single_2t"] = round(ref["iteration_s"]["median"] / s["iteration_s"]["median"], 3)
        if one and CONFIGS[name]["nproc"] == 2:
            # perfect scaling: each of 2 processes does half of the 1-thread work in half the time
            ideal = one["update_s_per_step"]["median"] / 2
            s["ideal_update_s_per_step"] = round(ideal, 4)
            s["overhead_update_s_per_step_vs_ideal"] = round(med - ideal, 4)
            s["parallel_efficiency_vs_single_1t"] = round(ideal / med, 3)
    return out


def _fmt(s: dict, key: str, digits: int = 2) -> str:
    d = s[key]
    return f"{d['median']:.{digits}f} ({d['min']:.{digits}f}-{d['max']:.{digits}f})"


def report(res: dict) -> str:
    a, summ = res["args"], res["summary"]
    m = res["machine"]
    intro = (f"{m['cpu_model']}, {m['cores']} cores ({m['cores_usable']} usable), torch {m['versions']['torch']}, "
             f"deepspeed {m['versions']['deepspeed']}, accelerate {m['versions']['accelerate']}; "
             f"OMP_WAIT_POLICY=PASSIVE, OMP_NUM_THREADS per row. Offline train-lower (PPO + GAE + KL + bonus) on one "
             f"snapshot of {a['problems']} arith problems x {a['samples']} samples (1 feedback round, solver max "
             f"{a['max_new_tokens']} new tokens, fp32, SmolLM2-135M + LoRA). Same global batch in every row: "
             f"{a['problems_per_iteration'] * a['samples']} trajectories per iteration (cycling through the "
             f"snapshot), minibatch {a['minibatch']} "
             f"({a['grad_accum']} micro-batch slots of {a['minibatch'] // a['grad_accum']}), {a['epochs']} epoch(s); "
             f"{a['iterations']} iterations per launch, the first dropped as warm-up; {a['repeats']} launch(es) per "
             f"row, round-robin. Median (min-max) over launches.")
    quiet, thr = res.get("summary_quiet") or {}, a.get("quiet", QUIET)
    lines = [f"# Scaling: 1 vs 2 processes on CPU ({res['date']})", "", intro, "",
             "All launches:", "", *_main_table(summ)]
    if quiet:
        lines += ["", (f"Quiet launches only (other work on the machine used <= {thr} cores during the timed "
                      f"iterations; n = launches kept per row):"), "", *_main_table(quiet)]
        missing = [n for n in summ if n not in quiet]
        if missing:
            lines += ["", f"No quiet launch of: {', '.join(missing)}."]
    else:
        lines += ["", f"No launch was quiet (other work <= {thr} cores during its timed iterations)."]
    summ = quiet or summ  # the breakdown and the findings use the fairer of the two
    legend = ("*update s/step*: `lower/time/update` (forward + backward + gradient communication + optimizer "
              "step) per optimizer step. *iteration s*: the whole offline iteration (sharded no-grad old/ref "
              "log-prob and bonus forwards, advantages, update). *startup s*: launch until the first iteration "
              "starts (imports, model load, process group, DDP/DeepSpeed init). Speed-ups are relative to "
              f"`{REFERENCE}`, one process on the same two cores.")
    legend2 = ("Per timed iteration (medians): seconds of each stage, the cores this launch actually got "
               "(CPU seconds of all its processes / wall seconds) and the cores other work on the machine used "
               "meanwhile, and *CPU-s/step* = update s/step x cores used, an estimate of the CPU work per "
               "optimizer step that does not depend on how much of the machine the launch got.")
    lines += ["", legend, "", legend2 + (" Quiet launches." if quiet else " All launches."), "",
              ("| configuration | old/ref log-probs s | bonus s | update s | cores used | other work (cores) | "
               "CPU-s/step (approx.) | CPU s per launch | tear-down s |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in summ.items():
        lines.append(f"| {name} | {s['old_ref_logprobs_s_per_iteration']['median']:.2f} | "
                     f"{s['bonus_s_per_iteration']['median']:.2f} | {s['update_s_per_iteration']['median']:.2f} | "
                     f"{_fmt(s, 'steady_cores_used')} | {_fmt(s, 'steady_other_cores')} | "
                     f"{s['cpu_s_per_step']['median']:.2f} | {s['cpu_s']['median']:.0f} | "
                     f"{s['teardown_s']['median']:.1f} |")
    kept = ", ".join(f"{n}: {q['repeats']}" for n, q in quiet.items())
    lines += ["", "## Overhead", "",
              (f"From the medians of the quiet launches ({kept}"
               f" of {a['repeats']} each). The all-launch medians mix quiet and contended launches in different "
               f"proportions per row, so their speed-ups compare the machine's load as much as the configurations."
               if quiet else "From the medians of all launches (none was quiet)."), "", *findings(res, summ)]
    return "\n".join(lines) + "\n"


def _main_table(summ: dict) -> list[str]:
    lines = [("| configuration | processes x threads | n | update s/step | train tokens/s | speed-up vs 1 process "
              "(update) | iteration s | speed-up (iteration) | startup s | wall s |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in summ.items():
        c = CONFIGS[name]
        lines.append(f"| {name}: {c['label']} | {c['nproc']} x {c['threads']} | {s['repeats']} | "
                     f"{_fmt(s, 'update_s_per_step')} | {_fmt(s, 'train_tokens_per_s', 0)} | "
                     f"{s.get('speedup_update_vs_single_2t', float('nan')):.2f} | {_fmt(s, 'iteration_s')} | "
                     f"{s.get('speedup_iteration_vs_single_2t', float('nan')):.2f} | {_fmt(s, 'startup_s', 1)} | "
                     f"{_fmt(s, 'wall_s', 1)} |")
    return lines


def findings(res: dict, summ: dict) -> list[str]:
    """The overhead, in words, from a summary (medians)."""
    out = []
    med = {n: {k: v["median"] for k, v in s.items() if isinstance(v, dict)} for n, s in summ.items()}
    ref, one = med.get(REFERENCE), med.get("single-1t")
    if ref and one:
        out.append(f"- Threads (1 process): 2 threads take {ref['update_s_per_step']:.2f} s/step, 1 thread "
                   f"{one['update_s_per_step']:.2f} s/step, i.e. the second thread gives "
                   f"{one['update_s_per_step'] / ref['update_s_per_step']:.2f}x; the 2-thread process actually got "
                   f"{ref['steady_cores_used']:.2f} cores (1-thread: {one['steady_cores_used']:.2f}) while other work "
                   f"used {ref['steady_other_cores']:.2f}.")
    for name in ("ddp", "zero2"):
        if name not in med:
            continue
        s, parts = med[name], [f"- {name} ({CONFIGS[name]['label']}): {med[name]['update_s_per_step']:.2f} s/step"]
        if ref:
            sp = summ[name]["speedup_update_vs_single_2t"]
            parts.append(f"{sp:.2f}x the speed of 1 process x 2 threads on the same cores "
                         f"(whole iteration {summ[name]['speedup_iteration_vs_single_2t']:.2f}x), with "
                         f"{s['steady_cores_used']:.2f} cores used vs {ref['steady_cores_used']:.2f}")
        if one:
            parts.append(f"parallel efficiency {summ[name]['parallel_efficiency_vs_single_1t'] * 100:.0f}% against "
                         f"half the 1-thread step ({summ[name]['ideal_update_s_per_step']:.2f} s, "
                         f"{summ[name]['overhead_update_s_per_step_vs_ideal']:+.2f} s/step); in CPU work per step "
                         f"{s['cpu_s_per_step']:.2f} vs {one['cpu_s_per_step']:.2f} CPU-s "
                         f"({(s['cpu_s_per_step'] / one['cpu_s_per_step'] - 1) * 100:+.0f}%: communication, "
                         f"duplicated per-rank work, waiting in collectives)")
        if ref:
            parts.append(f"start-up {s['startup_s']:.1f} s vs {ref['startup_s']:.1f} s "
                         f"({s['startup_s'] - ref['startup_s']:+.1f} s: process group + "
                         f"{'DeepSpeed' if CONFIGS[name]['deepspeed'] else 'DDP'} init, two model loads on two cores)")
        out.append("; ".join(parts) + ".")
    if "ddp" in med and "zero2" in med:
        d, z = med["ddp"]["update_s_per_step"], med["zero2"]["update_s_per_step"]
        out.append(f"- ZeRO-2 vs DDP: {z / d:.2f}x the DDP step time. Only the LoRA adapter and value head "
                   f"train, so partitioning their optimizer state saves little memory at this size; what ZeRO-2 "
                   f"changes per step is DeepSpeed's bookkeeping (flat gradient buffers, reduce-scatter, all-gather "
                   f"of the updated partitions).")
    for f in res.get("failed_launches", []):
        out.append(f"- Launch {f['config']} repeat {f['repeat']} (attempt {f['attempt'] + 1}) failed and was "
                   f"relaunched: {f['error'].strip().splitlines()[-1][:200]}")
    other = [r["steady_other_cores"] for r in res["runs"]]
    out.append(f"- The 2 cores were shared with other work, which used {min(other):.2f}-{max(other):.2f} cores "
               f"(median {statistics.median(other):.2f}) during the timed iterations. A process with 2 OpenMP "
               f"threads waits for its slower thread at every parallel region, so it suffers more from a busy "
               f"core than 2 independent 1-thread processes do: read the speed-ups as measured on this shared "
               f"machine, the CPU-s/step column for the CPU cost, and min-max for the noise.")
    return out


def finish(res: dict, quiet: float) -> None:
    names = list(res["configs"])
    res["args"]["quiet"] = quiet
    res["summary"] = summarize(res["runs"], names)
    res["summary_quiet"] = summarize([r for r in res["runs"] if r["steady_other_cores"] <= quiet], names)


def main(argv=None) -> int:
    args = parse_args(argv)
    return report_only(args) if args.report_only else run(args)


def report_only(args) -> int:
    """--report-only: re-summarize a results JSON, rewrite it and its .md at --out."""
    res = json.loads(Path(args.report_only).read_text())
    finish(res, args.quiet)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(report(res))
    print(report(res))
    print(f"written to {out} and {out.with_suffix('.md')}")
    return 0


def run(args) -> int:
    """The launches, round-robin over the configurations; the JSON (and a .partial.json while running)
    and its .md."""
    Path(args.work).mkdir(parents=True, exist_ok=True)
    root, sid, snap_info = snapshot(args)
    print(f"snapshot {sid} ({'cached' if snap_info['cached'] else 'collected'}) in {root}", flush=True)
    res = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": machine_info(),
           "args": vars(args), "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "configs": {n: {**CONFIGS[n], "env": {"OMP_NUM_THREADS": str(CONFIGS[n]["threads"]),
                                                  "MKL_NUM_THREADS": str(CONFIGS[n]["threads"]),
                                                  "OMP_WAIT_POLICY": "PASSIVE"},
                           "overrides": train_overrides(args, CONFIGS[n])} for n in args.configs},
           "snapshot": {"root": root, "id": sid, **{k: v for k, v in snap_info.items() if k != "snapshot"}},
           "runs": [], "failed_launches": [], "complete": False}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.stem + ".partial.json")
    for rep in range(args.repeats):
        for name in args.configs:
            for attempt in range(args.retries + 1):
                try:
                    res["runs"].append(launch(args, name, rep, (root, sid)))
                    break
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    # e.g. a launch killed from outside on the shared machine: logged, retried
                    res["failed_launches"].append({"config": name, "repeat": rep, "attempt": attempt,
                                                   "error": str(e)[-2000:]})
                    print(f"  {name} r{rep}: launch failed (attempt {attempt + 1}): {str(e)[:300]}", flush=True)
                    if attempt == args.retries:
                        partial.write_text(json.dumps(res, indent=2, default=str) + "\n")
                        raise
            partial.write_text(json.dumps(res, indent=2, default=str) + "\n")  # survives an interrupted run
    res["complete"] = True
    finish(res, args.quiet)
    md = report(res)
    out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(md)
    partial.unlink(missing_ok=True)
    print(md)
    print(f"written to {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
