"""Tokens/s of one train-lower PPO iteration (rollout + update) vs TRL's GRPOTrainer.

Same model (embedded SmolLM2-135M), LoRA r=16 on all linear layers, same prompts (arith), same
group size and completion length, HF generation on CPU for both, one process, run back to back.
Throughput = generated tokens / wall seconds of an iteration (rollout + scoring + update); the
first iteration of each is a warm-up and not counted. Peak RSS (ru_maxrss of this process and of
its children, MiB) is recorded after our run and again after TRL's. Our iteration runs the full three-turn
episode (solve, feedback, refine) and trains on two solver turns; TRL trains one turn.

    python benchmarks/train_lower_throughput.py --problems 4 --group 4 --max-new-tokens 32 --iterations 3
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
os.environ.setdefault("WANDB_MODE", "disabled")

RESULTS = Path(__file__).parent / "results"


def run_ours(args) -> dict:
    from tosca_mlmt.config import load_config
    from tosca_mlmt.pipelines.train_lower import train_lower

    cfg = load_config(overrides={
        "model.dtype": "float32", "task.level": 1, "episode.n_samples": args.group, "logging.wandb": False,
        "logging.progress": False, "solver_sampling.max_new_tokens": args.max_new_tokens,
        "writer_sampling.max_new_tokens": args.max_new_tokens, "episode.max_feedback_tokens": args.max_new_tokens,
        "lower.iterations": args.iterations, "lower.problems_per_iteration": args.problems,
        "lower.advantage": "grpo", "lower.minibatch_size": args.problems * args.group, "lower.save_every": 10**6,
        "lower.keep_snapshots": False,
    })
    out = Path(args.workdir) / f"ours-{int(time.time())}"
    train_lower(cfg, out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:] or rows
    gen = sum(r["lower/len_solve"] * r["lower/episodes"] + r["lower/len_feedback"] * r["lower/episodes"]
              + r["lower/len_refine"] * r["lower/episodes"] for r in timed)
    secs = sum(r["lower/iteration_seconds"] for r in timed)
    return {"generated_tokens": gen, "seconds": secs, "tokens_per_s": gen / secs,
            "time_breakdown": {k.split("/")[-1]: sum(r.get(k, 0) for r in timed) for k in timed[-1]
                               if k.startswith("lower/time/")}}


def run_trl(args) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tosca_mlmt.models.loading import resolve_model
    from tosca_mlmt.tasks.arith import ArithTask

    path = str(resolve_model("smollm2-135m"))
    task = ArithTask(1)
    probs = task.load("train", args.problems * args.iterations).problems
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": task.instruction(p)}], "answer": p.answer}
                            for p in probs])
    by_q = {task.instruction(p): p for p in probs}

    def correctness(prompts, completions, **kw):
        return [task.verify(by_q[p[-1]["content"]], c[-1]["content"]).reward for p, c in zip(prompts, completions)]

    times, toks = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                toks.append(logs["completions/mean_length"] * args.problems * args.group)

    conf = GRPOConfig(output_dir=str(Path(args.workdir) / "trl"), use_vllm=False, num_generations=args.group,
                      max_completion_length=args.max_new_tokens, per_device_train_batch_size=args.problems * args.group,
                      gradient_accumulation_steps=1, max_steps=args.iterations, logging_steps=1, report_to="none",
                      use_cpu=True, bf16=False, learning_rate=1e-4, beta=0.0, save_strategy="no", temperature=0.7)
    trainer = GRPOTrainer(model=path, reward_funcs=[correctness], args=conf, train_dataset=ds,
                          processing_class=AutoTokenizer.from_pretrained(path), callbacks=[Timer()],
                          peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainer.train()
    t, n = times[1:] or times, toks[1:] or toks
    return {"generated_tokens": sum(n), "seconds": sum(t), "tokens_per_s": sum(n) / sum(t)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/tosca-bench-lower")
    args = ap.parse_args()
    from tosca_mlmt.runtime import peak_rss_mb

    load0 = os.getloadavg()[0]
    ours = run_ours(args)
    # ru_maxrss only grows: read after ours it is our PPO run's peak (model load + iterations);
    # after TRL it is the max of both runs.
    ours["peak_rss_mb"] = peak_rss_mb()
    trl = run_trl(args)
    trl["peak_rss_mb_both_runs"] = peak_rss_mb()
    res = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": platform.processor() or platform.machine(),
           "cores": os.cpu_count(), "load_avg_before": load0, "load_avg_after": os.getloadavg()[0],
           "args": vars(args), "ours": ours, "trl_grpo": trl, "ratio_ours_over_trl": ours["tokens_per_s"] / trl["tokens_per_s"]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "train_lower_throughput.json").write_text(json.dumps(res, indent=2))
    print(f"{'':<12}{'gen tokens':>12}{'seconds':>10}{'tok/s':>10}")
    for name in ("ours", "trl_grpo"):
        r = res[name]
        print(f"{name:<12}{r['generated_tokens']:>12.0f}{r['seconds']:>10.1f}{r['tokens_per_s']:>10.2f}")
    print(f"ratio ours / TRL GRPO: {res['ratio_ours_over_trl']:.2f}")


if __name__ == "__main__":
    main()
