"""What the hierarchy costs: where a train-joint unit's seconds go, per method, side by side.

Trains the learning benchmark's units (benchmarks/learning/learning_efficacy.py: the same presets,
overrides, sizes and equal solver compute) one after another on this machine, without their eval,
and reads each run's own clocks: the round steps (manifest ``rounds[].seconds``: collect, upper,
lower), the named steps inside them (``joint/collect/time/*``, ``upper/time/*``, ``lower/time/*``
in metrics.jsonl), engine weight syncs and the peak RSS. Each method's training time is then a
ratio to single-turn GRPO's at the same seed, measured in this one invocation (issue 69's targets:
mlmt <= 3x, the selector <= 2x).

    python -m benchmarks.speed.hierarchy_cost                 # the benchmark's sizes, seed 0
    python -m benchmarks.speed.hierarchy_cost --smoke         # tiny sizes: checks the wiring only
    python -m benchmarks.speed.hierarchy_cost --from-work /tmp/tosca-bench-hierarchy-cost/<time>   # a cut run

The JSON is rewritten after every unit, so a run cut short keeps the units it finished.

Results: ``benchmarks/results/hierarchy_cost/<date>_<env>[_smoke].json``.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.common import loadavg, machine_info, out_path
from benchmarks.learning.learning_efficacy import METHODS, in_child, parser as efficacy_parser, run_overrides

VARIANT = ("env", "smoke")
BASELINE = "single-turn-grpo"
DEFAULT_METHODS = (BASELINE, "solver-only", "mlmt-sentences-only", "mlmt")
# where a named step's seconds are logged in a joint run's metrics.jsonl, by the round step that owns it
STEP_PREFIXES = {"collect": "joint/collect/time/", "upper": "upper/time/", "lower": "lower/time/"}


def step_seconds(metrics: Path) -> dict[str, dict[str, float]]:
    """round step -> named step -> seconds summed over the run's records."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        for key, value in rec.items():
            for stage, prefix in STEP_PREFIXES.items():
                if key.startswith(prefix) and isinstance(value, (int, float)):
                    out[stage][key[len(prefix):]] += float(value)
    for rec in map(json.loads, metrics.read_text().splitlines()):  # generation and scoring inside episodes
        for key in ("gen_seconds", "score_seconds"):
            if isinstance(rec.get(f"joint/collect/{key}"), (int, float)):
                out["collect"][f"episodes.{key.removesuffix('_seconds')}"] += rec[f"joint/collect/{key}"]
    return {stage: {k: round(v, 2) for k, v in sorted(steps.items(), key=lambda kv: -kv[1])}
            for stage, steps in out.items()}


def profile(run: Path, wall: float) -> dict:
    """A finished run folder's clocks."""
    manifest = json.loads((run / "manifest.json").read_text())
    stages: dict[str, float] = defaultdict(float)
    for rec in manifest["rounds"]:
        for stage, s in rec.get("seconds", {}).items():
            stages[stage] += s
    peaks = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    peak = max((v for rec in peaks for k, v in rec.items() if k.startswith("joint/peak_rss_gib/")), default=None)
    return {"train_seconds": round(wall, 1), "stage_seconds": {k: round(v, 1) for k, v in stages.items()},
            "sync_seconds": round(sum(r.get("sync_seconds", 0.0) for r in manifest["rounds"]), 1),
            "steps": step_seconds(run / "metrics.jsonl"), "peak_rss_gib": peak,
            "rounds": len(manifest["rounds"])}


def train_unit(name: str, common: dict, train: dict, seed: int, work: Path) -> dict:
    """One method's training at one seed (in a child process of its own, as the learning benchmark
    runs its units: an in-process vLLM engine is not all given back when a run ends)."""
    from tosca_mlmt.config import load_config
    from tosca_mlmt.pipelines.train_joint import train_joint

    preset, extra = METHODS[name]
    run = work / name / f"seed{seed}"
    cfg = load_config(preset, {**common, **train, **(extra or {}), "seed": seed})
    t0 = time.perf_counter()
    train_joint(cfg, run)
    return profile(run, time.perf_counter() - t0)


def ratios(units: list[dict]) -> dict[str, dict[str, float]]:
    """method -> seed -> its training seconds over the baseline's at that seed."""
    done = [u for u in units if u.get("finished", True)]
    base = {u["seed"]: u["train_seconds"] for u in done if u["method"] == BASELINE}
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for u in done:
        if u["seed"] in base and u["method"] != BASELINE:
            out[u["method"]][str(u["seed"])] = round(u["train_seconds"] / base[u["seed"]], 2)
    return dict(out)


def overhead(units: list[dict]) -> dict[str, dict[str, dict]]:
    """method -> seed -> where its ratio comes from: each round step's seconds (and the rest of the wall:
    model loads, engine start) in units of the baseline's training time at that seed, so they sum to the
    ratio; and each of the solver's named steps as a multiple of the baseline's same step (what the
    refine turn does to the solver's own work at equal solver compute)."""
    done = [u for u in units if u.get("finished", True)]
    base = {u["seed"]: u for u in done if u["method"] == BASELINE}
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    for u in done:
        b = base.get(u["seed"])
        if b is None or u["method"] == BASELINE:
            continue
        t = b["train_seconds"]
        stages = {k: round(v / t, 2) for k, v in u["stage_seconds"].items()}
        stages["rest"] = round((u["train_seconds"] - sum(u["stage_seconds"].values())) / t, 2)
        mine, theirs = u["steps"].get("lower", {}), b["steps"].get("lower", {})
        steps = {k: round(mine.get(k, 0.0) / v, 2) for k, v in theirs.items() if v >= 1.0}
        out[u["method"]][str(u["seed"])] = {"of_baseline_time": stages, "solver_steps_x_baseline": steps}
    return dict(out)


def main() -> None:
    ap = efficacy_parser()
    ap.description = __doc__.split("\n")[0]
    ap.set_defaults(methods=list(DEFAULT_METHODS), seeds=[0], work="/tmp/tosca-bench-hierarchy-cost")
    ap.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/hierarchy_cost/...)")
    ap.add_argument("--from-work", type=Path, default=None, help="train nothing: profile the runs an earlier "
                    "invocation left in this work folder (<work>/<method>/seed<k>), e.g. one cut short")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.collect_problems, args.lower_iterations, args.problems_per_iteration = 1, 2, 1, 2
        args.upper_steps = 2
    unknown = [m for m in args.methods if m not in METHODS or METHODS[m][1] is None]
    if unknown:
        ap.error(f"not a trained method of the learning benchmark: {unknown}")
    common, train = run_overrides(args)
    path = out_path(args.out, "hierarchy_cost", VARIANT, env=args.env, smoke="smoke" if args.smoke else None)
    sizes = {k: getattr(args, k) for k in ("env", "level", "rounds", "collect_problems", "lower_iterations",
                                            "problems_per_iteration", "upper_steps", "n_samples", "engine")}
    result = {"benchmark": "hierarchy_cost", "date": time.strftime("%Y-%m-%d"), "machine": machine_info(),
              "load_avg": {"before": loadavg()}, "sizes": sizes, "seeds": args.seeds, "units": [],
              "train_seconds": "wall seconds of train_joint in the unit's process, model loads included"}
    if args.from_work is not None:
        result["units"] = assembled(args.from_work, args.methods, args.seeds)
        result["load_avg"] = None  # the cut run's load was not kept; the record states what was seen
        result["train_seconds"] = ("the run's own seconds_used (its round steps; model loads and engine start "
                                   "before the first round not counted): assembled from " + str(args.from_work))
    else:
        work = Path(args.work) / time.strftime("%Y%m%d-%H%M%S")
        for seed in args.seeds:  # seed-major: a cut run still leaves complete pairs
            for name in args.methods:
                print(f"{name} seed {seed} ...", flush=True)
                u = in_child(train_unit, name, common, train, seed, work)
                result["units"].append({"method": name, "seed": seed, **u})
                print(f"  {u['train_seconds']} s, stages {u['stage_seconds']}", flush=True)
                write(path, result)  # after every unit: a run cut short keeps what it measured
    write(path, result)
    print(json.dumps(result["ratio_to_single_turn_grpo"]))
    print(f"written to {path}")


def write(path: Path, result: dict) -> None:
    if result["load_avg"] is not None:
        result["load_avg"]["after"] = loadavg()
    result["ratio_to_single_turn_grpo"] = ratios(result["units"])
    result["overhead"] = overhead(result["units"])
    path.write_text(json.dumps(result, indent=1) + "\n")


def assembled(work: Path, methods: list[str], seeds: list[int]) -> list[dict]:
    """The units an earlier invocation's work folder holds (``<work>/<method>/seed<k>``), each timed by its
    manifest's seconds_used, all of them alike; a run that did not finish its rounds is kept with
    ``finished: false`` and no ratio."""
    units = []
    for seed in seeds:
        for name in methods:
            run = work / name / f"seed{seed}"
            if not (run / "manifest.json").is_file():
                continue
            manifest = json.loads((run / "manifest.json").read_text())
            u = {"method": name, "seed": seed, **profile(run, manifest.get("seconds_used", 0.0))}
            u["finished"] = bool(manifest.get("rounds")) and all(
                set(r.get("done", [])) >= {"collect", "upper", "lower"} for r in manifest["rounds"])
            units.append(u)
    return units

if __name__ == "__main__":
    main()
