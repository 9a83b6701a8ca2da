"""``mlmt train-joint``: the hierarchical RL loop.

Each round runs three named steps with the current solver and writer (four with
``joint.eval_problems``):

  collect  one snapshot of episodes (the writer's training data; parent = last round's; skipped
           when ``joint.freeze_writer``: nothing would learn from it)
  upper    offline strategic Q-learning + AWR on this round's snapshot and the replay window
  lower    ``joint.lower_iterations`` online PPO iterations of the solver (each collects its
           own on-policy batch with the writer as it now is)
  eval     (optional) greedy held-out eval with mlmt eval's protocol, logged as ``eval/*``

The run folder's ``manifest.json`` links rounds -> snapshots -> stage runs -> saved
policies and is rewritten atomically after every finished step; it is also the resume
state. On ``--resume`` the latest saved solver and writer are loaded and the first
unfinished step continues (train-upper and train-lower resume from their own
checkpoints), so nothing is lost or repeated.

Metrics: one timeline (``timeline.py``): the stages' records and a ``joint/*`` record per
finished step, each at the next global step of the joint run's ``metrics.jsonl`` and wandb run.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tosca_mlmt.pipelines.collect import collect
from tosca_mlmt.pipelines.rundir import RunDir
from tosca_mlmt.pipelines.timeline import RoundsBar, Timeline, round_line
from tosca_mlmt.pipelines.train_lower import train_lower
from tosca_mlmt.pipelines.train_upper import train_upper

from tosca_mlmt import runtime
from tosca_mlmt import parallel as dist
from tosca_mlmt.config import Config
from tosca_mlmt.errors import ConfigError, MlmtError
from tosca_mlmt.fsutil import atomic_dir
from tosca_mlmt.metrics import StageTimer
from tosca_mlmt.models.artefacts import repoint_base
from tosca_mlmt.models.policies import PolicyPair
from tosca_mlmt.rollout.engines import make_engine
from tosca_mlmt.train.checkpoint import CheckpointManager

STEPS = ("collect", "upper", "lower")


@dataclass
class JointResult:
    run_dir: Path
    manifest: dict


def _read_manifest(path: Path) -> dict | None:
    """The resume state; None when there is none yet (killed between config.yaml and it)."""
    if not path.exists():
        return None
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MlmtError(f"--resume: {path} unreadable ({e})") from None
    if not isinstance(m, dict) or not isinstance(m.get("rounds"), list):
        raise MlmtError(f"--resume: {path} is not a train-joint manifest")
    return m


def _round_dir(run: Path, r: int) -> Path:
    return run / "rounds" / f"{r:03d}"


def train_joint(cfg: Config, out: str | Path, *, console=None, resume: bool = False, allow_drift=(),
                policies: PolicyPair | None = None, stop_after: tuple[int, str] | None = None) -> JointResult:
    """``stop_after=(round, step)`` returns right after that step finished, as a kill would
    (tests use it for the resume-equivalence check). ``allow_drift``: config fields that may
    differ from the run's on resume (see ``rundir.SAFE_DRIFT``)."""
    runtime.setup(cfg)
    jc = cfg.joint
    _check_writer_warmup(cfg)
    rd = RunDir(out, "train-joint", console)
    run = rd.path
    manifest = _read_manifest(run / "manifest.json") if rd.check(cfg, resume, allow_drift) else None
    if manifest is None:
        manifest = rd.provenance(rounds=[], solver=None, writer=None, metrics_bytes=0, global_step=0)
    manifest = dist.broadcast(manifest)  # every rank has read it before claim lets rank 0 write
    rd.claim(cfg)
    if not (run / "manifest.json").exists():
        rd.write_json("manifest.json", manifest)
    # Lines logged after the manifest's last update belong to a step that runs again.
    rd.rewind_metrics(manifest.get("metrics_bytes"))
    policies = policies or PolicyPair(cfg.model, seed=cfg.seed)
    for role in ("solver", "writer"):  # the model cards of what the rounds save say whose step they were
        policies.describe(role, within="train-joint")
    if manifest["solver"]:
        policies.load_role("solver", run / manifest["solver"])
    if manifest["writer"]:
        policies.load_role("writer", run / manifest["writer"])
    engine = make_engine(cfg, policies)
    sink = rd.sink(cfg)
    # cut back with metrics.jsonl above; a run from before the timeline has no global_step, and its
    # records (step = round) number fewer than its lines, so counting them keeps the steps rising
    timeline = Timeline(sink, manifest.get("global_step", _lines(sink.path)))
    steps = STEPS + (("eval",) if jc.eval_problems else ())
    bar = RoundsBar(cfg, console, sum(set(steps) <= set(x["done"]) for x in manifest["rounds"]))
    snap_root = run / "snapshots"
    t_start = time.perf_counter() - manifest.get("seconds_used", 0.0)
    try:
        bar.__enter__()
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
            timeline.round = r
            timeline.on_record = lambda stage, k, r=r: bar.at(r, stage, k)
            for step in steps:
                if step in rec["done"]:
                    continue
                bar.at(r, step)
                sync0 = getattr(engine, "sync_seconds", 0.0)
                samples: list[dict] = []
                with timer(step):
                    if step == "collect":
                        samples = _collect(cfg, rec, manifest, snap_root, policies, engine, r, console)
                    elif step == "eval":
                        _eval(cfg, rec, run, policies, engine, console, r)
                    elif step == "upper":
                        _upper(cfg, rec, manifest, run, rdir, snap_root, policies, console, r, timeline.tee("upper"))
                    else:
                        samples = _lower(cfg, rec, manifest, run, rdir, policies, engine, console, r,
                                         timeline.tee("lower"))
                    # the rollout engine must serve what the trainers just produced (vLLM: a full
                    # state-dict reload; the writer's weights follow lazily on its next turn)
                    engine.sync_weights("solver")
                # every reload of the step (eager here, lazy inside generate) counts
                rec["sync_seconds"] = round(rec.get("sync_seconds", 0.0) + getattr(engine, "sync_seconds", 0.0) - sync0, 3)
                rec["done"].append(step)
                rec.setdefault("seconds", {})[step] = round(timer.seconds[step], 3)
                manifest["seconds_used"] = round(time.perf_counter() - t_start, 3)
                # the step's own numbers are in the timeline (lower/*, upper/* at their steps); the
                # collect batch's are here only, under joint/collect/ (not the PPO batch's acc_t1)
                timeline.log({f"joint/time/{step}": timer.seconds[step], "joint/round": r,
                              # the process's peak so far: the step where it rises set it
                              f"joint/peak_rss_gib/{step}": round(runtime.peak_rss_mb()["self"] / 1024, 2),
                              **{f"joint/{k}/{step}": v for k, v in runtime.peak_gpu_gib().items()},
                              **{f"joint/collect/{k}": v for k, v in rec.get("collect_metrics", {}).items()
                                 if step == "collect"},
                              **{f"eval/{k}": v for k, v in rec.get("eval_metrics", {}).items() if step == "eval"}})
                # the round's episodes (trackers only): collect's, and the last PPO batch's with its bonus
                sink.log_table("joint/samples" if step == "collect" else f"{step}/samples", samples, step=timeline.step)
                bar.done(r, step)
                if step == steps[-1]:
                    rd.say(round_line(r, jc.rounds, rec, sum(rec["seconds"].values())))
                manifest["metrics_bytes"] = dist.broadcast(rd.metrics_bytes())
                manifest["global_step"] = dist.broadcast(timeline.step)
                rd.write_json("manifest.json", manifest)
                if stop_after == (r, step):
                    return JointResult(run, manifest)
        if dist.is_main():
            _publish(run, manifest)
        rd.write_json("manifest.json", manifest)
        dist.barrier()
    finally:
        bar.__exit__(None, None, None)
        rd.close()
        engine.close()
    return JointResult(run, manifest)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _inner_logging(cfg):
    """The stages log to the joint run's trackers through its timeline, not to runs of their own, and
    show no bar of their own (rich shows one live display at a time: the joint's)."""
    return replace(cfg.logging, wandb=False, progress=False)


def _collect(cfg, rec, manifest, snap_root, policies, engine, r, console) -> list[dict]:
    """Runs the round's collect; returns its sample rows (samples.sample_rows) for the wandb table."""
    if cfg.joint.freeze_writer:
        # the round's snapshot is the writer's training data only: a frozen writer spends no episodes
        # on it (equal compute is counted in episodes; the solver's PPO batches collect their own)
        rec["snapshot"] = None
        return []
    prev = manifest["rounds"][r - 1].get("snapshot") if r > 0 else None
    parents = [prev] if prev else []
    ccfg = replace(cfg, seed=cfg.seed + 1000 * r,
                   collect=replace(cfg.collect, out=str(snap_root), parents=parents),
                   logging=_inner_logging(cfg))
    from tosca_mlmt.pipelines.train_lower import iteration_indices

    from tosca_mlmt.tasks import make_task

    pool = make_task(cfg.task).load(cfg.task.split, cfg.task.limit or None, cfg.task.skip_bad_rows).problems
    # round r takes the next slice of a seeded walk over the pool, so rounds see different problems
    chosen = [pool[i] for i in iteration_indices(len(pool), cfg.joint.collect_problems, r, cfg.seed)]
    res = collect(ccfg, console=console, policies=policies, engine=engine, problems=chosen)
    rec["snapshot"] = res.snapshot_id
    rec["collect_metrics"] = {k: res.summary[k] for k in ("acc_t1", "acc_final", "delta", "wrong_to_right",
                                                          "right_to_wrong", "leak_rate") if k in res.summary}
    # and where its seconds went (generation, scoring, named steps): the hierarchy's cost profile reads them
    rec["collect_metrics"].update({k: v for k, v in res.summary.items()
                                   if k in ("gen_seconds", "score_seconds") or k.startswith("time/")})
    return res.samples


def _eval(cfg, rec, run, policies, engine, console, r) -> None:
    """Round r's held-out eval: the first joint.eval_problems test problems under mlmt eval's
    protocol, with the policies as they are after the round's updates. Its snapshot lies under
    ``<run>/evals/``; its numbers go on the timeline as eval/*."""
    from tosca_mlmt.pipelines.evaluate import eval_config

    ecfg = eval_config(replace(cfg, task=replace(cfg.task, split="test", limit=cfg.joint.eval_problems),
                               logging=_inner_logging(cfg)))
    res = collect(ecfg, run / "evals", console=console, policies=policies, engine=engine)
    rec["eval_snapshot"] = res.snapshot_id
    rec["eval_metrics"] = {k: res.summary[k] for k in ("acc_t1", "acc_final", "delta", "wrong_to_right",
                                                       "right_to_wrong") if k in res.summary}


def _check_writer_warmup(cfg) -> None:
    """upper.warmup_steps counts the writer's steps over the whole run, or each update's with
    joint.writer_warmup=update (_upper): a writer that takes no more steps than that never trains
    the feedback text, only Q, so the run is refused."""
    jc, uc = cfg.joint, cfg.upper
    updates = len(range(0, jc.rounds, jc.upper_every))
    steps = 0 if jc.freeze_writer else (updates if jc.writer_warmup == "run" else 1) * jc.upper_steps
    if uc.text_loss != "none" and 0 < steps <= uc.warmup_steps:
        where = ("in all (joint.upper_steps x the rounds it updates in)" if jc.writer_warmup == "run"
                 else "per update (joint.writer_warmup=update restarts the warm-up in each)")
        raise ConfigError(f"invalid value {uc.warmup_steps} for field 'upper.warmup_steps': train-joint's writer "
                          f"takes {steps} steps {where}, all of them Q-only warm-up, so its feedback text never "
                          "trains; lower upper.warmup_steps or raise joint.upper_steps")


def _upper(cfg, rec, manifest, run, rdir, snap_root, policies, console, r, tee=None) -> None:
    jc = cfg.joint
    if jc.freeze_writer or r % jc.upper_every != 0:
        rec["upper"] = None
        return
    # joint.replay_window counts writer updates: every round's snapshot since the window's first
    # update is read, so with upper_every > 1 no round between two updates is collected for nothing
    first = 0 if jc.replay_window == 0 else max(0, r - jc.replay_window * jc.upper_every + 1)
    window = [x["snapshot"] for x in manifest["rounds"][first: r + 1] if x.get("snapshot")]
    # joint.writer_warmup=run: the Q head goes on from the last update, so its warm-up is the run's first
    # warmup_steps writer steps (a fresh count per round kept the text loss off in every round when
    # joint.upper_steps <= upper.warmup_steps); update: each update starts its own
    done = (jc.upper_steps * sum(1 for x in manifest["rounds"][:r] if x.get("upper"))
            if jc.writer_warmup == "run" else 0)
    ucfg = replace(cfg, upper=replace(cfg.upper, snapshots=window, snapshot_root=str(snap_root), steps=jc.upper_steps,
                                      warmup_steps=max(0, cfg.upper.warmup_steps - done)),
                   logging=_inner_logging(cfg))
    out = rdir / "upper"
    # allow_drift=None: this run's own config was checked against the joint config.yaml
    res = train_upper(ucfg, out, resume=out.exists(), policies=policies, console=console, allow_drift=None, tee=tee)
    rec["upper"] = str(out.relative_to(run))
    rec["upper_snapshots"] = window
    manifest["writer"] = str(res.writer_dir.relative_to(run))
    rec["upper_metrics"] = {k: v for k, v in res.metrics.items() if isinstance(v, (int, float))}


def _lower(cfg, rec, manifest, run, rdir, policies, engine, console, r, tee=None) -> list[dict]:
    """Runs the round's PPO iterations; returns the last batch's sample rows, bonus included."""
    if cfg.joint.freeze_solver:
        rec["lower"] = None
        return []
    lcfg = replace(cfg, seed=cfg.seed + 1000 * r + 1, lower=replace(cfg.lower, iterations=cfg.joint.lower_iterations),
                   logging=_inner_logging(cfg))
    out = rdir / "lower"
    prev = next((x["lower"] for x in reversed(manifest["rounds"][:r]) if x.get("lower")), None)
    prev_ck = CheckpointManager(run / prev).latest() if prev else None
    res = train_lower(lcfg, out, resume=(out / "config.yaml").exists(), policies=policies, engine=engine,
                      console=console, init_from=prev_ck, allow_drift=None, tee=tee)
    rec["lower"] = str(out.relative_to(run))
    rec["lower_snapshots"] = sorted(p.name for p in (out / "snapshots").iterdir()
                                    if p.is_dir() and not p.name.startswith(".")) if (out / "snapshots").exists() else []
    manifest["solver"] = str((out / "solver").relative_to(run))
    rec["lower_metrics"] = {k.split("/", 1)[1]: v for k, v in res.last_metrics.items()
                            if isinstance(v, (int, float)) and k.startswith("lower/")}
    return res.samples


def _publish(run: Path, manifest: dict) -> None:
    """Copy the final policies to ``<run>/solver`` and ``<run>/writer`` (what eval --run loads)."""
    for role in ("solver", "writer"):
        src = manifest.get(role)
        if not src:
            continue
        with atomic_dir(run / role) as tmp:
            shutil.copytree(run / src, tmp, dirs_exist_ok=True)
            repoint_base(tmp, run / src, run / role)  # a local base's relative path, from its new place
        manifest[f"final_{role}"] = role
