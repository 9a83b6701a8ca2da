"""Tokens/s of one train-lower PPO iteration (rollout + update) vs TRL's GRPOTrainer.

Same model (embedded SmolLM2-135M), LoRA r=16 on all linear layers, same prompts (arith), same
group size and completion length, on CPU. Ours generates with ``--engine`` (hf or vllm; or
``--engines hf vllm`` for both, side by side); TRL generates with HF ``generate``: its vLLM mode
does not run on CPU, so that is its fastest CPU setting. Each run is its own process, one after
the other (never two at once), so each has a fresh heap and its own peak RSS (ru_maxrss, MiB);
the load average is recorded before and after each run. Both sides run on the malloc a ``mlmt`` command
picks by default (``engine.allocator: auto``: tcmalloc where installed); until 2026-12-07 this mode ran on
whatever the caller's shell preloaded (glibc unless set by hand). Throughput = generated tokens / wall
seconds of an iteration (rollout + scoring + update); the first iteration of each is a warm-up
and not counted. Our vLLM engine starts before the first iteration (``make_engine`` runs ahead of
the loop), so its start-up is in no iteration's seconds. Our iteration runs the full three-turn
episode (solve, feedback, refine) and trains on two solver turns; TRL trains one turn.
``--single-turn`` makes ours the same work as TRL's: turn 1 only (episode.rounds 0), GRPO, beta 0,
one optimizer step per batch; its results are the variant ``single-turn``.
``--bonus-scorers trainer engine`` runs ours once per ``lower.bonus.scorer``: with ``engine`` the
context bonus is scored by the rollout engine (its sampling log-probs and one prefill without g),
so, the batch being one optimizer step, no trainer forward runs before the update. The default,
``auto`` (the config's default), picks the engine on vLLM and the trainer on HF; each result
records which scored (``bonus_engine_scored``).
``--syncs direct delta file`` runs ours on vLLM once per weight-sync setting: ``direct`` (the default,
``engine.vllm.direct_sync``: kernels packed from merged layers, each policy's kept), ``delta`` (in-memory
deltas through vLLM's reload, the default before) and ``file`` (full file round trips); each result
logs the seconds of every engine sync of the timed iterations (``time_breakdown.engine_sync_total``).
Precision: our model weights are fp32 and our update autocasts to bf16 where the CPU has it
natively (``lower.autocast=auto``); TRL's ``bf16`` flag follows the same decision by default
(``--trl-bf16``), so both train in the same precision (until 2026-11-26 TRL ran fp32 throughout).

    python -m benchmarks.speed.train_lower_throughput --engines vllm hf --problems 4 --group 4 --max-new-tokens 32 --iterations 3
    python -m benchmarks.speed.train_lower_throughput --engines vllm --single-turn
    python -m benchmarks.speed.train_lower_throughput --engines vllm --bonus-scorers trainer engine
    python -m benchmarks.speed.train_lower_throughput --engines vllm --syncs direct delta file
    python -m benchmarks.speed.train_lower_throughput --allocators glibc tcmalloc jemalloc --rounds 2

``--old-pass-ab`` times ours alone (vLLM) with ``lower.old_logprobs`` auto and recompute, alternating
(``--rounds`` each; results: the variant ``old-pass``); with ``--set`` overrides that make
more than one minibatch, auto scores pi_old on the later minibatches' rows only:

    python -m benchmarks.speed.train_lower_throughput --old-pass-ab --rounds 3 --set lower.minibatch_size=8 --set lower.kl_mode=loss

``--allocators`` times ours alone (vLLM, no TRL run) once per malloc and round, the arms alternating
(reversed every other round): each child starts with the library in ``LD_PRELOAD`` (``glibc``: none; other preloads kept),
as ``engine.allocator`` makes the mlmt command do; ``NAME@CONF`` also sets ``MALLOC_CONF`` (jemalloc's
options, e.g. ``jemalloc@oversize_threshold:0,dirty_decay_ms:-1``). Each run records its wall, user
and system seconds and minor page faults (os.wait4) and the malloc it ran on; results: the variant
``allocators``.

Results: ``benchmarks/results/train_lower_throughput/<date>_<variant>.json``, VARIANT's keys in order:
mode (allocators, old-pass; none for the TRL comparison), engines (where not hf), single-turn, bonus
scorers (where not auto), syncs (where not direct), the --set overrides.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("WANDB_MODE", "disabled")

from benchmarks.common import ROOT, out_path  # noqa: E402

VARIANT = ("mode", "engines", "single_turn", "scorers", "syncs", "sets")
MODULE = "benchmarks.speed.train_lower_throughput"  # what a child runs: python -m MODULE --child ...


def result_variant(args, mode: str | None = None, engines: list[str] | None = None) -> dict:
    return {"mode": mode, "engines": None if engines in (None, ["hf"]) else "-".join(engines),
            "single_turn": "single-turn" if args.single_turn else None,
            "scorers": None if args.bonus_scorers == ["auto"] else "-".join(args.bonus_scorers),
            "syncs": None if args.syncs == ["direct"] else "-".join(args.syncs), "sets": "-".join(args.set)}


def child_env(env: dict | None) -> dict:
    """``env`` (else this process's), with the checkout first on PYTHONPATH: the child runs ``-m MODULE``."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


# engine settings of each --syncs value
SYNCS = {"direct": {}, "delta": {"engine.vllm.direct_sync": False},
         "file": {"engine.vllm.direct_sync": False, "engine.vllm.weight_sync": "file", "engine.vllm.delta_sync": False}}


def run_ours(args, engine: str, scorer: str = "auto", sync: str = "direct") -> dict:
    from tosca_mlmt.config import load_config
    from tosca_mlmt.config.load import parse_override
    from tosca_mlmt.pipelines.train_lower import train_lower

    cfg = load_config(overrides={
        "engine.name": engine, "model.dtype": "float32", "task.level": 1, "episode.n_samples": args.group, "logging.wandb": False,
        "logging.progress": False, "solver_sampling.max_new_tokens": args.max_new_tokens,
        "writer_sampling.max_new_tokens": args.max_new_tokens, "episode.max_feedback_tokens": args.max_new_tokens,
        "lower.iterations": args.iterations, "lower.problems_per_iteration": args.problems,
        "lower.advantage": "grpo", "lower.minibatch_size": args.problems * args.group, "lower.save_every": 10**6,
        "lower.keep_snapshots": False, "lower.bonus.scorer": scorer, **({"episode.rounds": 0} if args.single_turn else {}),
        **SYNCS[sync], **dict(parse_override(x) for x in args.set),
    })
    out = Path(args.workdir) / f"ours-{engine}-{scorer}-{int(time.time())}"
    t0 = time.perf_counter()
    train_lower(cfg, out)
    total = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:] or rows
    # tokens of the turns the episodes recorded (response ids, eos included, as both engines return them)
    gen = sum((r["lower/len_solve"] + r.get("lower/len_feedback", 0) + r.get("lower/len_refine", 0))
              * r["lower/episodes"] for r in timed)
    # cross-check: the tokens the engine handed back (runner.gen_tokens), from gen_tokens_per_s x the
    # generate seconds (rounded to 0.1 ms in the log, so equal up to that rounding)
    engine_gen = sum(r["lower/gen_tokens_per_s"] * r["lower/time/generate"] for r in timed)
    secs = sum(r["lower/iteration_seconds"] for r in timed)
    from tosca_mlmt.precision import use_bf16_autocast

    scored = [r["lower/bonus/engine_scored"] for r in timed if "lower/bonus/engine_scored" in r]
    return {"engine": engine, "bonus_scorer": scorer, "sync": sync, "timed_iterations": len(timed),
            "bonus_engine_scored": max(scored) if scored else None, "old_pass": timed[-1].get("lower/old_pass"),
            "autocast_bf16": use_bf16_autocast(cfg.lower.autocast),
            "generated_tokens": gen, "engine_generated_tokens": round(engine_gen, 1),
            "seconds": secs, "tokens_per_s": gen / secs,
            "warmup_iteration_seconds": rows[0]["lower/iteration_seconds"] if len(rows) > 1 else None,
            "process_seconds_incl_load_and_engine_start": round(total, 1),
            "time_breakdown": {k.split("/")[-1]: sum(r.get(k, 0) for r in timed) for k in timed[-1]
                               if k.startswith("lower/time/")}}


def run_trl(args) -> dict:
    import torch
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
                      use_cpu=not torch.cuda.is_available(), bf16=trl_bf16(args), learning_rate=1e-4, beta=0.0, save_strategy="no", temperature=0.7)
    trainer = GRPOTrainer(model=path, reward_funcs=[correctness], args=conf, train_dataset=ds,
                          processing_class=AutoTokenizer.from_pretrained(path), callbacks=[Timer()],
                          peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainer.train()
    t, n = times[1:] or times, toks[1:] or toks
    return {"engine": "hf (use_vllm=False)", "device": "cuda" if torch.cuda.is_available() else "cpu", "bf16": trl_bf16(args), "generated_tokens": sum(n), "seconds": sum(t),
            "tokens_per_s": sum(n) / sum(t)}


def trl_bf16(args) -> bool:
    """TRL's bf16 (autocast) flag: by default the decision our lower.autocast=auto makes on this machine
    (bf16 where the CPU has it natively), so both train in the same precision."""
    from tosca_mlmt.precision import use_bf16_autocast

    return use_bf16_autocast("auto") if args.trl_bf16 == "auto" else args.trl_bf16 == "on"


def child(args) -> None:
    """One run in this process; its result (with this process's peak RSS) goes to ``args.child_out``."""
    from tosca_mlmt.runtime import allocator_in_use, git_sha, peak_rss_mb

    kind, engine, scorer, sync = (args.child.split(":") + ["", "", ""])[:4]
    res = run_ours(args, engine, scorer, sync or "direct") if kind == "ours" else run_trl(args)
    res["peak_rss_mb"] = peak_rss_mb()  # this run alone: model load(s), engine and iterations
    res["malloc"] = allocator_in_use()
    res["code"] = git_sha()  # each child's own: a run spans minutes, the tree may change between children
    Path(args.child_out).write_text(json.dumps(res))


def spawn(args, what: str, env: dict | None = None, sets: tuple[str, ...] = ()) -> dict:
    """One run in a child process; ``sets``: config overrides of this run on top of ``--set``."""
    out = Path(args.workdir) / f"result-{what.replace(':', '-')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", MODULE, "--child", what, "--child-out", str(out), "--problems", str(args.problems),
           "--group", str(args.group), "--max-new-tokens", str(args.max_new_tokens),
           "--iterations", str(args.iterations), "--workdir", args.workdir, "--trl-bf16", args.trl_bf16] + (
        ["--single-turn"] if args.single_turn else []) + [a for x in (*args.set, *sets) for a in ("--set", x)]
    before = os.getloadavg()
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=child_env(env))
    _, status, usage = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise subprocess.CalledProcessError(os.waitstatus_to_exitcode(status), cmd)
    res = json.loads(out.read_text())
    res["process_wall_s"] = round(time.perf_counter() - t0, 1)
    res["process_user_s"], res["process_sys_s"] = round(usage.ru_utime, 1), round(usage.ru_stime, 1)
    res["minor_page_faults"] = usage.ru_minflt
    res["load_avg_before"], res["load_avg_after"] = list(before), list(os.getloadavg())
    return res


def alternate(args, arms: dict[str, tuple[dict | None, tuple[str, ...]]], path: Path, notes: str) -> dict:
    """Ours on vLLM alone (no TRL run) under each arm's (environment, config overrides), ``--rounds``
    rounds, the order reversed every other round; the JSON is rewritten after every run."""
    res = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": platform.processor() or platform.machine(),
           "cores": os.cpu_count(), "args": {k: v for k, v in vars(args).items() if not k.startswith("child")},
           "notes": "ours on vLLM alone (no TRL run), one process per run, arms alternating; tokens_per_s and "
                    "time_breakdown (seconds summed over the timed iterations) as in the TRL comparison; "
                    "process_* and minor_page_faults from os.wait4; " + notes, "runs": []}
    names = list(arms)
    for r in range(args.rounds):
        for arm in (names if r % 2 == 0 else names[::-1]):
            env, sets = arms[arm]
            run = spawn(args, "ours:vllm:auto:direct", env=env, sets=sets)
            res["runs"].append({"arm": arm, "round": r, **run})
            tb = run["time_breakdown"]
            print(f"{arm:<28} round {r}: {run['tokens_per_s']:.1f} tok/s, old/ref {tb.get('old_ref_logprobs', 0):.1f} s, "
                  f"update {tb['update']:.1f} s, {run['minor_page_faults'] / 1e6:.1f} M faults, "
                  f"peak {run['peak_rss_mb']['self'] / 1024:.2f} GiB ({run['malloc']})", flush=True)
            path.write_text(json.dumps(res, indent=2))
    return res


def summarise(res: dict, path: Path, fields: dict, extra: dict | None = None) -> None:
    """Per arm: the median of each of ``fields`` (name -> reader of a run) and tokens/s against the
    first arm; ``extra`` entries join the summary as they are."""
    import statistics

    arms = list(dict.fromkeys(x["arm"] for x in res["runs"]))
    med = {arm: {name: statistics.median(get(x) for x in res["runs"] if x["arm"] == arm)
                 for name, get in {"tokens_per_s_median": lambda x: x["tokens_per_s"], **fields}.items()}
           for arm in arms}
    res["summary"] = {arm: {**{k: round(v, 3) for k, v in m.items()},
                            "ratio_to_" + arms[0]: round(m["tokens_per_s_median"] / med[arms[0]]["tokens_per_s_median"], 3)}
                      for arm, m in med.items()}
    res["summary"].update(extra or {})
    path.write_text(json.dumps(res, indent=2))
    print(json.dumps(res["summary"], indent=1))


def allocator_ab(args) -> None:
    """``--allocators``: ours on vLLM under each malloc; medians and ratios to the first arm."""
    from tosca_mlmt.errors import ConfigError
    from tosca_mlmt.runtime import LIBRARIES, preload_env, wanted_allocator

    arms = {}
    for arm in args.allocators:
        name, _, conf = arm.partition("@")
        if name not in ("glibc", *LIBRARIES):
            raise SystemExit(f"--allocators {arm}: the malloc is one of glibc, {', '.join(LIBRARIES)}")
        try:
            lib = wanted_allocator(name)[1]  # an explicit malloc that is not installed says what to install
        except ConfigError as e:
            raise SystemExit(f"--allocators {arm}: {e}") from None
        env = preload_env(lib, {k: v for k, v in os.environ.items() if k != "MALLOC_CONF"})
        arms[arm] = (dict(env, **({"MALLOC_CONF": conf} if conf else {})), ())
    path = out_path(args.out, "train_lower_throughput", VARIANT, **result_variant(args, "allocators"))
    res = alternate(args, arms, path, "arms: the malloc in LD_PRELOAD")
    summarise(res, path, {"update_s_median": lambda x: x["time_breakdown"]["update"],
                          "minor_faults_median": lambda x: x["minor_page_faults"],
                          "peak_rss_gib_median": lambda x: x["peak_rss_mb"]["self"] / 1024})


def old_pass_ab(args) -> None:
    """``--old-pass-ab``: lower.old_logprobs auto (pi_old scored on the rows after the first
    minibatch only) against recompute (every row), the same batches otherwise."""
    arms = {mode: (None, (f"lower.old_logprobs={mode}",)) for mode in ("auto", "recompute")}
    path = out_path(args.out, "train_lower_throughput", VARIANT, **result_variant(args, "old-pass"))
    res = alternate(args, arms, path, "arms: lower.old_logprobs; old_pass = the share of rows the pi_old pass "
                                      "scored (lower/old_pass of the last iteration)")
    summarise(res, path, {"old_ref_logprobs_s_median": lambda x: x["time_breakdown"]["old_ref_logprobs"],
                          "update_s_median": lambda x: x["time_breakdown"]["update"],
                          "seconds_median": lambda x: x["seconds"], "old_pass": lambda x: x["old_pass"]},
              {"old_ref_ratio_per_round": old_ref_ratios(res["runs"])})


# the stages both arms run alike: how much faster or slower the machine was during one run of a pair
ALIKE = ("generate", "bonus", "update")


def old_ref_ratios(runs: list[dict]) -> list[dict]:
    """Per round: recompute's old/ref seconds over auto's, raw and divided by the same ratio of
    the ALIKE stages, which takes out a machine that sped up or slowed down between the two runs
    (shared 2-core hosts drift by 1.3x within minutes)."""
    out = []
    for rnd in sorted({x["round"] for x in runs}):
        arm = {x["arm"]: x["time_breakdown"] for x in runs if x["round"] == rnd}
        if {"auto", "recompute"} <= arm.keys():
            a, r = arm["auto"], arm["recompute"]
            raw = r["old_ref_logprobs"] / a["old_ref_logprobs"]
            drift = sum(r[k] for k in ALIKE) / sum(a[k] for k in ALIKE)
            out.append({"round": rnd, "raw": round(raw, 3), "alike_stages": round(drift, 3),
                        "drift_adjusted": round(raw / drift, 3)})
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--engine", choices=("hf", "vllm"), help="our rollout engine (default hf)")
    ap.add_argument("--engines", nargs="+", choices=("hf", "vllm"),
                    help="run ours on each, side by side with one TRL run (TRL runs after the first)")
    ap.add_argument("--single-turn", action="store_true", help="ours trains turn 1 only, as TRL does")
    ap.add_argument("--bonus-scorers", nargs="+", choices=("auto", "trainer", "engine"), default=["auto"],
                    help="lower.bonus.scorer of our runs, each engine with each (engine: no pi_old pass; "
                         "auto: the engine on vLLM, the trainer on HF)")
    ap.add_argument("--syncs", nargs="+", choices=tuple(SYNCS), default=["direct"],
                    help="vLLM weight-sync settings to run ours with (hf: the first only)")
    ap.add_argument("--allocators", nargs="+", metavar="NAME[@MALLOC_CONF]",
                    help="time ours alone on vLLM under each malloc (glibc, tcmalloc, jemalloc), alternating")
    ap.add_argument("--old-pass-ab", action="store_true",
                    help="time ours alone on vLLM with lower.old_logprobs auto and recompute, alternating")
    ap.add_argument("--rounds", type=int, default=2, help="--allocators, --old-pass-ab: runs per arm")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override of our runs, after the script's own (repeatable)")
    ap.add_argument("--workdir", default="/tmp/tosca-bench-lower")
    ap.add_argument("--trl-bf16", choices=("auto", "on", "off"), default="auto",
                    help="TRL's bf16 autocast; auto = what our lower.autocast=auto picks here")
    ap.add_argument("--out", help="result JSON (default: results/train_lower_throughput/<date>_<variant>.json)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.allocators:  # each arm's child gets its own malloc
        return allocator_ab(args)
    # the other modes on the malloc a `mlmt` command picks by default (engine.allocator auto): the
    # children, ours and TRL's, inherit it
    from tosca_mlmt.runtime import use_allocator

    use_allocator("auto")
    if args.old_pass_ab:
        return old_pass_ab(args)
    if args.engine and args.engines:
        ap.error("give --engine or --engines, not both")
    return ours_vs_trl(args, ap)


def ours_vs_trl(args, ap: argparse.ArgumentParser) -> None:
    """The default mode: ours on each engine (x bonus scorer x sync) against one TRL GRPOTrainer run."""
    engines = args.engines or [args.engine or "hf"]
    import importlib.util

    if importlib.util.find_spec("trl") is None:  # fail before minutes of our runs, not after
        ap.error("TRL is not installed: pip install 'tosca-mlmt[bench]'")
    res = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": platform.processor() or platform.machine(),
           "cores": os.cpu_count(), "args": {k: v for k, v in vars(args).items() if not k.startswith("child")},
           "engines": engines, "ours": {}, "trl_grpo": None,
           "notes": "each run its own process, one after the other; TRL's vLLM mode does not run on CPU, so HF "
                    "generate is its fastest CPU setting; " + (
                        "ours trains turn 1 only (episode.rounds 0), the same work as TRL" if args.single_turn else
                        "ours runs three-turn episodes (solve, feedback, refine) and trains two solver turns, TRL "
                        "one turn") + "; load_avg_* = os.getloadavg() (1, 5, 15 min)"}
    path = out_path(args.out, "train_lower_throughput", VARIANT, **result_variant(args, None, engines))
    # TRL runs right after our first variant, so a cut-short invocation still has one ratio; the
    # JSON is rewritten after every run. A variant is keyed by its engine, plus "+engine-bonus" when
    # the engine is asked to score the bonus and "+auto-bonus" under auto (keys of files before auto
    # existed: a bare engine name was the trainer scorer).
    # A sync setting other than direct (the default) adds "+<sync>-sync".
    variants = [(e, sc, sy) for e in engines for sc in args.bonus_scorers
                for sy in (args.syncs if e == "vllm" else args.syncs[:1])]
    order = [("ours", variants[0]), ("trl", None)] + [("ours", v) for v in variants[1:]]
    for kind, variant in order:
        if kind == "ours":
            engine, scorer, sync = variant
            key = engine + {"trainer": "", "engine": "+engine-bonus", "auto": "+auto-bonus"}[scorer] + (
                "" if sync == "direct" else f"+{sync}-sync")
            res["ours"][key] = spawn(args, f"ours:{engine}:{scorer}:{sync}")
        else:
            res["trl_grpo"] = spawn(args, "trl")
        if res["trl_grpo"]:
            res["ratio_ours_over_trl"] = {e: r["tokens_per_s"] / res["trl_grpo"]["tokens_per_s"]
                                          for e, r in res["ours"].items()}
        path.write_text(json.dumps(res, indent=2))
    print(f"{'':<26}{'gen tokens':>12}{'seconds':>10}{'tok/s':>10}{'ratio':>8}{'peak MiB':>10}{'load 1m':>12}")
    for name, r in [(f"ours-{e}", r) for e, r in res["ours"].items()] + [("trl_grpo", res["trl_grpo"])]:
        ratio = r["tokens_per_s"] / res["trl_grpo"]["tokens_per_s"]
        print(f"{name:<26}{r['generated_tokens']:>12.0f}{r['seconds']:>10.1f}{r['tokens_per_s']:>10.2f}{ratio:>8.2f}"
              f"{r['peak_rss_mb']['self']:>10.0f}{r['load_avg_before'][0]:>6.1f}-{r['load_avg_after'][0]:.1f}")


if __name__ == "__main__":
    main()
