"""Collect with the writer on a base of its own (``model.writer``): the HF engine against vLLM's pair.

A writer on another base was HF-engine-only until vLLM got one engine per base
(rollout/engines/vllm/pair.py). This times ``mlmt collect`` (arith level 2, problems x samples,
one feedback round) for

* ``hf``: the HF engine with both bases;
* ``vllm-pair``: engine.name=vllm, which builds two vLLM engines;
* ``vllm-shared``: engine.name=vllm with the writer on the solver's own base (one engine), the
  reference for what the second engine costs.

By default the writer's base is a copy of the embedded model's folder: the same weights under
another path, so the pair has two engines while every setting decodes the same model, and the runs
compare engines, not models. Each run is its own ``mlmt collect`` process under ``/usr/bin/time``
(its peak RSS), the settings alternating over ``--rounds`` because the machine's load drifts.
tokens/s is generated tokens over the episodes stage (the collect's own ``time/episodes``).

    .venv/bin/python -m benchmarks.speed.two_bases --limit 64 --n-samples 4 --rounds 2

Writes ``benchmarks/results/two_bases/<date>_<variant>.json`` (VARIANT: problems x samples, settings; date, machine, load, commands, per-run numbers, medians).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import loadavg, machine_info, out_path

# problems x samples, the settings (where not all three), the writer's base (where given)
VARIANT = ("size", "settings", "writer")
SETTINGS = ("hf", "vllm-pair", "vllm-shared")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=64, help="problems")
    ap.add_argument("--n-samples", type=int, default=4, help="turn-1 samples per problem")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each setting, alternating")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of: {', '.join(SETTINGS)}")
    ap.add_argument("--writer", default="", help="the writer's base folder (default: a copy of the embedded model)")
    ap.add_argument("--threads", type=int, default=2, help="engine.threads")
    ap.add_argument("--out", default=None, help="result JSON (default: results/two_bases/<date>_<variant>.json)")
    return ap.parse_args(argv)


def run_collect(setting: str, writer: str, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "tosca_mlmt.cli.main", "collect", "--task", "arith", "--level", "2",
           "--limit", str(args.limit), "--n-samples", str(args.n_samples),
           "--engine", "hf" if setting == "hf" else "vllm", "--set", f"engine.threads={args.threads}",
           "--no-wandb", "--no-progress", "--out", str(out)]
    if setting != "vllm-shared":
        cmd += ["--set", f"model.writer={writer}"]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS=str(args.threads))
    res = subprocess.run(["/usr/bin/time", "-f", "peak_rss_kb %M", *cmd], capture_output=True, text=True, env=env,
                         timeout=7200)
    if res.returncode:
        sys.exit(f"{setting}: collect failed ({res.returncode}):\n{res.stderr[-3000:]}")
    rss_kb = int([ln for ln in res.stderr.splitlines() if ln.startswith("peak_rss_kb ")][-1].split()[1])
    man = json.loads(next(out.glob("snap-*/manifest.json")).read_text())
    s, t = man["summary"], man["timings"]
    return {"setting": setting, "gen_tokens": s["gen_tokens"], "episodes_seconds": t["episodes"],
            "tokens_per_s": round(s["gen_tokens"] / t["episodes"], 2), "start_engine_seconds": t.get("start_engine"),
            "load_models_seconds": t.get("load_models"), "peak_rss_gib": round(rss_kb / 2**20, 2),
            "acc_t1": s["acc_t1"], "acc_final": s["acc_final"], "load_after": loadavg(),
            "command": " ".join(cmd[1:])}


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        sys.exit(f"--settings: unknown {bad}; allowed: {', '.join(SETTINGS)}")
    if not Path("/usr/bin/time").exists():
        sys.exit("needs /usr/bin/time (Debian: apt-get install time) for each run's peak RSS")
    from tosca_mlmt.models.loading import resolve_model

    tmp = Path(tempfile.mkdtemp(prefix="two-bases-"))
    writer = args.writer
    if not writer:  # the same weights at another path: a base of its own as far as the pair can tell
        writer = str(tmp / "writer-base")
        shutil.copytree(resolve_model("smollm2-135m"), writer)
    load_before = loadavg()
    runs: list[dict] = []
    try:
        for r in range(args.rounds):
            for setting in (settings if r % 2 == 0 else settings[::-1]):
                runs.append(run_collect(setting, writer, args, tmp / f"{setting}-{r}"))
                x = runs[-1]
                print(f"{setting:<12} round {r}: {x['gen_tokens']} tokens in {x['episodes_seconds']:.1f} s "
                      f"({x['tokens_per_s']} tok/s), engine start {x['start_engine_seconds']} s, "
                      f"peak RSS {x['peak_rss_gib']} GiB", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {s: {k: float(np.median([x[k] for x in runs if x["setting"] == s]))
               for k in ("tokens_per_s", "start_engine_seconds", "peak_rss_gib")} for s in settings}
    ratios = {}
    if {"hf", "vllm-pair"} <= set(med):
        ratios["vllm-pair/hf"] = round(med["vllm-pair"]["tokens_per_s"] / med["hf"]["tokens_per_s"], 3)
    if {"vllm-shared", "vllm-pair"} <= set(med):
        ratios["vllm-pair/vllm-shared"] = round(med["vllm-pair"]["tokens_per_s"] / med["vllm-shared"]["tokens_per_s"], 3)
    for k, v in ratios.items():
        print(f"  {k} (median tokens/s): {v}")
    report = {"benchmark": "two_bases", "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
              "machine": machine_info() | {"load_before": load_before, "load_after": loadavg()},
              "args": vars(args), "writer_base": "copy of the embedded model" if not args.writer else args.writer,
              "runs": runs, "median": med, "ratios": ratios}
    out = out_path(args.out, "two_bases", VARIANT, size=f"{args.limit}x{args.n_samples}",
                   settings=None if settings == list(SETTINGS) else "-".join(settings),
                   writer=Path(args.writer).name if args.writer else None)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
