"""``mlmt train-upper``: fit the feedback writer offline from logged snapshots.

Steps (each timed): load_snapshots -> build_dataset -> load_models -> restore -> train
(update / eval / checkpoint) -> save_writer -> report. No rollouts: every decision, reward
and feedback token comes from the snapshots, which are verified and recorded by id.

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
from tosca_mlmt.snapshot_index import full_ids, open_snapshot
from tosca_mlmt.train.checkpoint import CheckpointManager
from tosca_mlmt.upper.dataset import build_transitions, check_strategies
from tosca_mlmt.upper.learner import UpperLearner
from tosca_mlmt.upper.report import evaluate_q, preference_table, render_markdown
from tosca_mlmt.pipelines.provenance import now
from tosca_mlmt.pipelines.rundir import RunDir


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
    runtime.setup(cfg)
    uc = cfg.upper
    if not uc.snapshots:
        raise MlmtError("no snapshot to learn from: pass --snapshot ID (repeatable) or set upper.snapshots")
    # prefixes become full ids before anything records the config: a resume compares full ids
    cfg = replace(cfg, upper=replace(uc, snapshots=full_ids(_root(cfg), uc.snapshots)))
    uc = cfg.upper
    rd = RunDir(out, "train-upper", console)
    run_dir = rd.path
    timer = StageTimer()
    ckm = CheckpointManager(run_dir, keep=uc.keep_checkpoints)
    rd.check(cfg, resume, allow_drift)
    latest = ckm.latest() if resume else None  # verified; decided before the model loads

    with timer("load_snapshots"):
        snaps = _load_snapshots(cfg, verify)
    with timer("build_dataset"):
        strategies = check_strategies([s.manifest for s in snaps])
        transitions = build_transitions([(s.id, s.episodes()) for s in snaps], uc.reward, uc.break_penalty, uc.gamma,
                                        cfg.episode.leak_penalty)
        if not transitions:
            raise SnapshotError(f"snapshots {', '.join(uc.snapshots)} hold no feedback turns to learn from")
    with timer("load_models"):
        policies = policies or PolicyPair(cfg.model, seed=cfg.seed)
        if policies.strategies and [s["name"] for s in policies.strategies] != [s["name"] for s in strategies]:
            raise SnapshotError("the loaded writer (model.writer_adapter) was trained on a different strategy set "
                                "than the snapshots")
        learner = UpperLearner(cfg, policies, transitions, strategies, resuming=latest is not None)
    policies.describe("writer", stage="train-upper", config=cfg, snapshots=list(uc.snapshots))

    rd.claim(cfg)
    prov = _provenance(rd, cfg, snaps, policies, transitions, strategies)
    with timer("restore"):
        if latest is not None:
            state = ckm.load_state(latest)  # also restores python/numpy/torch RNG
            learner.load(latest, state["step"])
            prov = rd.read_json("provenance.json") or prov
            prov.setdefault("resumed_from", []).append(latest.name)
            rd.rewind_metrics(state.get("metrics_bytes"))
        elif resume:  # nothing was checkpointed: every logged step runs again
            rd.rewind_metrics(0)
    rd.write_json("provenance.json", prov)

    sink = rd.sink(cfg, tee=tee)
    rd.say(f"train-upper: {len(transitions)} decisions from {len(snaps)} snapshot(s), "
           f"{len(strategies)} strategies, q_source={uc.q_source}, conservatism={uc.conservatism}, "
           f"text={uc.text_loss}; steps {learner.step} -> {uc.steps}")
    progress = rd.progress(cfg)
    last_eval: dict = {}
    last_q = None  # Q of every logged state at the last evaluation (the report reuses it)
    try:
        with progress:
            bar = progress.add_task("steps", total=uc.steps, completed=learner.step)
            while learner.step < uc.steps:
                if stop_at is not None and learner.step >= stop_at:
                    return UpperResult(run_dir, None, learner.step, last_eval)
                with timer("update"):
                    m = learner.update()
                step = learner.step
                progress.update(bar, advance=1, description=f"td {m['td_loss']:.4f}")
                if step % uc.log_every == 0 or step == uc.steps:
                    sink.log({"upper/" + k: v for k, v in m.items()}, step=step)
                if step % uc.eval_every == 0 or step == uc.steps:
                    with timer("eval"):
                        last_q = learner.q_eval()
                        last_eval = evaluate_q(last_q, learner.eval_transitions, strategies, learner.policy)
                    sink.log({"upper/" + k: v for k, v in last_eval.items()}, step=step)
                if step % uc.save_every == 0 or step == uc.steps:
                    with timer("checkpoint"):
                        ckm.save(step, learner.save, {"snapshots": list(uc.snapshots), "stage": "upper",
                                                      "metrics_bytes": rd.metrics_bytes()})
        if last_q is None:
            last_q = learner.q_eval()  # resumed at the very end: nothing was evaluated in this process
            last_eval = evaluate_q(last_q, learner.eval_transitions, strategies, learner.policy)
        policies.describe("writer", eval={k: v for k, v in last_eval.items() if isinstance(v, (int, float))},
                          eval_source="off-policy evaluation on the training snapshots (see report.md)")
        with timer("save_writer"):
            writer_dir = learner.export_writer(run_dir / "writer")
        with timer("report"):
            table = preference_table(last_q, learner.eval_transitions, strategies, learner.policy)
            info = {"snapshots": list(uc.snapshots), "transitions": len(transitions),
                    "evaluated": len(learner.eval_transitions), "steps": learner.step,
                    "episodes": len({(t.snapshot_id, t.episode_id) for t in transitions}), "q_source": uc.q_source,
                    "conservatism": uc.conservatism, "selection": _collect_selection(cfg, len(transitions)),
                    "q_policy": cfg.episode.strategy_selection}
            rd.write_text("report.md", render_markdown(table, last_eval, info))
            rd.write_json("report.json", {"info": info, "ope": last_eval, "table": table})
        sink.log(timer.as_metrics("upper/time/"), step=learner.step)
        prov.update(finished_at=now(), final_step=learner.step, timings=timer.as_metrics(""),
                    writer=policies.fingerprint("writer"), final_eval=last_eval)
        rd.write_json("provenance.json", prov)
    finally:
        learner.close()
        rd.close()
    dist.barrier()
    return UpperResult(run_dir, writer_dir, learner.step, last_eval)


# ---------------------------------------------------------------------- helpers


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
    episode.min_q_decisions decisions (rollout/runner.py), uniformly before that."""
    e = cfg.episode
    if e.q_steers(decisions):
        return e.strategy_selection
    return (f"uniform (Q fitted on {decisions} decisions < episode.min_q_decisions={e.min_q_decisions}; "
            f"{e.strategy_selection} from then on)")
