"""Worker for tests/unit/train/test_distributed.py and benchmarks/speed/scaling.py, launched by ``torchrun``
(or plain python for one process): offline train-lower and/or train-upper on a fixed
snapshot through the real pipelines, then rank 0 dumps the trained tensors.

    python tests/dist_worker.py SPEC.json

SPEC: {"out", "snapshot_root", "snapshot", "stages": ["lower", "upper"], "overrides": {...},
       "lower_stop_after": int | null, "resume": bool}
or {"jobs": [SPEC, ...]}: the jobs one after another in the same processes, each on a PolicyPair of its own
(a launch costs every process its imports and the launcher's start, ~5-10 s of a 2-core CPU's time).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tosca_mlmt import runtime

runtime.process_env()  # as the CLI does: before torch loads

from safetensors.torch import save_file  # noqa: E402

from tosca_mlmt import parallel as dist  # noqa: E402
from tosca_mlmt.config import load_config  # noqa: E402
from tosca_mlmt.models.policies import PolicyPair  # noqa: E402
from tosca_mlmt.pipelines.train_lower import train_lower  # noqa: E402
from tosca_mlmt.pipelines.train_upper import train_upper  # noqa: E402


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    for job in spec.get("jobs", [spec]):
        run(job)


def run(spec: dict) -> None:
    out, root, sid = Path(spec["out"]), spec["snapshot_root"], spec["snapshot"]
    over = {"upper.snapshots": [sid], "upper.snapshot_root": root, **spec.get("overrides", {})}
    cfg = load_config(overrides=over)
    policies = PolicyPair(cfg.model, seed=cfg.seed)
    metrics = {}
    if "lower" in spec["stages"]:
        res = train_lower(cfg, out / "lower", snapshot_ids=[sid], snapshot_root=root, policies=policies,
                          resume=spec.get("resume", False), stop_after=spec.get("lower_stop_after"))
        metrics["lower"] = res.last_metrics
    if "upper" in spec["stages"]:
        res = train_upper(cfg, out / "upper", policies=policies, resume=spec.get("resume", False))
        metrics["upper"] = res.metrics
    tensors = {}  # every rank: reading partitioned (ZeRO-3) weights is a collective
    for role in ("solver", "writer"):
        tensors.update({f"{role}/{k}": v.detach().clone().contiguous() for k, v in policies.adapter_state(role).items()})
    if dist.is_main():
        save_file(tensors, out / "tensors.safetensors")
        (out / "worker.json").write_text(json.dumps({"world": dist.world(), "metrics": metrics}, default=str))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
