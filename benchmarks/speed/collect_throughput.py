"""Generated tokens/s of the three-turn collect loop vs raw single-turn vLLM generation.

In ONE process (one model load, one vLLM start-up) it measures:

* ``collect_<engine>``: ``tosca_mlmt.pipelines.collect.collect`` (solve -> feedback ->
  refine, K rounds) with the hf and/or vllm engine; tokens/s over the wall time of the
  episodes stage (generation + prompt building + verification) and over generate calls only;
* ``replay_vllm``: raw ``LLM.generate`` replaying the vLLM collect run's own calls, in order: the
  same prompt ids (turn 3 extends turn 1's), the same SamplingParams, the same engine, nothing
  between the calls (no prompt building, verification or bookkeeping). collect / replay is what
  the loop costs on top of vLLM doing the same work; tokens are vLLM's own (the loop counts the
  tokens its turns keep, which differ only by the forced eos after an answer line);
* ``stop_ab`` (``--stop-ab N``): the replay N times each with ``engine.vllm.stop_in_engine`` on and
  off, alternating, in the same process: what ending turns at their answer line inside vLLM saves;
* ``salt_ab`` (``--salt-ab N``, with ``--trained-adapters``): the collect run's calls N times each
  through the engine (syncs included) with the prefix cache kept across policy swaps, each policy's
  KV salted by its weights (VLLMEngine.requests, the default), and emptied at every swap that moves
  weights (what every sync did before): what a warm turn-1 prefix is worth to the refine;
* ``norm_ab`` (``--norm-ab N``): N rounds of the replay and a raw run with
  ``engine.vllm.cpu_norm_kernel`` on and off, alternating: what vLLM's C++ RMSNorm saves on each;
* ``prefill_probe`` (``--prefill-probe``): each of the collect run's calls prefilled alone
  (max_tokens=1: the prompt's forward and the first token's sampling, no decode step), timed, with
  the prefix cache as the loop had it before that call (each call's prompts + outputs are fed
  untimed afterwards, so the next call finds the blocks the loop left); what prefill costs per turn;
* ``continuous_ab`` (``--continuous-ab N``): N rounds of a whole collect with
  ``engine.vllm.continuous_episodes`` on (each episode's next turn joins the running batch as its
  last one ends: rollout/continuous.py) and off (one batched call per turn), and a raw run, the
  order alternating, on the same engine: the loop's tokens/s each way against raw single-turn;
* ``raw_vllm``: one flat ``LLM.generate`` call over the same turn-1 prompts with n samples,
  the same model, sampling and max_new_tokens. n is chosen from the collect run so the
  generated-token count roughly matches (the comparison is in tokens/s, so it need not be
  exact), or set by ``--raw-n`` (``--raw-n`` = ``--n-samples``: the loop's own batch). It runs before and after the vLLM collect run (``--raw-runs 2``) because the
  machine is shared and its load drifts.

It prints a table with collect/raw ratios and writes
``benchmarks/results/collect_throughput/<date>_<variant>.json`` (VARIANT: problems x samples, engines,
settings off their defaults, A/B modes; date, machine, load, config, token counts, seconds, a per-turn
breakdown, peak RSS).

    .venv/bin/python -m benchmarks.speed.collect_throughput --limit 16 --n-samples 2

``--trained-adapters S`` moves both LoRA adapters by S N(0, 1) (different draws) first, so solver
and writer serve different weights, as in every collect after the first training step.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.common import loadavg, machine_info, out_path, perturb

# problems x samples, engines (where not hf,vllm), settings off their defaults, the A/B modes that ran
VARIANT = ("size", "engines", "settings", "modes")



def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=16, help="problems (task.limit)")
    ap.add_argument("--n-samples", type=int, default=2, help="turn-1 samples per problem (episode.n_samples)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="solver max_new_tokens (turns 1 and 3, and raw)")
    ap.add_argument("--feedback-tokens", type=int, default=64, help="writer max tokens (episode.max_feedback_tokens)")
    ap.add_argument("--rounds", type=int, default=1, help="feedback+refine rounds K")
    ap.add_argument("--engines", default="hf,vllm", help="comma list of collect engines: hf, vllm")
    ap.add_argument("--task", default="arith")
    ap.add_argument("--level", type=int, default=2)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch/OMP threads for both engines (1 is fastest on a shared 2-core box)")
    ap.add_argument("--kv-cache-gb", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prefix-caching", default="on", choices=("on", "off"),
                    help="vLLM prefix caching (engine.vllm.enable_prefix_caching) for collect and raw runs")
    ap.add_argument("--block-size", type=int, default=0, help="engine.vllm.block_size (0 = vLLM's own)")
    ap.add_argument("--stop-in-engine", default="on", choices=("on", "off"),
                    help="engine.vllm.stop_in_engine: end solver turns at the answer line inside vLLM (on) or "
                         "decode on and cut afterwards (off)")
    ap.add_argument("--raw-n", type=int, default=0,
                    help="samples per prompt of the raw runs; 0 = as many as match the loop's token count (raw then "
                         "batches more sequences per call than any turn of the loop); --n-samples = the loop's batch")
    ap.add_argument("--raw-runs", type=int, default=2, help="raw vLLM runs, alternating around the vLLM collect")
    ap.add_argument("--stop-ab", type=int, default=0,
                    help="after the vLLM collect, replay its calls this many times with engine.vllm.stop_in_engine on "
                         "and off, alternating (on/off, off/on, ...): the stop's effect on seconds and decoded tokens")
    ap.add_argument("--trained-adapters", type=float, default=0.0,
                    help="move both adapters' LoRA B by this scale N(0, 1) first, so solver and writer differ "
                         "(0 = zero adapters: one weight set serves both, no swap)")
    ap.add_argument("--salt-ab", type=int, default=0,
                    help="rounds of the collect's calls with the prefix cache kept across swaps (salted) and "
                         "emptied at each swap, alternating; needs --trained-adapters")
    ap.add_argument("--norm-ab", type=int, default=0,
                    help="after the vLLM collect, this many rounds of the loop's replay and a raw run with "
                         "engine.vllm.cpu_norm_kernel on and off, alternating: the kernel's effect on each and on "
                         "their ratio")
    ap.add_argument("--prefill-probe", action="store_true",
                    help="after the vLLM collect, time each turn's prompts prefilled alone (max_tokens=1) with the "
                         "cache as the loop left it before that turn: what prefill costs per turn, and the loop's "
                         "ratio to raw if the feedback and refine prefills were free")
    ap.add_argument("--continuous", default="off", choices=("on", "off"),
                    help="engine.vllm.continuous_episodes for the recorded vLLM collect run; off (batched turns) is "
                         "what the replay, --stop-ab, --salt-ab, --norm-ab and --prefill-probe replay call by call")
    ap.add_argument("--continuous-ab", type=int, default=0,
                    help="after the vLLM collect, this many rounds of a collect with continuous episodes, one with "
                         "batched turns and a raw run, alternating: tokens/s of each and the loop/raw ratios")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="result JSON (default: results/collect_throughput/<date>_<variant>.json)")
    return ap.parse_args(argv)


class RecordingEngine:
    """Forwards to an engine and records every generate call (one per turn)."""

    KINDS = ("solve", "feedback", "refine")

    def __init__(self, engine):
        self._engine = engine
        self.calls: list[dict] = []
        self.replay: list[tuple[list[list[int]], object, str]] = []  # (prompts, params, policy) per call
        self.outputs: list[list[list[list[int]]]] = []  # per call, per prompt: each sample's ids

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, prompts, params, policy):
        from tosca_mlmt.rollout.engines.base import prefix_counts

        sync0 = getattr(self._engine, "sync_seconds", 0.0)
        hits0 = prefix_counts(self._engine)
        t0 = time.perf_counter()
        out = self._engine.generate(prompts, params, policy)
        secs = time.perf_counter() - t0
        hits1 = prefix_counts(self._engine)
        self.replay.append(([list(p) for p in prompts], params, policy))
        self.outputs.append([[list(g.token_ids) for g in gs] for gs in out])
        lens = [len(g.token_ids) for gs in out for g in gs]
        self.calls.append({
            "policy": policy, "prompts": len(prompts), "n": params.n, "sequences": len(lens),
            "prompt_tokens_mean": round(sum(map(len, prompts)) / max(len(prompts), 1), 1),
            "gen_tokens": sum(lens), "gen_tokens_mean": round(sum(lens) / max(len(lens), 1), 1),
            "gen_tokens_max": max(lens, default=0), "stopped": sum(g.finish_reason == "stop" for gs in out for g in gs),
            "seconds": round(secs, 3), "tokens_per_s": round(sum(lens) / max(secs, 1e-9), 1),
            "sync_seconds": round(getattr(self._engine, "sync_seconds", 0.0) - sync0, 3),
            # prompt tokens vLLM's prefix cache served this turn (hf: None)
            "cached_prompt_tokens": hits1[1] - hits0[1] if hits0 else None,
        })
        return out

    def per_turn(self, rounds: int) -> list[dict]:
        # EpisodeRunner calls per batch: solve, then (feedback, refine) x rounds.
        kinds = ["solve"] + ["feedback", "refine"] * rounds
        return [{"kind": kinds[i % len(kinds)], **c} for i, c in enumerate(self.calls)]




def variant(args, engines: list[str]) -> dict:
    """The result's variant (VARIANT's order): problems x samples, engines, the settings that differ from
    the defaults, the A/B modes that ran."""
    settings = [name for name, on in (("prefix-off", args.prefix_caching == "off"),
                                      (f"block{args.block_size}", args.block_size),
                                      ("stop-off", args.stop_in_engine == "off"),
                                      ("continuous", args.continuous == "on"),
                                      (args.dtype, args.dtype != "auto"),
                                      (f"threads{args.threads}", args.threads != 1),
                                      (f"rounds{args.rounds}", args.rounds != 1),
                                      (f"trained{args.trained_adapters:g}", args.trained_adapters),
                                      (f"raw-n{args.raw_n}", args.raw_n)) if on]
    modes = [name for name, on in (("stop-ab", args.stop_ab), ("salt-ab", args.salt_ab), ("norm-ab", args.norm_ab),
                                   ("prefill-probe", args.prefill_probe), ("continuous-ab", args.continuous_ab)) if on]
    return {"size": f"{args.limit}x{args.n_samples}",
            "engines": None if engines == ["hf", "vllm"] else "-".join(engines),
            "settings": "-".join(settings), "modes": "-".join(modes)}


def check_args(args) -> list[str]:
    """The engines to collect with; exits on flags that do not go together."""
    if args.continuous == "on" and (args.stop_ab or args.salt_ab or args.norm_ab or args.prefill_probe):
        sys.exit("--stop-ab, --salt-ab, --norm-ab and --prefill-probe replay the loop's per-turn calls: "
                 "use --continuous off (continuous episodes make none)")
    if args.salt_ab and not args.trained_adapters:
        sys.exit("--salt-ab needs --trained-adapters: with zero adapters no sync moves weights, so nothing is reset")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ("hf", "vllm")]
    if bad:
        sys.exit(f"--engines: unknown engine(s) {bad}; allowed: hf, vllm")
    return engines


def thread_env(threads: int) -> None:
    """Thread env must be in place before torch / vllm are imported."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


class Bench:
    """One process's run: the models, the task's turn-1 prompts, the engines and what each mode
    measured (``results``). Each mode of the module docstring is one method."""

    def __init__(self, args, engines: list[str]):
        self.args, self.engines = args, engines
        self.load_before = loadavg()
        self.t_start = time.time()
        self.results: dict[str, dict] = {}
        self.recorded: dict[str, RecordingEngine] = {}
        self.raw_runs: list[dict] = []
        self.vllm_info: dict = {}
        self.engine = None  # the vLLM engine, once started

    # ------------------------------------------------------------ set-up
    def load(self) -> None:
        """Configs, the policy pair (adapters moved with --trained-adapters) and the turn-1 prompts."""
        import torch

        from tosca_mlmt.config import load_config
        from tosca_mlmt.models.policies import PolicyPair
        from tosca_mlmt.prompts import ChatFormat
        from tosca_mlmt.tasks import make_task

        args = self.args
        torch.set_num_threads(args.threads)
        self.tmp = Path(tempfile.mkdtemp(prefix="collect-bench-"))
        overrides = {
            "seed": args.seed, "model.dtype": args.dtype, "engine.threads": args.threads,
            "engine.vllm.kv_cache_gb": args.kv_cache_gb, "engine.vllm.max_model_len": args.max_model_len,
            "engine.vllm.enable_prefix_caching": args.prefix_caching == "on", "engine.vllm.block_size": args.block_size,
            "engine.vllm.stop_in_engine": args.stop_in_engine == "on",
            "engine.vllm.continuous_episodes": args.continuous == "on",
            "task.name": args.task, "task.level": args.level, "task.limit": args.limit,
            "episode.n_samples": args.n_samples, "episode.rounds": args.rounds,
            "episode.max_feedback_tokens": args.feedback_tokens, "solver_sampling.max_new_tokens": args.max_new_tokens,
            "logging.wandb": False, "logging.progress": False, "collect.out": str(self.tmp / "snapshots"),
        }
        self.cfgs = {e: load_config(overrides=overrides | {"engine.name": e}) for e in ("hf", "vllm")}
        self.base_cfg = base_cfg = self.cfgs["hf"]

        t0 = time.perf_counter()
        self.policies = policies = PolicyPair(base_cfg.model, seed=base_cfg.seed)
        self.load_models_s = time.perf_counter() - t0
        if args.trained_adapters:
            for i, role in enumerate(("solver", "writer")):
                perturb(policies, role, args.trained_adapters, torch.Generator().manual_seed(args.seed + 100 + i))
            assert policies.adapter_key("solver") != policies.adapter_key("writer")
        print(f"models loaded in {self.load_models_s:.1f} s (dtype {policies.dtype})", flush=True)

        task = make_task(base_cfg.task)
        self.problems = task.load(base_cfg.task.split, base_cfg.task.limit or None).problems
        fmt = ChatFormat(policies.tokenizer("solver"), policies.eos_ids("solver"))
        self.p1 = [fmt.first_prompt(task.instruction(p)) for p in self.problems]

    # ------------------------------------------------------------ collect_<engine>
    def run_collect(self, name: str, engine) -> None:
        from tosca_mlmt.pipelines.collect import collect
        from tosca_mlmt.rollout.engines.base import hit_rate, prefix_counts

        args = self.args
        rec = self.recorded[name] = RecordingEngine(engine)
        if hasattr(engine, "llm"):
            engine.llm.reset_prefix_cache()  # no head start from the raw run's identical turn-1 prompts
        tokens0 = prefix_counts(engine)
        decoded0 = (engine.decoded_tokens, engine.kept_tokens) if hasattr(engine, "llm") else None
        t = time.perf_counter()
        res = collect(self.cfgs[name], policies=self.policies, engine=rec, log_dir=str(self.tmp / f"logs-{name}"))
        wall = time.perf_counter() - t
        s = res.summary
        ep_s = s["time/episodes"]  # wall time of the loop: generation + prompt building + scoring
        tokens = s["gen_tokens"]
        self.results[f"collect_{name}"] = {
            "gen_tokens": tokens, "episodes_seconds": round(ep_s, 3), "gen_seconds": s["gen_seconds"],
            "collect_call_seconds": round(wall, 3),
            "tokens_per_s": round(tokens / ep_s, 2), "tokens_per_s_gen_only": round(tokens / s["gen_seconds"], 2),
            "episodes": len(self.problems) * args.n_samples, "turn_calls": len(rec.calls),
            "weight_syncs": getattr(engine, "syncs", None), "weight_sync_seconds": s.get("weight_sync_seconds"),
            "sync_check_seconds": round(getattr(engine, "check_seconds", 0.0), 3),
            "score_seconds": s.get("score_seconds"), "turns": rec.per_turn(args.rounds),
            "prefix_hit_rate": hit_rate(tokens0, prefix_counts(engine)),
            # vLLM only: tokens it decoded vs those the turns kept (the rest came after an answer line)
            "engine_decoded_tokens": engine.decoded_tokens - decoded0[0] if decoded0 else None,
            "engine_kept_tokens": engine.kept_tokens - decoded0[1] if decoded0 else None,
            "load_after": loadavg(),
        }
        r = self.results[f"collect_{name}"]
        print(f"collect[{name}]: {tokens} tokens, episodes {ep_s:.1f} s ({r['tokens_per_s']} tok/s), "
              f"generate {s['gen_seconds']:.1f} s ({r['tokens_per_s_gen_only']} tok/s)", flush=True)

    def run_hf(self) -> None:
        """collect_hf. hf first: vLLM's in-process CPU worker disables torch.set_num_threads for the rest
        of the process."""
        from tosca_mlmt.rollout.engines.base import SamplingParams
        from tosca_mlmt.rollout.engines.hf import HFEngine

        hf = HFEngine(self.policies, batch_size=self.base_cfg.engine.batch_size)
        hf.generate(self.p1[:2], SamplingParams(max_new_tokens=4), "solver")  # warm-up
        self.run_collect("hf", hf)

    def start_vllm(self) -> None:
        from tosca_mlmt.rollout.engines.base import SamplingParams
        from tosca_mlmt.rollout.engines.vllm import VLLMEngine

        t = time.perf_counter()
        self.engine = VLLMEngine(self.policies, self.cfgs["vllm"].engine.vllm, seed=self.args.seed)
        self.vllm_info["startup_seconds"] = round(time.perf_counter() - t, 2)
        self.engine.generate(self.p1[:2], SamplingParams(max_new_tokens=4), "solver")  # warm-up
        print(f"vLLM started in {self.vllm_info['startup_seconds']} s", flush=True)

    # ------------------------------------------------------------ raw_vllm
    def run_raw(self, n_raw: int) -> dict:
        # Exactly the vLLM SamplingParams the engine uses for a solver turn, only with n_raw samples;
        # seeded by the baseline runs so far (the A/B rounds' runs are not among them).
        from tosca_mlmt.rollout.engines.base import SamplingParams

        args, engine, p1, s = self.args, self.engine, self.p1, self.base_cfg.solver_sampling
        sp = engine.sampling_params(SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            n=n_raw, seed=args.seed + len(self.raw_runs)), "solver")
        engine.sync_weights("solver")  # a trained writer may be loaded after a collect run
        engine.llm.reset_prefix_cache()  # no head start from earlier runs' cached prompts
        t = time.perf_counter()
        outs = engine.llm.generate(engine.requests(p1), sp, use_tqdm=False)
        secs = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        cached = sum(o.num_cached_tokens or 0 for o in outs) / max(sum(len(o.prompt_token_ids) for o in outs), 1)
        print(f"raw vLLM (n={n_raw}): {tokens} tokens in {secs:.1f} s ({tokens / secs:.1f} tok/s)", flush=True)
        return {"n": n_raw, "sequences": len(p1) * n_raw, "gen_tokens": tokens, "seconds": round(secs, 3),
                "tokens_per_s": round(tokens / secs, 2), "prefix_hit_rate": round(cached, 3), "load_after": loadavg()}

    def size_raw(self, ref: dict) -> int:
        # Match the collect run's token count: n = its tokens / (prompts x mean turn-1 length).
        solve_mean = max(ref["turns"][0]["gen_tokens_mean"], 1.0)
        return max(1, round(ref["gen_tokens"] / (len(self.p1) * solve_mean)))

    # ------------------------------------------------------------ replay_vllm
    def replay(self, rec: RecordingEngine) -> dict:
        # the collect run's calls as bare LLM.generate calls, each under the weights it ran with (a
        # swap between trained policies is synced untimed); greedy n > 1 decodes once, as the engine does
        engine = self.engine
        engine.llm.reset_prefix_cache()  # the same cold start as the collect run
        turns = []
        for prompts, params, policy in rec.replay:
            engine.sync_weights(policy)
            sp = engine.sampling_params(replace(params, n=1) if params.greedy and params.n > 1 else params, policy)
            t = time.perf_counter()
            outs = engine.llm.generate(engine.requests(prompts), sp, use_tqdm=False,
                                       lora_request=engine.lora_request(policy))
            secs = time.perf_counter() - t
            toks = sum(len(c.token_ids) for o in outs for c in o.outputs)
            turns.append({"policy": policy, "gen_tokens": toks, "seconds": round(secs, 3),
                          "tokens_per_s": round(toks / secs, 1)})
        secs = sum(t["seconds"] for t in turns)
        tokens = sum(t["gen_tokens"] for t in turns)
        print(f"replay vLLM: {tokens} tokens in {secs:.1f} s ({tokens / secs:.1f} tok/s)", flush=True)
        return {"gen_tokens": tokens, "seconds": round(secs, 3), "tokens_per_s": round(tokens / secs, 2),
                "turns": turns, "load_after": loadavg()}

    # ------------------------------------------------------------ --stop-ab
    def stop_ab(self, rec: RecordingEngine, rounds: int) -> dict:
        engine = self.engine
        runs: dict[str, list] = {"on": [], "off": []}
        keep = engine.stop_in_engine
        for i in range(rounds):
            for flag in ((True, False) if i % 2 == 0 else (False, True)):
                engine.stop_in_engine = flag
                runs["on" if flag else "off"].append(self.replay(rec))
        engine.stop_in_engine = keep
        med = {k: float(np.median([r["seconds"] for r in v])) for k, v in runs.items()}
        out = {"rounds": rounds, "median_seconds": med, "off_over_on": round(med["off"] / med["on"], 3),
               "decoded_tokens": {k: v[0]["gen_tokens"] for k, v in runs.items()}, "runs": runs}
        print(f"stop_in_engine A/B over {rounds} rounds: median {med['on']:.1f} s on, {med['off']:.1f} s off "
              f"(off / on {out['off_over_on']}); decoded tokens {out['decoded_tokens']}", flush=True)
        return out

    # ------------------------------------------------------------ --salt-ab
    def salt_ab(self, rec: RecordingEngine, rounds: int) -> dict:
        from tosca_mlmt.rollout.engines.base import hit_rate, prefix_counts

        engine = self.engine

        def run(keep: bool) -> dict:
            engine.llm.reset_prefix_cache()
            tokens0, t0 = prefix_counts(engine), time.perf_counter()
            turns = []
            for prompts, params, policy in rec.replay:
                if not keep and engine.weights_key(policy) != engine.loaded_key:
                    engine.llm.reset_prefix_cache()  # what each sync that moved weights did before salting
                t = time.perf_counter()
                out = engine.generate(prompts, params, policy)
                secs = time.perf_counter() - t
                toks = sum(len(g.token_ids) for gs in out for g in gs)
                turns.append({"policy": policy, "gen_tokens": toks, "seconds": round(secs, 3),
                              "tokens_per_s": round(toks / secs, 1)})
            secs = time.perf_counter() - t0
            tokens = sum(t["gen_tokens"] for t in turns)
            return {"gen_tokens": tokens, "seconds": round(secs, 3), "tokens_per_s": round(tokens / secs, 2),
                    "prefix_hit_rate": hit_rate(tokens0, prefix_counts(engine)), "turns": turns, "load_after": loadavg()}

        runs: dict[str, list] = {"salted": [], "reset": []}
        for i in range(rounds):
            for keep in ((True, False) if i % 2 == 0 else (False, True)):
                runs["salted" if keep else "reset"].append(run(keep))
        med = {k: float(np.median([r["seconds"] for r in v])) for k, v in runs.items()}
        hits = {k: v[0]["prefix_hit_rate"] for k, v in runs.items()}
        out = {"rounds": rounds, "median_seconds": med, "reset_over_salted": round(med["reset"] / med["salted"], 3),
               "prefix_hit_rate": hits, "runs": runs}
        print(f"prefix cache across swaps, {rounds} rounds: median {med['salted']:.1f} s salted (hit rate "
              f"{hits['salted']}), {med['reset']:.1f} s reset at swaps (hit rate {hits['reset']}); "
              f"reset / salted {out['reset_over_salted']}", flush=True)
        return out

    # ------------------------------------------------------------ --norm-ab
    def norm_ab(self, rec: RecordingEngine, rounds: int, n_raw: int) -> dict:
        engine = self.engine
        runs: dict[str, list] = {"on": [], "off": []}
        for i in range(rounds):
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                routed = engine.route_norms(on)
                rep, raw = self.replay(rec), self.run_raw(n_raw)
                runs["on" if on else "off"].append({"norm_kernels": routed, "replay": rep, "raw": raw,
                                                    "replay_over_raw": round(rep["tokens_per_s"] / raw["tokens_per_s"], 3)})
        engine.route_norms(engine.cfg.cpu_norm_kernel)
        # tokens/s, not seconds: the two norms round differently, so bf16 samples (and their lengths) differ
        med = {k: {"replay_tokens_per_s": float(np.median([r["replay"]["tokens_per_s"] for r in v])),
                   "raw_tokens_per_s": float(np.median([r["raw"]["tokens_per_s"] for r in v])),
                   "replay_over_raw": float(np.median([r["replay_over_raw"] for r in v]))} for k, v in runs.items()}
        out = {"rounds": rounds, "median": med,
               "replay_on_over_off": round(med["on"]["replay_tokens_per_s"] / med["off"]["replay_tokens_per_s"], 3),
               "raw_on_over_off": round(med["on"]["raw_tokens_per_s"] / med["off"]["raw_tokens_per_s"], 3), "runs": runs}
        print(f"cpu_norm_kernel A/B over {rounds} rounds: replay {med['on']['replay_tokens_per_s']:.1f} tok/s on, "
              f"{med['off']['replay_tokens_per_s']:.1f} off ({out['replay_on_over_off']}x); raw "
              f"{med['on']['raw_tokens_per_s']:.1f} / {med['off']['raw_tokens_per_s']:.1f} tok/s "
              f"({out['raw_on_over_off']}x); replay / raw {med['on']['replay_over_raw']} on, "
              f"{med['off']['replay_over_raw']} off", flush=True)
        return out

    # ------------------------------------------------------------ --continuous-ab
    def continuous_ab(self, rounds: int, n_raw: int) -> dict:
        from tosca_mlmt.pipelines.collect import collect

        engine = self.engine

        def run(on: bool) -> dict:
            engine.continuous = on
            engine.llm.reset_prefix_cache()
            t = time.perf_counter()
            res = collect(self.cfgs["vllm"], policies=self.policies, engine=engine, log_dir=str(self.tmp / "logs-ab"))
            wall = time.perf_counter() - t
            s = res.summary
            return {"gen_tokens": s["gen_tokens"], "episodes_seconds": round(s["time/episodes"], 3),
                    "collect_call_seconds": round(wall, 3),
                    "tokens_per_s": round(s["gen_tokens"] / s["time/episodes"], 2), "acc_t1": s.get("acc_t1"),
                    "acc_final": s.get("acc_final"), "load_after": loadavg()}

        keep = engine.continuous
        runs: dict[str, list] = {"continuous": [], "batched": [], "raw": []}
        for i in range(rounds):
            order = ("continuous", "batched", "raw") if i % 2 == 0 else ("raw", "batched", "continuous")
            for name in order:
                r = self.run_raw(n_raw) if name == "raw" else run(name == "continuous")
                runs[name].append(r)
                print(f"  continuous A/B round {i}: {name} {r['tokens_per_s']} tok/s", flush=True)
        engine.continuous = keep
        med = {k: float(np.median([r["tokens_per_s"] for r in v])) for k, v in runs.items()}
        out = {"rounds": rounds, "median_tokens_per_s": med,
               "continuous_over_raw": round(med["continuous"] / med["raw"], 3),
               "batched_over_raw": round(med["batched"] / med["raw"], 3),
               "continuous_over_batched": round(med["continuous"] / med["batched"], 3),
               # per round, each loop against the raw run of the same round (load drifts between rounds)
               "paired_continuous_over_raw": [round(c["tokens_per_s"] / r["tokens_per_s"], 3)
                                              for c, r in zip(runs["continuous"], runs["raw"])],
               "runs": runs}
        print(f"continuous episodes A/B over {rounds} rounds (medians): continuous {med['continuous']:.1f}, "
              f"batched {med['batched']:.1f}, raw {med['raw']:.1f} tok/s; continuous / raw "
              f"{out['continuous_over_raw']}, batched / raw {out['batched_over_raw']}", flush=True)
        return out

    # ------------------------------------------------------------ --prefill-probe
    def prefill_probe(self, rec: RecordingEngine) -> dict:
        from vllm import SamplingParams as VSP

        engine = self.engine
        engine.llm.reset_prefix_cache()  # the collect run's cold start
        warm = VSP(max_tokens=1, temperature=0.0, detokenize=False)
        turns = []
        for (prompts, params, policy), outs, kind in zip(rec.replay, rec.outputs, rec.per_turn(self.args.rounds)):
            engine.sync_weights(policy)
            lora = engine.lora_request(policy)
            n = 1 if params.greedy else params.n  # greedy n > 1 decodes once, as the engine does
            one = VSP(n=n, max_tokens=1, temperature=1.0, detokenize=False)  # n > 1 must sample
            t = time.perf_counter()
            res = engine.llm.generate(engine.requests(prompts), one, use_tqdm=False, lora_request=lora)
            secs = time.perf_counter() - t
            # untimed: the turn's prompts + outputs, so the cache holds the full blocks the loop's did
            done = [p + o for p, os_ in zip(prompts, outs) for o in os_]
            engine.llm.generate(engine.requests(done), warm, use_tqdm=False,
                                lora_request=lora)
            # per prompt, as VLLMEngine counts: vLLM reports one cached count for a prompt's n samples,
            # which share its prefill
            tokens = sum(len(p) for p in prompts)
            cached = sum(o.num_cached_tokens or 0 for o in res)
            turns.append({"kind": kind["kind"], "policy": policy, "sequences": len(prompts) * n,
                          "prompt_tokens": tokens, "uncached_tokens": tokens - cached,
                          "seconds": round(secs, 3), "uncached_tokens_per_s": round((tokens - cached) / secs, 1)})
            print(f"prefill {kind['kind']:<9} {tokens - cached:>6} uncached of {tokens:>6} prompt tokens "
                  f"in {secs:5.1f} s ({(tokens - cached) / secs:.0f} tok/s)", flush=True)
        return {"turns": turns, "load_after": loadavg()}

    # ------------------------------------------------------------ the vLLM part, in order
    def run_vllm(self) -> None:
        """vLLM started; raw runs around the vLLM collect; the replay and the A/B modes asked for."""
        args, results = self.args, self.results
        self.start_vllm()
        n_raw = args.raw_n or (self.size_raw(results["collect_hf"]) if "collect_hf" in results else None)
        if "vllm" in self.engines:
            if n_raw is not None and args.raw_runs > 0:  # raw before and after the collect run
                self.raw_runs.append(self.run_raw(n_raw))
            self.run_collect("vllm", self.engine)
            rec = self.recorded["vllm"]
            n_raw = n_raw if n_raw is not None else self.size_raw(results["collect_vllm"])
            if args.continuous == "off":  # continuous episodes make no per-turn calls to replay
                results["replay_vllm"] = self.replay(rec)
            if args.stop_ab:
                results["stop_ab"] = self.stop_ab(rec, args.stop_ab)
            if args.salt_ab:
                results["salt_ab"] = self.salt_ab(rec, args.salt_ab)
            if args.norm_ab:
                results["norm_ab"] = self.norm_ab(rec, args.norm_ab, n_raw)
            if args.prefill_probe:
                results["prefill_probe"] = self.prefill_probe(rec)
            if args.continuous_ab:
                results["continuous_ab"] = self.continuous_ab(args.continuous_ab, n_raw)
        for _ in range(args.raw_runs - len(self.raw_runs)):
            self.raw_runs.append(self.run_raw(n_raw if n_raw is not None else 3 * args.n_samples))
        engine = self.engine
        self.vllm_info.update({"weight_syncs": engine.syncs, "weight_sync_seconds": round(engine.sync_seconds, 3),
                               "sync_check_seconds": round(engine.check_seconds, 3)})

    # ------------------------------------------------------------ pooling and ratios
    def pool_raw(self) -> None:
        if self.raw_runs:
            tok = sum(r["gen_tokens"] for r in self.raw_runs)
            secs = sum(r["seconds"] for r in self.raw_runs)
            self.results["raw_vllm"] = {"gen_tokens": tok, "seconds": round(secs, 3),
                                        "tokens_per_s": round(tok / secs, 2), "runs": self.raw_runs}

    def ratios(self) -> dict:
        results, ratios = self.results, {}
        if "raw_vllm" in results:
            raw = results["raw_vllm"]["tokens_per_s"]
            for e in self.engines:
                r = results.get(f"collect_{e}")
                if r:
                    ratios[f"collect_{e}/raw_vllm"] = round(r["tokens_per_s"] / raw, 3)
                    ratios[f"collect_{e}/raw_vllm (generate only)"] = round(r["tokens_per_s_gen_only"] / raw, 3)
        if "replay_vllm" in results and "collect_vllm" in results:
            rep = results["replay_vllm"]["tokens_per_s"]
            ratios["collect_vllm/replay_vllm"] = round(results["collect_vllm"]["tokens_per_s"] / rep, 3)
            ratios["collect_vllm/replay_vllm (generate only)"] = round(
                results["collect_vllm"]["tokens_per_s_gen_only"] / rep, 3)
        if "prefill_probe" in results and "raw_vllm" in results:
            # the loop with its later turns' prefill taken out: what is left to win outside prefill
            later = sum(t["seconds"] for t in results["prefill_probe"]["turns"] if t["kind"] != "solve")
            col = results["collect_vllm"]
            ratios["collect_vllm/raw_vllm without later turns' prefill"] = round(
                col["gen_tokens"] / (col["episodes_seconds"] - later) / results["raw_vllm"]["tokens_per_s"], 3)
        return ratios

    # ------------------------------------------------------------ report
    def print_report(self, ratios: dict, load_after: list[float]) -> None:
        from tosca_mlmt import runtime

        results = self.results
        print()
        print(f"{'run':<14}{'tokens':>9}{'seconds':>10}{'tok/s':>9}{'tok/s (gen only)':>18}")
        for name, r in results.items():
            if "gen_tokens" not in r:  # stop_ab, salt_ab, norm_ab, prefill_probe: printed when they ran
                continue
            secs = r.get("episodes_seconds", r.get("seconds"))
            print(f"{name:<14}{r['gen_tokens']:>9}{secs:>10.1f}{r['tokens_per_s']:>9.1f}"
                  f"{r.get('tokens_per_s_gen_only', r['tokens_per_s']):>18.1f}")
        for k, v in ratios.items():
            print(f"  {k}: {v:.3f}")
        for name in ("collect_hf", "collect_vllm"):
            if name in results:
                print(f"  {name} per turn (prefix hit rate {results[name]['prefix_hit_rate']}):")
                for t in results[name]["turns"]:
                    hit = "" if t["cached_prompt_tokens"] is None else f" ({t['cached_prompt_tokens']} cached)"
                    print(f"    {t['kind']:<9}{t['policy']:<7} seqs {t['sequences']:>4}  prompt {t['prompt_tokens_mean']:>6.0f}{hit}"
                          f"  gen {t['gen_tokens']:>6} (mean {t['gen_tokens_mean']:.0f}, max {t['gen_tokens_max']})"
                          f"  {t['seconds']:>7.1f} s  {t['tokens_per_s']:>6.1f} tok/s  sync {t['sync_seconds']:.2f} s")
        print(f"load average before {self.load_before} after {load_after}; peak RSS {runtime.peak_rss_mb()} MiB")

    def report(self, ratios: dict, load_after: list[float]) -> dict:
        from tosca_mlmt import runtime

        return {
            "benchmark": "collect_throughput",
            "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": machine_info() | {"load_before": self.load_before, "load_after": load_after},
            "args": vars(self.args),
            "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "VLLM_ENABLE_V1_MULTIPROCESSING",
                                                   "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")},
            "dtype": str(self.policies.dtype).replace("torch.", ""),
            "packages": runtime.package_versions(),
            "engines": self.engines,
            "config": self.base_cfg.to_dict(),  # engine.name differs per run (see "engines")
            "load_models_seconds": round(self.load_models_s, 2),
            "vllm": self.vllm_info,
            "results": self.results,
            "ratios": ratios,
            "target": {"collect_vllm/raw_vllm": 0.95},
            "total_seconds": round(time.time() - self.t_start, 1),
            # ru_maxrss of the whole run (hf and vLLM engines, in-process), MiB
            "peak_rss_mb": runtime.peak_rss_mb(),
        }

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    engines = check_args(args)
    thread_env(args.threads)
    bench = Bench(args, engines)
    bench.load()
    if "hf" in engines:
        bench.run_hf()
    if "vllm" in engines or args.raw_runs > 0:  # raw vLLM is the baseline of every ratio
        bench.run_vllm()
    bench.pool_raw()
    ratios = bench.ratios()
    load_after = loadavg()
    bench.print_report(ratios, load_after)
    out = out_path(args.out, "collect_throughput", VARIANT, **variant(args, engines))
    out.write_text(json.dumps(bench.report(ratios, load_after), indent=2, default=str) + "\n")
    print(f"wrote {out}")
    bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
