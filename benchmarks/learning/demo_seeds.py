"""`make demo` over several seeds: is its before/after gain more than one lucky run?

Per seed, the demo's three measured commands with `--seed S` (eval of the untrained pair on the
first N arith level-2 test problems, train-joint with configs/demo.yaml, eval again with
--compare-to), then the seeds are pooled: paired-bootstrap 95 % intervals over seeds x problems
for Acc@t1, Acc@final and the after - before difference, and an exact McNemar test per seed.
Writes benchmarks/results/demo_seeds/<date>_<variant>.json (VARIANT: config, --set overrides, seeds, label; date, machine with its CPU's bf16 flags, load, commit, seeds,
per-seed numbers, each command's peak RSS and each PPO stage's seconds summed over the run). A seed
reproduces its numbers on the same code and the same kind of CPU only: bf16 kernels (AMX tiles or
avx512_bf16) round differently, and 64 PPO episodes follow their samples.

    python -m benchmarks.learning.demo_seeds --seeds 0 1 2            # ~8 min per seed on 2 idle cores
    python -m benchmarks.learning.demo_seeds --seeds 0 1 2 --reuse    # pool seeds whose folders are complete
    python -m benchmarks.learning.demo_seeds --config configs/demo-text.yaml --work W2 --results text \
        --against W1   # and this configuration minus the one trained in W1, after training, paired
    python -m benchmarks.learning.demo_seeds --seeds 0 1 2 --set lower.bonus.scorer=auto --work W3 --results auto

A seed's folder is <work>/seed<S> with eval-before/, run/ and eval/ (what `make demo` writes, so a
`make demo DEMO_OUT=<work>/seed0` run counts as seed 0).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.common import MLMT, label, loadavg, machine_info, result_path
from benchmarks.common import run_peak_mib as _run

# config (its stem where not demo), the --set overrides, seeds (where not 0 1 2), the --results label
VARIANT = ("config", "sets", "seeds", "label")


def run_seed(folder: Path, seed: int, problems: int, config: str,
             sets: Sequence[str] = ()) -> tuple[float, dict[str, float]]:
    """The seed's three commands: (wall seconds, peak RSS in MiB of each command)."""
    common = ["--config", config, "--seed", str(seed), *(a for s in sets for a in ("--set", s))]
    t0, peaks = time.time(), {}
    for name, args in (("eval_before", ["eval", *common, "--out", str(folder / "eval-before"), "--limit",
                                        str(problems)]),
                       ("train_joint", ["train-joint", *common, "--out", str(folder / "run")]),
                       ("eval_after", ["eval", *common, "--run", str(folder / "run"), "--out", str(folder / "eval"),
                                       "--limit", str(problems), "--compare-to", str(folder / "eval-before")])):
        peaks[name] = _run(MLMT + args)
    return time.time() - t0, peaks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--problems", type=int, default=100)
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for all three commands of every seed (repeatable), e.g. "
                         "--set engine.vllm.cpu_norm_kernel=false")
    ap.add_argument("--work", default="/tmp/tosca-demo-seeds")
    ap.add_argument("--reuse", action="store_true", help="pool complete seed folders instead of rerunning them")
    ap.add_argument("--results", default=None, help="a label, last in the variant of results/demo_seeds/<date>_<variant>.json "
                                                  "(an old-style file name, e.g. demo-auto.json, is taken as its label)")
    ap.add_argument("--against", help="another configuration's seed folders (its --work): also report this one's "
                                      "Acc@final after training minus that one's, paired over the same seeds x problems")
    args = ap.parse_args()
    from tosca_mlmt.analysis.stats import mcnemar, paired_bootstrap, wilson
    from tosca_mlmt.pipelines.evaluate import eval_outcomes
    from tosca_mlmt.runtime import git_sha

    sha = git_sha()  # the code that runs: read before the first command (a commit may land while seeds run)
    machine = machine_info() | {"load_before": loadavg()}
    work = Path(args.work)
    per, walls, peaks = [], {}, {}
    for seed in args.seeds:
        folder = work / f"seed{seed}"
        if not (args.reuse and (folder / "eval" / "eval.json").exists()):
            wall, peaks[seed] = run_seed(folder, seed, args.problems, args.config, args.sets)
            walls[seed] = round(wall, 1)
        before, after = eval_outcomes(folder / "eval-before"), eval_outcomes(folder / "eval")
        if before["ids"] != after["ids"]:
            raise SystemExit(f"seed {seed}: before and after evaluated different problems")
        per.append((seed, before, after))
    arr = {}  # [seeds, problems] 0/1 outcomes
    for i, when in enumerate(("before", "after")):
        for k in ("t1", "final"):
            arr[f"{when}_{k}"] = np.array([outs[i][k] for _, *outs in per], dtype=float)
    fmt = lambda c: f"{c['mean']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]"  # noqa: E731
    pooled = {k: paired_bootstrap(v) for k, v in arr.items()}
    pooled["final_difference"] = paired_bootstrap(arr["after_final"], arr["before_final"])
    pooled["t1_difference"] = paired_bootstrap(arr["after_t1"], arr["before_t1"])
    seeds = []
    for seed, before, after in per:
        n = len(before["ids"])
        row = {"seed": seed, "problems": n, "environment": after["environment"], "wall_seconds": walls.get(seed),
               "peak_rss_mib": peaks.get(seed)}  # per command; None for a reused folder
        for name, o in (("before", before), ("after", after)):
            for k in ("t1", "final"):
                lo, hi = wilson(sum(o[k]), n)
                row[f"{name}_acc_{k}"] = {"mean": sum(o[k]) / n, "lo": lo, "hi": hi}
        row["final_mcnemar"] = mcnemar(np.array(after["final"]), np.array(before["final"]))
        row["ppo_stage_seconds"] = ppo_stage_seconds(work / f"seed{seed}" / "run")
        seeds.append(row)
        print(f"seed {seed}: Acc@t1 {row['before_acc_t1']['mean']:.2f} -> {row['after_acc_t1']['mean']:.2f}, "
              f"Acc@final {row['before_acc_final']['mean']:.2f} -> {row['after_acc_final']['mean']:.2f}, "
              f"McNemar p {row['final_mcnemar']['p']:.3g}, peak RSS {row['peak_rss_mib']} MiB")
    print(f"pooled over {len(per)} seeds x {args.problems} problems: Acc@final after - before "
          f"{fmt(pooled['final_difference'])}, Acc@t1 after - before {fmt(pooled['t1_difference'])}")
    against = None
    if args.against:  # two configurations of the demo, each trained and evaluated on the same seeds x problems
        other = [eval_outcomes(Path(args.against) / f"seed{seed}" / "eval") for seed, *_ in per]
        if any(o["ids"] != after["ids"] for o, (_, _, after) in zip(other, per)):
            raise SystemExit(f"--against {args.against}: its evals hold other problems")
        theirs = {k: np.array([o[k] for o in other], dtype=float) for k in ("t1", "final")}
        against = {"work": args.against, "git_sha": _sha_of(Path(args.against)),
                   "after_final": paired_bootstrap(theirs["final"]),
                   "after_final_difference": paired_bootstrap(arr["after_final"], theirs["final"]),
                   "after_t1_difference": paired_bootstrap(arr["after_t1"], theirs["t1"])}
        print(f"minus {args.against} after training: Acc@final {fmt(against['after_final_difference'])}, "
              f"Acc@t1 {fmt(against['after_t1_difference'])}")
    config = Path(args.config).stem
    out = result_path("demo_seeds", VARIANT, config=None if config == "demo" else config,
                      sets="-".join(args.sets), seeds=None if args.seeds == [0, 1, 2] else "seeds" + "".join(map(str, args.seeds)),
                      label=label(args.results, "demo"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "demo_seeds", "date": dt.datetime.now().isoformat(timespec="seconds"), "commit": sha,
        "command": f"python -m benchmarks.learning.demo_seeds --seeds {' '.join(map(str, args.seeds))} (make demo's commands, "
                   f"{args.config}{''.join(f', --set {s}' for s in args.sets)}, --seed S)",
        "machine": machine | {"load_after": loadavg()}, "problems": args.problems, "seeds": seeds, "pooled": pooled,
        "against": against}, indent=1))


def ppo_stage_seconds(run: Path) -> dict[str, float]:
    """Seconds of each train-lower stage (``lower/time/*``: generate, old_ref_logprobs, bonus, update,
    ...) summed over the run's PPO iterations, with their count: where a seed's training time went."""
    out: dict[str, float] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "lower/iteration_seconds" not in rec:
            continue
        out["iterations"] = out.get("iterations", 0) + 1
        for k, v in rec.items():
            if k.startswith("lower/time/") or k == "lower/iteration_seconds":
                name = k.rsplit("/", 1)[1]
                out[name] = round(out.get(name, 0.0) + v, 2)
    return out


def _sha_of(work: Path) -> str | None:
    """The code that trained another configuration's seed 0 (its train-joint manifest)."""
    try:
        return json.loads((work / "seed0" / "run" / "manifest.json").read_text()).get("git_sha")
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    main()
