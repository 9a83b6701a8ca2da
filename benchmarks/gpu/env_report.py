"""The GPU check's two reports (benchmarks/gpu/check.sh).

    python benchmarks/gpu/env_report.py OUT.json            # the machine, and where the models land
    python benchmarks/gpu/env_report.py --runs DIR OUT.json # the numbers of the runs under DIR

The first loads the embedded pair the way every stage does (PolicyPair) and records the device of
each model's parameters and of one HF-engine generation, so a run that silently stayed on the CPU
shows here. The second reads every ``metrics.jsonl`` and snapshot ``manifest.json`` under DIR and
keeps the last row of each run's metrics (tokens/s, seconds per step, peak memory) and, per row, the
sync's route, seconds and the engine/trainer log-prob gap.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def environment() -> dict:
    import torch

    from tosca_mlmt import runtime
    from tosca_mlmt.config import load_config
    from tosca_mlmt.models.policies import PolicyPair
    from tosca_mlmt.parallel import compute_device
    from tosca_mlmt.rollout.engines.base import SamplingParams
    from tosca_mlmt.rollout.engines.hf import HFEngine

    cuda = torch.cuda.is_available()
    out = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": cuda, "gpu": torch.cuda.get_device_name(0) if cuda else None,
           "bf16_supported": bool(cuda and torch.cuda.is_bf16_supported()), "compute_device": str(compute_device()),
           "packages": runtime.package_versions(), "git_sha": runtime.git_sha()}
    cfg = load_config()
    t0 = time.perf_counter()
    pair = PolicyPair(cfg.model, seed=0)
    out["load_seconds"] = round(time.perf_counter() - t0, 1)
    out["model_dtype"] = str(pair.dtype)
    out["param_devices"] = {r: sorted({str(p.device) for p in pair.model(r).parameters()}) for r in ("solver", "writer")}
    tok = pair.tokenizer("solver")
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True,
                                   tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    t0 = time.perf_counter()
    gen = HFEngine(pair).generate([prompt], SamplingParams(n=2, max_new_tokens=32, temperature=0.7, seed=0), "solver")
    out["generate_seconds"] = round(time.perf_counter() - t0, 2)
    out["sample"] = tok.decode(gen[0][0].token_ids)
    out.update(runtime.peak_gpu_gib())
    return out


# read across iterations, not from the last row alone: a sync's health is iteration 2 against 1 (no sync yet)
PER_ROW = ("lower/sync_route", "lower/time/weight_sync", "lower/engine_logprob_gap_mean",
           "lower/engine_logprob_gap_max", "lower/engine_kl")


def runs(folder: Path) -> dict:
    found = {}
    for m in sorted(folder.rglob("metrics.jsonl")):
        rows = [json.loads(x) for x in m.read_text().splitlines() if x.strip()]
        if rows:
            run = found[str(m.parent.relative_to(folder))] = {"rows": len(rows), "last": rows[-1]}
            per_row = {k: [r.get(k) for r in rows] for k in PER_ROW if any(k in r for r in rows)}
            if per_row:
                run["per_row"] = per_row
    for m in sorted(folder.rglob("manifest.json")):
        d = json.loads(m.read_text())
        keep = {k: d[k] for k in ("metrics", "summary", "seconds", "git_sha", "environment") if k in d}
        if keep:
            found.setdefault(str(m.parent.relative_to(folder)), {})["manifest"] = keep
    return found


def main(argv: list[str]) -> int:
    if argv[:1] == ["--runs"]:
        report = runs(Path(argv[1]))
        out = Path(argv[2])
    else:
        report = environment()
        out = Path(argv[0])
    out.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, default=str)[:2000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
