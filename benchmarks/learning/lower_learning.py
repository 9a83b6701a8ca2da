"""Does train-lower learn? Mean reward on an easy arith level before vs after a short CPU run.

Evaluates the solver (greedy, full three-turn episode) on held-out arith test problems, trains
with `train_lower` for a few iterations, evaluates again with the same problems and seed, and
writes the numbers to benchmarks/results/lower_learning/<date>_<variant>.json (VARIANT). A benchmark, not a test: small
runs on a 135M model are noisy, and whatever comes out is reported as is.

    python -m benchmarks.learning.lower_learning --iterations 12 --eval-problems 32
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks.common import result_path  # noqa: E402

# level, iterations x problems, eval problems, advantage: each only where it differs from the default
VARIANT = ("level", "iterations", "eval", "advantage")


def evaluate(cfg, policies, n: int) -> dict:
    from tosca_mlmt.rollout.engines.hf import HFEngine
    from tosca_mlmt.rollout.runner import EpisodeRunner
    from tosca_mlmt.metrics import summarize
    from tosca_mlmt.tasks import make_task

    ecfg = replace(cfg, episode=replace(cfg.episode, n_samples=1),
                   solver_sampling=replace(cfg.solver_sampling, temperature=0.0),
                   writer_sampling=replace(cfg.writer_sampling, temperature=0.0))
    task = make_task(replace(cfg.task, split="test"))
    problems = task.load("test", n).problems
    eps = EpisodeRunner(ecfg, task, HFEngine(policies, 32), policies).run(problems)
    return summarize(eps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--level", type=int, default=1)
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--problems-per-iteration", type=int, default=8)
    ap.add_argument("--eval-problems", type=int, default=32)
    ap.add_argument("--advantage", default="grpo")
    ap.add_argument("--out", default="/tmp/tosca-bench-lower-learning")
    args = ap.parse_args()

    from tosca_mlmt.config import load_config
    from tosca_mlmt.models.policies import PolicyPair
    from tosca_mlmt.pipelines.train_lower import train_lower

    cfg = load_config(overrides={
        "model.dtype": "float32", "task.level": args.level, "episode.n_samples": 4, "logging.wandb": False,
        "logging.progress": True, "solver_sampling.max_new_tokens": 48, "episode.max_feedback_tokens": 32,
        "lower.iterations": args.iterations, "lower.problems_per_iteration": args.problems_per_iteration,
        "lower.advantage": args.advantage, "lower.minibatch_size": 8, "lower.lr": 2e-4, "lower.keep_snapshots": False,
        "lower.save_every": 10**6,
    })
    policies = PolicyPair(cfg.model, seed=cfg.seed)
    t0 = time.time()
    before = evaluate(cfg, policies, args.eval_problems)
    run = Path(args.out) / f"run-{int(time.time())}"
    train_lower(cfg, run, policies=policies)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    after = evaluate(cfg, policies, args.eval_problems)
    res = {"date": dt.datetime.now().isoformat(timespec="seconds"), "args": vars(args), "seconds": time.time() - t0,
           "before": before, "after": after,
           "train_reward_curve": [r["lower/reward_turn0"] for r in rows],
           "train_final_reward_curve": [r["lower/acc_final"] for r in rows]}
    out = result_path("lower_learning", VARIANT, level=f"L{args.level}" if args.level != 1 else None,
                      iterations=(f"{args.iterations}x{args.problems_per_iteration}"
                                  if (args.iterations, args.problems_per_iteration) != (12, 8) else None),
                      eval=f"eval{args.eval_problems}" if args.eval_problems != 32 else None,
                      advantage=args.advantage if args.advantage != "grpo" else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    for k in ("acc_t1", "acc_final", "delta", "wrong_to_right", "right_to_wrong"):
        print(f"{k:<16} before {before[k]:.3f}   after {after[k]:.3f}")
    print("train turn-1 reward per iteration:", [round(x, 2) for x in res["train_reward_curve"]])


if __name__ == "__main__":
    main()
