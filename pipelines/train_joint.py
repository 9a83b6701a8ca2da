"""``mlmt train-joint``: the hierarchical RL loop.

Each round runs three named steps with the current solver and writer (four with
``joint.eval_problems``):

  collect  one snapshot of episodes (the writer's training data; parent = last round's; skipped
           when ``joint.freeze_writer``: nothing would learn from it)
  upper    offline strategic Q-learning + AWR on this round's snapshot and the replay window
  lower    ``joint.lower_iterations`` online PPO iterations of the solver (each collects its
           own on-policy batch with the writer as it now is)
  eval     (optional) greedy held-out eval with mlmt eval's protocol, logged as ``eval/*``

The stage has the shape of ``support/stage.py``: one iteration is one round, returned as a
``joint_stats.JointRound``.

The run folder's ``manifest.json`` links rounds -> snapshots -> stage runs -> saved
policies and is rewritten atomically after every finished step; it is also the resume
state. On ``--resume`` the latest saved solver and writer are loaded and the first
unfinished step continues (train-upper and train-lower resume from their own
checkpoints), so nothing is lost or repeated.

Metrics: one timeline (``support/timeline.py``): the stages' records and a ``joint/*`` record
per finished step, each at the next global step of the joint run's ``metrics.jsonl`` and wandb run.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tosca_mlmt.pipelines.collect import collect
from tosca_mlmt.pipelines.joint_stats import JointRound, JointStep, step_row
from tosca_mlmt.pipelines.support.rundir import RunDir
from tosca_mlmt.pipelines.support.stage import drive
from tosca_mlmt.pipelines.support.timeline import RoundsBar, Timeline, round_line
from tosca_mlmt.pipelines.train_lower import iteration_indices, train_lower
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
from tosca_mlmt.tasks import make_task
from tosca_mlmt.train.checkpoint import CheckpointManager
from tosca_mlmt.upper.stats import scalars

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
    differ from the run's on resume (see ``support/drift.py``'s ``SAFE_DRIFT``)."""
    return drive(JointStage(cfg, out, console=console, resume=resume, allow_drift=allow_drift, policies=policies,
                            stop_after=stop_after))


class JointStage:
    """train-joint's setup, rounds, per-step logging and manifest, and final policies.

    The manifest is the checkpoint and is written after every step inside a round (a kill
    mid-round resumes at the next step), so ``save`` has nothing left to write per round. A
    run ends early (joint.max_seconds, stop_after) inside a round; ``drive`` has no early exit,
    so the rounds after that end run nothing."""

    def __init__(self, cfg: Config, out: str | Path, *, console, resume: bool, allow_drift,
                 policies: PolicyPair | None, stop_after: tuple[int, str] | None):
        self.cfg, self.out, self.console = cfg, out, console
        self.resume, self.allow_drift, self.policies, self.stop_after = resume, allow_drift, policies, stop_after
        self.steps = STEPS + (("eval",) if cfg.joint.eval_problems else ())
        self.running = False  # setup got to the rounds: release() closes the bar, the folder, the engine
        self.ended = False  # the budget or stop_after ended the run: later rounds run nothing
        self.halted = False  # stop_after ended it: close() publishes nothing, as after a kill

    # ------------------------------------------------------------------ the stage's verbs
    def setup(self) -> tuple[int, int]:
        cfg = self.cfg
        runtime.setup(cfg)
        _check_writer_warmup(cfg)
        self.rd = RunDir(self.out, "train-joint", self.console)
        self.run = self.rd.path
        self.manifest = self._open_manifest()
        self._load_policies()
        self.engine = make_engine(cfg, self.policies)
        self.sink = self.rd.sink(cfg)
        # cut back with metrics.jsonl above; a run from before the timeline has no global_step, and its
        # records (step = round) number fewer than its lines, so counting them keeps the steps rising
        self.timeline = Timeline(self.sink, self.manifest.get("global_step", _lines(self.sink.path)))
        done = sum(set(self.steps) <= set(x["done"]) for x in self.manifest["rounds"])
        self.bar = RoundsBar(cfg, self.console, done)
        self.t_start = time.perf_counter() - self.manifest.get("seconds_used", 0.0)
        self.running = True
        self.bar.__enter__()
        return 0, cfg.joint.rounds

    def iteration(self, r: int) -> JointRound:
        if self.ended:
            return JointRound(r)
        if self._out_of_time(r):
            self.manifest["stopped_by_budget"] = r
            self.ended = True
            return JointRound(r, stopped_by_budget=True)
        entry = self._round_entry(r)
        timer = StageTimer()
        self.timeline.round = r
        self.timeline.on_record = lambda stage, k, r=r: self.bar.at(r, stage, k)
        ran = []
        for step in self.steps:
            if step in entry["done"]:
                continue
            ran.append(self._run_step(r, entry, step, timer))
            if self.stop_after == (r, step):
                self.ended = self.halted = True
                break
        return JointRound(r, tuple(ran), halted=self.halted)

    def log(self, r: int, record: JointRound) -> None:
        """Each step's row is on the timeline already (before the manifest that counts it); the
        round's headline line follows its last step."""
        if record.steps and record.steps[-1].name == self.steps[-1]:
            entry = self.manifest["rounds"][r]
            self.rd.say(round_line(r, self.cfg.joint.rounds, entry, sum(entry["seconds"].values())))

    def save(self, r: int, record: JointRound) -> None:
        """Nothing per round: the manifest was written after each of its steps (``_save_step``)."""

    def close(self) -> JointResult:
        if self.halted:
            return JointResult(self.run, self.manifest)
        if dist.is_main():
            _publish(self.run, self.manifest)
        self.rd.write_json("manifest.json", self.manifest)
        dist.barrier()
        return JointResult(self.run, self.manifest)

    def release(self) -> None:
        if not self.running:  # a setup that failed early leaves the folder to the process's end, as it did
            return
        self.bar.__exit__(None, None, None)
        self.rd.close()
        self.engine.close()

    # ------------------------------------------------------------------ setup's parts
    def _open_manifest(self) -> dict:
        """The resume state (a fresh one for a new run), read by every rank before claim lets rank
        0 write; metrics.jsonl cut back to it."""
        rd, run = self.rd, self.run
        manifest = _read_manifest(run / "manifest.json") if rd.check(self.cfg, self.resume, self.allow_drift) else None
        if manifest is None:
            manifest = rd.provenance(rounds=[], solver=None, writer=None, metrics_bytes=0, global_step=0)
        manifest = dist.broadcast(manifest)  # every rank has read it before claim lets rank 0 write
        rd.claim(self.cfg)
        if not (run / "manifest.json").exists():
            rd.write_json("manifest.json", manifest)
        # Lines logged after the manifest's last update belong to a step that runs again.
        rd.rewind_metrics(manifest.get("metrics_bytes"))
        return manifest

    def _load_policies(self) -> None:
        self.policies = policies = self.policies or PolicyPair(self.cfg.model, seed=self.cfg.seed)
        for role in ("solver", "writer"):  # the model cards of what the rounds save say whose step they were
            policies.describe(role, within="train-joint")
        for role in ("solver", "writer"):
            if self.manifest[role]:
                policies.load_role(role, self.run / self.manifest[role])

    # ------------------------------------------------------------------ a round's parts
    def _out_of_time(self, r: int) -> bool:
        """joint.max_seconds is spent and round ``r`` has not begun (a begun one finishes on resume)."""
        jc = self.cfg.joint
        # rank 0's clock decides, or ranks could disagree and wait on each other forever
        over = dist.broadcast(bool(jc.max_seconds) and time.perf_counter() - self.t_start > jc.max_seconds)
        return bool(over) and r >= len(self.manifest["rounds"])

    def _round_entry(self, r: int) -> dict:
        """Round ``r``'s record in the manifest (new when the round begins)."""
        rounds = self.manifest["rounds"]
        if r >= len(rounds):
            rounds.append({"round": r, "done": []})
        return rounds[r]

    def _run_step(self, r: int, entry: dict, step: str, timer: StageTimer) -> JointStep:
        """Run round ``r``'s ``step``, log its row and write the manifest that marks it done."""
        self.bar.at(r, step)
        sync0 = getattr(self.engine, "sync_seconds", 0.0)
        with timer(step):
            samples = self._step(r, entry, step)
            # the rollout engine must serve what the trainers just produced (vLLM: a full
            # state-dict reload; the writer's weights follow lazily on its next turn)
            self.engine.sync_weights("solver")
        # every reload of the step (eager here, lazy inside generate) counts
        sync1 = getattr(self.engine, "sync_seconds", 0.0)
        entry["sync_seconds"] = round(entry.get("sync_seconds", 0.0) + sync1 - sync0, 3)
        entry["done"].append(step)
        entry.setdefault("seconds", {})[step] = round(timer.seconds[step], 3)
        self.manifest["seconds_used"] = round(time.perf_counter() - self.t_start, 3)
        record = JointStep(step, timer.seconds[step], sync1 - sync0, round(runtime.peak_rss_mb()["self"] / 1024, 2),
                           runtime.peak_gpu_gib(), _own_metrics(entry, step))
        self._log_step(r, record, samples)
        self._save_step()
        return record

    def _step(self, r: int, entry: dict, step: str) -> list[dict]:
        """The step's work; returns the sample rows it logs as a table (collect's, the last PPO batch's)."""
        cfg, m, run, policies, engine, console = (self.cfg, self.manifest, self.run, self.policies, self.engine,
                                                  self.console)
        snap_root, rdir = run / "snapshots", _round_dir(run, r)
        if step == "collect":
            return _collect(cfg, entry, m, snap_root, policies, engine, r, console)
        if step == "eval":
            _eval(cfg, entry, run, policies, engine, console, r)
            return []
        if step == "upper":
            _upper(cfg, entry, m, run, rdir, snap_root, policies, console, r, self.timeline.tee("upper"))
            return []
        return _lower(cfg, entry, m, run, rdir, policies, engine, console, r, self.timeline.tee("lower"))

    def _log_step(self, r: int, record: JointStep, samples: list[dict]) -> None:
        # the step's own numbers are in the timeline (lower/*, upper/* at their steps); the
        # collect batch's are here only, under joint/collect/ (not the PPO batch's acc_t1)
        self.timeline.log(step_row(r, record))
        # the round's episodes (trackers only): collect's, and the last PPO batch's with its bonus
        name = record.name
        self.sink.log_table("joint/samples" if name == "collect" else f"{name}/samples", samples,
                            step=self.timeline.step)
        self.bar.done(r, name)

    def _save_step(self) -> None:
        """The manifest, with the metrics a resume keeps and the timeline's step, after a finished step."""
        self.manifest["metrics_bytes"] = dist.broadcast(self.rd.metrics_bytes())
        self.manifest["global_step"] = dist.broadcast(self.timeline.step)
        self.rd.write_json("manifest.json", self.manifest)


# ---------------------------------------------------------------------- the steps


def _own_metrics(entry: dict, step: str) -> dict:
    """A step's own numbers on its joint row, from the manifest's record of the round."""
    key = {"collect": "collect_metrics", "eval": "eval_metrics"}.get(step)
    return dict(entry.get(key, {})) if key else {}


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
    rec["upper_metrics"] = scalars(res.metrics)


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
