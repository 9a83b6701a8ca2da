"""Base rates of the embedded model on the fixed arith test sets: Acc@t1, Acc@final and why turns fail.

For each level: the untrained pipeline (fresh adapters = the base model as solver and writer,
uniform strategies) runs one feedback round on the level's fixed test problems, greedy and at the
default sampling temperature. Writes benchmarks/results/arith_base_rates/<date>_<variant>.json (VARIANT: engine, dtype) with 95 % Wilson
intervals, the date, the machine and its load. A measurement, not a test.

    python -m benchmarks.probes.arith_base_rates --levels 1 2 3 --problems 500
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from dataclasses import replace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from benchmarks.common import result_path  # noqa: E402

VARIANT = ("engine", "dtype")  # each where it differs from the default (hf, auto)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--problems", type=int, default=500)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from tosca_mlmt.analysis.stats import wilson
    from tosca_mlmt.config import load_config
    from tosca_mlmt.rollout.engines.hf import HFEngine
    from tosca_mlmt.rollout.runner import EpisodeRunner
    from tosca_mlmt.metrics import summarize
    from tosca_mlmt.models.policies import PolicyPair
    from tosca_mlmt.runtime import package_versions
    from tosca_mlmt.tasks.arith import ArithTask

    base = load_config(overrides={"model.dtype": args.dtype, "logging.wandb": False, "seed": args.seed,
                                  "engine.name": args.engine, "episode.n_samples": 1, "episode.rounds": 1,
                                  "episode.max_prompt_tokens": 768, "engine.vllm.max_model_len": 1024})
    policies = PolicyPair(base.model, seed=args.seed)
    if args.engine == "vllm":
        from tosca_mlmt.rollout.engines.vllm import VLLMEngine
        engine = VLLMEngine(policies, base.engine.vllm, seed=args.seed)
    else:
        engine = HFEngine(policies, base.engine.batch_size)
    rows = []
    for level in args.levels:
        problems = ArithTask(level).load("test", args.problems).problems
        for temp in args.temperatures:
            cfg = replace(base, solver_sampling=replace(base.solver_sampling, temperature=temp),
                          writer_sampling=replace(base.writer_sampling, temperature=temp))
            t0 = time.perf_counter()
            eps = EpisodeRunner(cfg, ArithTask(level), engine, policies).run(problems)
            s = summarize(eps)
            n = len(eps)
            row = {"level": level, "temperature": temp, "problems": n, "seconds": round(time.perf_counter() - t0, 1),
                   **{k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()}}
            for key in ("acc_t1", "acc_final"):
                row[f"{key}_ci95"] = [round(x, 4) for x in wilson(round(s[key] * n), n)]
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("level", "temperature", "acc_t1", "acc_t1_ci95", "acc_final",
                                                   "format_lost_t1", "format_lost_final", "seconds")}), flush=True)
            # after every row: a run stopped half-way keeps what it measured
            out = {"benchmark": "arith_base_rates", "date": dt.date.today().isoformat(), "machine": platform.processor()
                   or platform.machine(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "engine": args.engine,
                   "dtype": str(policies.dtype), "seed": args.seed, "packages": package_versions(), "rows": rows}
            path = result_path("arith_base_rates", VARIANT, engine=None if args.engine == "hf" else args.engine,
                               dtype=None if args.dtype == "auto" else args.dtype)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
