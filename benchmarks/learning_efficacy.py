"""Equal-budget comparison of mlmt, score and single-turn-grpo on held-out arith and GSM8K.

For each task: evaluate the untrained models once ("before"), then for each preset run
train-joint under the same wall-clock budget (joint.max_seconds) and evaluate its final
solver/writer greedily on the same held-out problems ("after"). Every number comes from
`mlmt eval` (three-turn loop, no oracle stop). Writes JSON and a Markdown table to
benchmarks/results/. Small budgets on a 135M model on CPU are noisy: read the table as
what this run measured, nothing more.

    python benchmarks/learning_efficacy.py --budget 600 --eval-limit 13 --gsm8k-limit 10
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
PRESETS = ("mlmt", "score", "single-turn-grpo")
KEYS = ("acc_t1", "acc_final", "delta", "wrong_to_right", "right_to_wrong")


def _eval(cfg_file: Path, overrides: dict, out: Path, run: Path | None = None) -> dict:
    from tosca_mlmt.config import load_config
    from tosca_mlmt.pipelines.evaluate import adapters_from_run, evaluate

    ov = dict(overrides, **{"task.split": "test", "logging.wandb": False, "logging.progress": False})
    if run is not None:
        ov.update(adapters_from_run(run))
    rep = evaluate(load_config(cfg_file, ov), out)
    return {k: rep[k] for k in KEYS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=600.0, help="train-joint seconds per preset and task")
    ap.add_argument("--eval-limit", type=int, default=13, help="held-out arith problems (level 1 has 13)")
    ap.add_argument("--gsm8k-limit", type=int, default=10, help="held-out GSM8K problems (0 = skip GSM8K)")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--work", default="/tmp/tosca-bench-efficacy")
    ap.add_argument("--small-rounds", action="store_true",
                    help="shrink each train-joint round (4 problems, 1 PPO iteration, 6 writer steps) so short "
                         "budgets still finish several rounds")
    args = ap.parse_args()

    from tosca_mlmt.config import load_config
    from tosca_mlmt.pipelines.train_joint import train_joint

    tasks = {"arith": {"task.name": "arith", "task.level": 1, "task.limit": args.eval_limit}}
    if args.gsm8k_limit:
        tasks["gsm8k"] = {"task.name": "gsm8k", "task.data_path": args.data, "task.limit": args.gsm8k_limit,
                          "solver_sampling.max_new_tokens": 128}
    work = Path(args.work) / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    results: dict = {"date": dt.datetime.now().isoformat(timespec="seconds"), "args": vars(args),
                     "machine": f"{platform.machine()} {os.cpu_count()} cores", "tasks": {}}
    for tname, tov in tasks.items():
        base = ROOT / "configs" / "mlmt.yaml"
        res = {"before": _eval(base, tov, work / tname / "before")}
        for preset in PRESETS:
            cfg_file = ROOT / "configs" / f"{preset}.yaml"
            train_ov = {k: v for k, v in tov.items() if k != "task.limit"}
            if args.small_rounds:
                train_ov.update({"joint.collect_problems": 4, "joint.lower_iterations": 1, "joint.upper_steps": 6,
                                 "lower.problems_per_iteration": 2, "upper.warmup_steps": 2, "upper.eval_every": 6,
                                 "upper.batch_size": 4})
            cfg = load_config(cfg_file, dict(train_ov, **{"joint.max_seconds": args.budget, "joint.rounds": 100,
                                                          "logging.wandb": False, "logging.progress": False}))
            t0 = time.time()
            run = work / tname / preset / "run"
            man = train_joint(cfg, run).manifest
            after = _eval(cfg_file, tov, work / tname / preset / "eval", run=run)
            res[preset] = {"after": after, "train_seconds": round(time.time() - t0, 1),
                           "rounds": len(man["rounds"])}
        results["tasks"][tname] = res
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "learning_efficacy.json").write_text(json.dumps(results, indent=2))
    lines = [f"# Learning efficacy ({results['date']}, {results['machine']}, budget {args.budget:.0f} s per run)", "",
             "| task | method | rounds | Acc@t1 | Acc@final | Δ | i→c | c→i |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for tname, res in results["tasks"].items():
        b = res["before"]
        lines.append(f"| {tname} | before training | 0 | " + " | ".join(f"{b[k]:.3f}" for k in KEYS) + " |")
        for preset in PRESETS:
            a = res[preset]["after"]
            lines.append(f"| {tname} | {preset} | {res[preset]['rounds']} | " + " | ".join(f"{a[k]:.3f}" for k in KEYS) + " |")
    (RESULTS / "learning_efficacy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
