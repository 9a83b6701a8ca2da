"""``mlmt train-joint``: the hierarchical RL loop.

Each round runs three named steps with the current solver and writer:

  collect  one snapshot of episodes (the writer's training data; parent = last round's)
  upper    offline strategic Q-learning + AWR on this round's snapshot and the replay window
  lower    ``joint.lower_iterations`` online PPO iterations of the solver (each collects its
           own on-policy batch with the writer as it now is)

The run folder's ``manifest.json`` links rounds -> snapshots -> stage runs -> saved
policies and is rewritten atomically after every finished step; it is also the resume
state. On ``--resume`` the latest saved solver and writer are loaded and the first
unfinished step continues (train-upper and train-lower resume from their own
checkpoints), so nothing is lost or repeated.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml
from tosca_mlmt.pipelines.collect import collect
from tosca_mlmt.pipelines.train_lower import train_lower
from tosca_mlmt.pipelines.train_upper import train_upper

from tosca_mlmt import __version__, runtime
from tosca_mlmt.config import Config
from tosca_mlmt.engines import make_engine
from tosca_mlmt.errors import MlmtError
from tosca_mlmt.fsutil import atomic_dir
from tosca_mlmt.metrics import MetricsSink, StageTimer
from tosca_mlmt.models.policies import PolicyPair
from tosca_mlmt.train import distributed as dist

STEPS = ("collect", "upper", "lower")


@dataclass
class JointResult:
    run_dir: Path
    manifest: dict


def _write_json(path: Path, obj) -> None:
    if not dist.is_main():  # every rank keeps the same manifest in memory; rank 0 writes it
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def _round_dir(run: Path, r: int) -> Path:
    return run / "rounds" / f"{r:03d}"


def train_joint(cfg: Config, run_dir: str | Path, resume: bool = False, console=None,
                policies: PolicyPair | None = None, stop_after: tuple[int, str] | None = None) -> JointResult:
    """``stop_after=(round, step)`` returns right after that step finished, as a kill would
    (tests use it for the resume-equivalence check)."""
    runtime.setup(cfg)
    jc = cfg.joint
    run = Path(run_dir)
    man_path = run / "manifest.json"
    if man_path.exists() and not resume:
        raise MlmtError(f"{run} already holds a train-joint run; pass --resume or choose another --out")
    if man_path.exists():
        manifest = json.loads(man_path.read_text())
    else:
        manifest = {"stage": "train-joint", "tosca_mlmt_version": __version__, "git_sha": runtime.git_sha(),
                    "rounds": [], "solver": None, "writer": None}
    manifest = dist.broadcast(manifest)
    dist.barrier()  # every rank has read it before rank 0 writes
    if dist.is_main() and not man_path.exists():
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        _write_json(man_path, manifest)
    policies = policies or PolicyPair(cfg.model, seed=cfg.seed)
    if manifest["solver"]:
        policies.load_role("solver", run / manifest["solver"])
    if manifest["writer"]:
        policies.load_role("writer", run / manifest["writer"])
    engine = make_engine(cfg, policies)
    sink = MetricsSink(run, cfg.to_dict(), cfg.logging.wandb, cfg.logging.wandb_mode, cfg.logging.project,
                       name=run.name)
    snap_root = run / "snapshots"
    t_start = time.perf_counter() - manifest.get("seconds_used", 0.0)
    try:
        for r in range(jc.rounds):
            # rank 0's clock decides, or ranks could disagree and wait on each other forever
            over = dist.broadcast(bool(jc.max_seconds) and time.perf_counter() - t_start > jc.max_seconds)
            if over and r >= len(manifest["rounds"]):
                manifest["stopped_by_budget"] = r
                break
            if r >= len(manifest["rounds"]):
                manifest["rounds"].append({"round": r, "done": []})
            rec = manifest["rounds"][r]
            rdir = _round_dir(run, r)
            timer = StageTimer()
            for step in STEPS:
                if step in rec["done"]:
                    continue
                sync0 = getattr(engine, "sync_seconds", 0.0)
                with timer(step):
                    if step == "collect":
                        _collect(cfg, rec, manifest, snap_root, policies, engine, r, console)
                    elif step == "upper":
                        _upper(cfg, rec, manifest, run, rdir, snap_root, policies, console, r)
                    else:
                        _lower(cfg, rec, manifest, run, rdir, policies, engine, console, r)
                    # the rollout engine must serve what the trainers just produced (vLLM: a full
                    # state-dict reload; the writer's weights follow lazily on its next turn)
                    engine.sync_weights("solver")
                # every reload of the step (eager here, lazy inside generate) counts
                rec["sync_seconds"] = round(rec.get("sync_seconds", 0.0) + getattr(engine, "sync_seconds", 0.0) - sync0, 3)
                rec["done"].append(step)
                rec.setdefault("seconds", {})[step] = round(timer.seconds[step], 3)
                manifest["seconds_used"] = round(time.perf_counter() - t_start, 3)
                _write_json(man_path, manifest)
                sink.log({f"joint/time/{step}": timer.seconds[step], "joint/round": r,
                          **{f"joint/{k}": v for k, v in rec.get(f"{step}_metrics", {}).items()}}, step=r)
                if stop_after == (r, step):
                    return JointResult(run, manifest)
        if dist.is_main():
            _publish(run, manifest)
        _write_json(man_path, manifest)
        dist.barrier()
    finally:
        sink.close()
        engine.close()
    return JointResult(run, manifest)


def _collect(cfg, rec, manifest, snap_root, policies, engine, r, console) -> None:
    parents = [manifest["rounds"][r - 1]["snapshot"]] if r > 0 else []
    ccfg = replace(cfg, seed=cfg.seed + 1000 * r,
                   collect=replace(cfg.collect, out=str(snap_root), parents=parents),
                   logging=replace(cfg.logging, wandb=False))
    from tosca_mlmt.pipelines.train_lower import iteration_indices

    from tosca_mlmt.tasks import make_task

    pool = make_task(cfg.task).load(cfg.task.split, cfg.task.limit or None, cfg.task.skip_bad_rows).problems
    # round r takes the next slice of a seeded walk over the pool, so rounds see different problems
    chosen = [pool[i] for i in iteration_indices(len(pool), cfg.joint.collect_problems, r, cfg.seed)]
    res = collect(ccfg, policies=policies, engine=engine, console=console, problems=chosen)
    rec["snapshot"] = res.snapshot_id
    rec["collect_metrics"] = {k: res.summary[k] for k in ("acc_t1", "acc_final", "delta", "wrong_to_right",
                                                          "right_to_wrong") if k in res.summary}


def _upper(cfg, rec, manifest, run, rdir, snap_root, policies, console, r) -> None:
    jc = cfg.joint
    if jc.freeze_writer or r % jc.upper_every != 0:
        rec["upper"] = None
        return
    window = [x["snapshot"] for x in manifest["rounds"][max(0, r - jc.replay_window + 1): r + 1]]
    ucfg = replace(cfg, upper=replace(cfg.upper, snapshots=window, snapshot_root=str(snap_root), steps=jc.upper_steps),
                   logging=replace(cfg.logging, wandb=False))
    out = rdir / "upper"
    res = train_upper(ucfg, out, resume=out.exists(), policies=policies, console=console)
    rec["upper"] = str(out.relative_to(run))
    rec["upper_snapshots"] = window
    manifest["writer"] = str(res.writer_dir.relative_to(run))
    rec["upper_metrics"] = {k: v for k, v in res.metrics.items() if isinstance(v, (int, float))}


def _lower(cfg, rec, manifest, run, rdir, policies, engine, console, r) -> None:
    if cfg.joint.freeze_solver:
        rec["lower"] = None
        return
    lcfg = replace(cfg, seed=cfg.seed + 1000 * r + 1, lower=replace(cfg.lower, iterations=cfg.joint.lower_iterations),
                   logging=replace(cfg.logging, wandb=False))
    out = rdir / "lower"
    prev = next((x["lower"] for x in reversed(manifest["rounds"][:r]) if x.get("lower")), None)
    prev_ck = None
    if prev:
        latest = run / prev / "checkpoints" / "latest"
        prev_ck = run / prev / "checkpoints" / latest.read_text().strip() if latest.exists() else None
    res = train_lower(lcfg, out, resume=(out / "config.yaml").exists(), policies=policies, engine=engine,
                      console=console, init_from=prev_ck)
    rec["lower"] = str(out.relative_to(run))
    rec["lower_snapshots"] = sorted(p.name for p in (out / "snapshots").iterdir()
                                    if p.is_dir() and not p.name.startswith(".")) if (out / "snapshots").exists() else []
    manifest["solver"] = str((out / "solver").relative_to(run))
    rec["lower_metrics"] = {k.split("/", 1)[1]: v for k, v in res.last_metrics.items()
                            if isinstance(v, (int, float)) and k.startswith("lower/")}


def _publish(run: Path, manifest: dict) -> None:
    """Copy the final policies to ``<run>/solver`` and ``<run>/writer`` (what eval --run loads)."""
    for role in ("solver", "writer"):
        src = manifest.get(role)
        if not src:
            continue
        with atomic_dir(run / role) as tmp:
            shutil.copytree(run / src, tmp, dirs_exist_ok=True)
        manifest[f"final_{role}"] = role
