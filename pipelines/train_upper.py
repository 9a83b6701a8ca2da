"""``mlmt train-upper``: fit the feedback writer offline from logged snapshots.

Steps (each timed): load_snapshots -> build_dataset -> load_models -> restore -> train
(update / eval / checkpoint) -> save_writer -> report. No rollouts: every decision, reward
and feedback token comes from the snapshots, which are verified and recorded by id.

The stage has the shape of ``support/stage.py``: one iteration is one Q-learning step (the
log, eval and checkpoint cadences count steps), returned as an ``upper.stats.UpperStep``.

Run folder::

    <run>/config.yaml          the resolved config (rewritten on --resume)
    <run>/provenance.json      snapshot ids and manifests' key facts, models, code, timings
    <run>/metrics.jsonl        one record per log/eval (+ <run>/wandb/ when enabled)
    <run>/checkpoints/         atomic, resumable (adapter, heads, targets, optimizer, RNG)
    <run>/writer/              the trained writer: mlmt collect --set model.writer_adapter=<run>/writer
    <run>/report.md, .json     which strategies the writer prefers per task type
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from tosca_mlmt import runtime
from tosca_mlmt import parallel as dist
from tosca_mlmt.config import Config
from tosca_mlmt.errors import MlmtError, SnapshotError
from tosca_mlmt.metrics import StageTimer
from tosca_mlmt.models.policies import PolicyPair
from tosca_mlmt.store import full_ids, open_snapshot
from tosca_mlmt.train.checkpoint import CheckpointManager
from tosca_mlmt.upper.dataset import build_transitions, check_strategies
from tosca_mlmt.upper.learner import UpperLearner
from tosca_mlmt.upper.report import QEvaluation, render_markdown
from tosca_mlmt.upper.stats import UpperStep, eval_row, scalars, step_row
from tosca_mlmt.pipelines.support.provenance import now
from tosca_mlmt.pipelines.support.rundir import RunDir
from tosca_mlmt.pipelines.support.stage import drive


@dataclass
class UpperResult:
    run_dir: Path
    writer_dir: Path | None  # None when stopped early (stop_at)
    step: int
    metrics: dict


def train_upper(cfg: Config, out: str | Path, *, console=None, resume: bool = False, allow_drift=(),
                verify: bool = True, policies: PolicyPair | None = None, stop_at: int | None = None,
                tee=None) -> UpperResult:
    """Run the stage. ``policies`` is used as given (its writer adapter and Q head are the
    starting point and are replaced by the trained ones). ``stop_at`` ends the loop after
    that step without a final checkpoint, as a crash would (tests). ``allow_drift``: config
    fields that may differ from the run's on resume; None when the caller (train-joint)
    checked its own config. ``verify``: check every snapshot's sizes, hashes and id first.
    ``tee``: where each metrics record also goes (train-joint's timeline; see ``RunDir.sink``)."""
    return drive(UpperStage(cfg, out, console=console, resume=resume, allow_drift=allow_drift, verify=verify,
                            policies=policies, stop_at=stop_at, tee=tee))


class UpperStage:
    """train-upper's setup, Q-learning steps, logging, checkpoints and final artefacts."""

    def __init__(self, cfg: Config, out: str | Path, *, console, resume: bool, allow_drift, verify: bool,
                 policies: PolicyPair | None, stop_at: int | None, tee):
        self.cfg, self.out, self.console, self.tee = cfg, out, console, tee
        self.resume, self.allow_drift, self.verify = resume, allow_drift, verify
        self.policies, self.stop_at = policies, stop_at
        self.timer = StageTimer()
        self.last: QEvaluation | None = None  # the latest evaluation in this process (the report reuses it)
        self.running = False  # setup got to the loop: release() closes the learner and the folder
        self.finished = False  # close() wrote the writer and the report
        self.bar = None  # the progress bar's task while the steps run

    # ------------------------------------------------------------------ the stage's verbs
    def setup(self) -> tuple[int, int]:
        runtime.setup(self.cfg)
        self.cfg = cfg = _with_full_ids(self.cfg)
        self.rd = RunDir(self.out, "train-upper", self.console)
        self.ckm = CheckpointManager(self.rd.path, keep=cfg.upper.keep_checkpoints)
        self.rd.check(cfg, self.resume, self.allow_drift)
        latest = self.ckm.latest() if self.resume else None  # verified; decided before the model loads
        self._load_data()
        self._load_models(resuming=latest is not None)
        self.rd.claim(cfg)
        self._restore(latest)
        self._begin()
        steps = cfg.upper.steps
        return self.learner.step, steps if self.stop_at is None else min(steps, self.stop_at)

    def iteration(self, i: int) -> UpperStep:
        uc = self.cfg.upper
        with self.timer("update"):
            metrics = self.learner.update()
        step = self.learner.step
        if not _due(step, uc.eval_every, uc.steps):
            return UpperStep(step, metrics)
        with self.timer("eval"):
            self.last = self.learner.evaluate()
        return UpperStep(step, metrics, self.last)

    def log(self, i: int, record: UpperStep) -> None:
        uc = self.cfg.upper
        self.progress.update(self.bar, advance=1, description=f"td {record.metrics['td_loss']:.4f}")
        if _due(record.step, uc.log_every, uc.steps):
            self.sink.log(step_row(record), step=record.step)
        if record.evaluation is not None:
            self.sink.log(eval_row(record.evaluation), step=record.step)

    def save(self, i: int, record: UpperStep) -> None:
        uc = self.cfg.upper
        if _due(record.step, uc.save_every, uc.steps):
            with self.timer("checkpoint"):
                self.ckm.save(record.step, self.learner.save, {"snapshots": list(uc.snapshots), "stage": "upper",
                                                              "metrics_bytes": self.rd.metrics_bytes()})

    def close(self) -> UpperResult:
        self._end_progress()
        step = self.learner.step
        if step < self.cfg.upper.steps:  # stop_at: ended as a crash would, with no writer or report
            return UpperResult(self.rd.path, None, step, self.last.metrics if self.last is not None else {})
        ev = self.last if self.last is not None else self.learner.evaluate()  # resumed at the very end
        self.policies.describe("writer", eval=scalars(ev.metrics),
                               eval_source="off-policy evaluation on the training snapshots (see report.md)")
        with self.timer("save_writer"):
            writer_dir = self.learner.export_writer(self.rd.path / "writer")
        with self.timer("report"):
            self._report(ev)
        self.sink.log(self.timer.as_metrics("upper/time/"), step=step)
        self.prov.update(finished_at=now(), final_step=step, timings=self.timer.as_metrics(""),
                         writer=self.policies.fingerprint("writer"), final_eval=ev.metrics)
        self.rd.write_json("provenance.json", self.prov)
        self.finished = True
        return UpperResult(self.rd.path, writer_dir, step, ev.metrics)

    def release(self) -> None:
        if not self.running:  # a setup that failed early leaves the folder to the process's end, as it did
            return
        self._end_progress()
        self.learner.close()
        self.rd.close()
        if self.finished:
            dist.barrier()

    # ------------------------------------------------------------------ setup's parts
    def _load_data(self) -> None:
        cfg, uc = self.cfg, self.cfg.upper
        with self.timer("load_snapshots"):
            self.snaps = _load_snapshots(cfg, self.verify)
        with self.timer("build_dataset"):
            self.strategies = check_strategies([s.manifest for s in self.snaps])
            self.transitions = build_transitions([(s.id, s.episodes()) for s in self.snaps], uc.reward,
                                                 uc.break_penalty, uc.gamma, cfg.episode.leak_penalty)
            if not self.transitions:
                raise SnapshotError(f"snapshots {', '.join(uc.snapshots)} hold no feedback turns to learn from")

    def _load_models(self, resuming: bool) -> None:
        cfg = self.cfg
        with self.timer("load_models"):
            self.policies = policies = self.policies or PolicyPair(cfg.model, seed=cfg.seed)
            if policies.strategies and [s["name"] for s in policies.strategies] != [s["name"] for s in self.strategies]:
                raise SnapshotError("the loaded writer (model.writer_adapter) was trained on a different strategy "
                                    "set than the snapshots")
            self.learner = UpperLearner(cfg, policies, self.transitions, self.strategies, resuming=resuming)
        policies.describe("writer", stage="train-upper", config=cfg, snapshots=list(cfg.upper.snapshots))

    def _restore(self, latest: Path | None) -> None:
        rd = self.rd
        self.prov = _provenance(rd, self.cfg, self.snaps, self.policies, self.transitions, self.strategies)
        with self.timer("restore"):
            if latest is not None:
                state = self.ckm.load_state(latest)  # also restores python/numpy/torch RNG
                self.learner.load(latest, state["step"])
                self.prov = rd.read_json("provenance.json") or self.prov
                self.prov.setdefault("resumed_from", []).append(latest.name)
                rd.rewind_metrics(state.get("metrics_bytes"))
            elif self.resume:  # nothing was checkpointed: every logged step runs again
                rd.rewind_metrics(0)
        rd.write_json("provenance.json", self.prov)

    def _begin(self) -> None:
        cfg, uc = self.cfg, self.cfg.upper
        self.sink = self.rd.sink(cfg, tee=self.tee)
        self.rd.say(f"train-upper: {len(self.transitions)} decisions from {len(self.snaps)} snapshot(s), "
                    f"{len(self.strategies)} strategies, q_source={uc.q_source}, conservatism={uc.conservatism}, "
                    f"text={uc.text_loss}; steps {self.learner.step} -> {uc.steps}")
        self.progress = self.rd.progress(cfg)
        self.running = True
        self.progress.start()
        self.bar = self.progress.add_task("steps", total=uc.steps, completed=self.learner.step)

    def _end_progress(self) -> None:
        """Stop the bar once (a second stop prints a blank line on a plain console)."""
        if self.bar is not None:
            self.progress.stop()
            self.bar = None

    # ------------------------------------------------------------------ close's parts
    def _report(self, ev: QEvaluation) -> None:
        cfg, uc, transitions = self.cfg, self.cfg.upper, self.transitions
        table = self.learner.preferences(ev)
        info = {"snapshots": list(uc.snapshots), "transitions": len(transitions), "evaluated": len(ev.q),
                "steps": self.learner.step, "episodes": len({(t.snapshot_id, t.episode_id) for t in transitions}),
                "q_source": uc.q_source, "conservatism": uc.conservatism,
                "selection": _collect_selection(cfg, len(transitions)), "q_policy": cfg.episode.strategy_selection}
        self.rd.write_text("report.md", render_markdown(table, ev.metrics, info))
        self.rd.write_json("report.json", {"info": info, "ope": ev.metrics, "table": table})


# ---------------------------------------------------------------------- helpers


def _due(step: int, every: int, last: int) -> bool:
    """Whether a cadence (upper.log_every, eval_every, save_every) falls on ``step``; the last step always."""
    return step % every == 0 or step == last


def _with_full_ids(cfg: Config) -> Config:
    """The config with ``upper.snapshots`` as full ids: prefixes become full ids before anything
    records the config, since a resume compares full ids."""
    uc = cfg.upper
    if not uc.snapshots:
        raise MlmtError("no snapshot to learn from: pass --snapshot ID (repeatable) or set upper.snapshots")
    return replace(cfg, upper=replace(uc, snapshots=full_ids(_root(cfg), uc.snapshots)))


def _root(cfg: Config) -> str:
    return cfg.upper.snapshot_root or cfg.collect.out


def _load_snapshots(cfg: Config, verify: bool = True):
    return [open_snapshot(_root(cfg), sid, verify=verify) for sid in cfg.upper.snapshots]


def _provenance(rd: RunDir, cfg: Config, snaps, policies: PolicyPair, transitions, strategies) -> dict:
    return rd.provenance(
        kind="train-upper",
        snapshots=[{"id": s.id, "created_at": s.manifest.get("created_at"),
                    "task": s.manifest.get("task", {}).get("name"),
                    "rows": s.manifest.get("rows"), "models": s.manifest.get("models"),
                    "acc_t1": s.manifest.get("summary", {}).get("acc_t1"),
                    "acc_final": s.manifest.get("summary", {}).get("acc_final")} for s in snaps],
        parents=[s.id for s in snaps],
        decisions=len(transitions),
        strategies=strategies,
        models_at_start={"writer": policies.fingerprint("writer")},
        seeds={"seed": cfg.seed},
        deterministic=cfg.deterministic,
    )


def _collect_selection(cfg: Config, decisions: int) -> str:
    """How the next collect picks strategies with this writer: by Q only once Q was fitted on
    episode.min_q_decisions decisions (rollout/turns.py), uniformly before that."""
    e = cfg.episode
    if e.q_steers(decisions):
        return e.strategy_selection
    return (f"uniform (Q fitted on {decisions} decisions < episode.min_q_decisions={e.min_q_decisions}; "
            f"{e.strategy_selection} from then on)")
