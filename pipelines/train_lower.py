"""``mlmt train-lower``: PPO for the solver, online or from snapshots.

Per iteration (each step timed): pick problems -> generate (episodes, scored) ->
snapshot -> old/ref log-probs, advantages, bonus, update (inside LowerLearner) ->
weight sync -> metrics -> checkpoint. The problems of iteration i are a pure function
of (seed, i), so a resumed run sees exactly the data the uninterrupted run would have.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tosca_mlmt import __version__, runtime
from tosca_mlmt import parallel as dist
from tosca_mlmt.config import Config
from tosca_mlmt.errors import MlmtError
from tosca_mlmt.lower.learner import LowerLearner
from tosca_mlmt.lower.trajectory import episode_to_trajectory
from tosca_mlmt.metrics import MetricsSink, StageTimer, summarize
from tosca_mlmt.models.policies import PolicyPair
from tosca_mlmt.rollout.engines import make_engine
from tosca_mlmt.rollout.runner import EpisodeRunner
from tosca_mlmt.snapshot import load_snapshot, write_snapshot
from tosca_mlmt.tasks import make_task
from tosca_mlmt.train.checkpoint import CheckpointManager
from tosca_mlmt.pipelines.rundir import (check_allow_drift, check_drift, check_writable, metrics_size,
                                         rewind_metrics, write_config)


@dataclass
class LowerResult:
    run_dir: Path
    iterations: int
    last_metrics: dict


def iteration_indices(n_pool: int, per_iter: int, iteration: int, seed: int) -> list[int]:
    """Problems for an iteration: walk a seeded permutation per epoch of the pool."""
    out = []
    pos = iteration * per_iter
    while len(out) < per_iter:
        epoch, offset = divmod(pos, n_pool)
        perm = np.random.default_rng([seed, 99, epoch]).permutation(n_pool)
        take = min(per_iter - len(out), n_pool - offset)
        out += perm[offset: offset + take].tolist()
        pos += take
    return out


def _init_run(run: Path, cfg: Config, resume: bool, allow_drift, extra: dict) -> None:
    """Refuse what cannot be continued before any model loads, then (re)write config.yaml."""
    check_writable(run)
    cfg_file = run / "config.yaml"
    if cfg_file.exists() and not resume:
        raise MlmtError(f"{run} already holds a run; pass --resume to continue it or choose another --out")
    if cfg_file.exists() and allow_drift is not None:
        check_drift(run, cfg, "train-lower", allow_drift)
        before = _read_run_json(run).get("snapshots", [])
        if before != extra["snapshots"]:
            raise MlmtError(f"--resume: --snapshot {' '.join(extra['snapshots']) or '(none: online)'} differs from "
                            f"the run's ({' '.join(before) or 'none: online'}); resume with the same snapshots")
    dist.barrier()  # every rank has checked before rank 0 writes
    write_config(run, cfg)
    if dist.is_main() and not (run / "run.json").exists():  # atomic: a resume reads its snapshot ids
        tmp = run / f".run.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"stage": "train-lower", "tosca_mlmt_version": __version__,
                                   "git_sha": runtime.git_sha(), **extra}, indent=2))
        os.replace(tmp, run / "run.json")


def _read_run_json(run: Path) -> dict:
    try:
        rec = json.loads((run / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def train_lower(cfg: Config, run_dir: str | Path, snapshot_ids: list[str] | None = None,
                snapshot_root: str | Path = "snapshots", resume: bool = False, console=None,
                policies: PolicyPair | None = None, engine=None, stop_after: int | None = None,
                init_from: Path | None = None, allow_drift=(), verify: bool = True) -> LowerResult:
    """``stop_after`` ends the process-equivalent of a crash after that many iterations
    (used by resume tests); checkpoints are written as usual up to then. ``init_from`` is a
    checkpoint whose value head and optimizer state a fresh run starts from (train-joint
    carries the solver's critic and Adam moments from round to round this way).
    ``allow_drift``: config fields that may differ from the run's on resume (checked by
    ``rundir.check_allow_drift``); None when the caller (train-joint) checked its own config.
    ``verify``: check each ``snapshot_ids`` snapshot's sizes, hashes and id before reading it."""
    runtime.setup(cfg)
    run = Path(run_dir)
    lo = cfg.lower
    if allow_drift is not None:
        allow_drift = check_allow_drift("train-lower", allow_drift)
    _init_run(run, cfg, resume, allow_drift, {"snapshots": snapshot_ids or []})
    timer = StageTimer()
    ck = CheckpointManager(run, keep=lo.keep_checkpoints)
    latest = ck.latest() if resume else None  # verified; decided before the model loads
    offline = None
    if snapshot_ids:  # read (and verified) before the model loads: a bad snapshot fails fast
        offline = _load_offline(snapshot_ids, snapshot_root, verify)
    with timer("load_models"):
        policies = policies or PolicyPair(cfg.model, seed=cfg.seed)
        trainer = LowerLearner(cfg, policies)
    policies.describe("solver", stage="train-lower", config=cfg, snapshots=list(snapshot_ids or []))
    start = 0
    if latest is not None:
        trainer.load(latest)
        state = CheckpointManager.load_state(latest)
        start = state["iteration"]
        rewind_metrics(run, state.get("metrics_bytes"))
    else:
        if resume:  # nothing was checkpointed: every logged iteration runs again
            rewind_metrics(run, 0)
        if init_from is not None:
            trainer.load_trainer_state(Path(init_from))
    task = make_task(cfg.task)
    if offline is not None:
        _warn_off_policy(offline, policies)
        offline = [e for _, eps in offline for e in eps]
    else:
        pool = task.load(cfg.task.split, cfg.task.limit or None, cfg.task.skip_bad_rows).problems
        engine = engine or make_engine(cfg, policies)
        runner = EpisodeRunner(cfg, task, engine, policies)
    sink = MetricsSink(run, cfg.to_dict(), cfg.logging.wandb, cfg.logging.wandb_mode, cfg.logging.project,
                       name=run.name)
    metrics: dict = {}
    done = start
    progress = Progress(TextColumn("[bold]train-lower[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), disable=not (cfg.logging.progress and dist.is_main()),
                        console=console)
    with progress:
        bar = progress.add_task("", total=lo.iterations, completed=start)
        for it in range(start, lo.iterations):
            it_timer = StageTimer()
            t0 = time.perf_counter()
            if offline is None:
                idx = iteration_indices(len(pool), lo.problems_per_iteration, it, cfg.seed)
                gen0, score0 = runner.gen_seconds, runner.gen_tokens
                sync0 = getattr(engine, "sync_seconds", 0.0)
                with it_timer("episodes"):
                    # each rank plays its share of the problems; every rank gets all episodes
                    mine = [pool[idx[i]] for i in dist.shard(len(idx))]
                    with policies.full_weights():  # ZeRO-3: ranks generate different amounts
                        local = runner.run(mine, batch_index=it) if mine else []
                    episodes = dist.gather_sharded(local, len(idx) * cfg.episode.n_samples)
                it_timer.seconds["generate"] = runner.gen_seconds - gen0
                it_timer.seconds["score"] = it_timer.seconds.pop("episodes") - it_timer.seconds["generate"]
                gen_tokens, sid = int(dist.all_sum({"t": runner.gen_tokens - score0})["t"]), None
                fp = policies.fingerprint("solver") if lo.keep_snapshots else None  # collective under ZeRO-3
                if lo.keep_snapshots and dist.is_main():
                    with it_timer("snapshot"):
                        sid, _ = write_snapshot(run / "snapshots", episodes, {
                            "kind": "train-lower-batch", "iteration": it, "config": cfg.to_dict(),
                            "models": {"solver": fp}, "parents": [],
                            "task": {"name": task.name, "split": cfg.task.split,
                                     "verifier_version": task.verifier_version,
                                     "problem_ids": [pool[i].id for i in idx]}})
            else:
                per = lo.problems_per_iteration * cfg.episode.n_samples
                episodes = [offline[(it * per + j) % len(offline)] for j in range(per)]
                gen_tokens, sid = 0, None
            trajs = [t for t in map(episode_to_trajectory, episodes) if t is not None]
            if len(trajs) < len(episodes):
                warnings.warn(f"{len(episodes) - len(trajs)} episodes had truncated prompts and were not trained on")
            upd = trainer.update(trajs, it, it_timer)
            with it_timer("weight_sync"):
                if offline is None:
                    engine.sync_weights("solver")
                    # every reload of the iteration, also those generate() made between roles
                    it_timer.seconds["engine_sync_total"] = getattr(engine, "sync_seconds", 0.0) - sync0
            summary = summarize(episodes)
            metrics = {f"lower/{k}": v for k, v in {**summary, **upd}.items()}
            for k in range(max(len(t.turn_rewards) for t in trajs)):
                metrics[f"lower/reward_turn{k}"] = float(np.mean([t.turn_rewards[k] for t in trajs if k < len(t.turn_rewards)]))
            wall = time.perf_counter() - t0
            metrics.update({f"lower/time/{k}": round(v, 4) for k, v in it_timer.seconds.items()})
            metrics.update({"lower/iteration": it + 1, "lower/gen_tokens_per_s": gen_tokens / max(it_timer.seconds.get("generate", 0), 1e-9),
                            "lower/train_tokens_per_s": upd["train_tokens"] / max(it_timer.seconds.get("update", 0), 1e-9),
                            "lower/iteration_seconds": wall, "lower/snapshot": sid})
            sink.log(metrics, step=it + 1)
            progress.update(bar, advance=1, description=f"acc_t1={summary['acc_t1']:.2f} acc_final={summary['acc_final']:.2f}")
            done = it + 1
            if done % lo.save_every == 0 or done == lo.iterations:
                with it_timer("checkpoint"):
                    ck.save(done, trainer.save, {"iteration": done, "stage": upd.get("stage", 0),
                                                 "optimizer_steps": trainer.optimizer_steps,
                                                 "metrics_bytes": metrics_size(run)})
            if stop_after is not None and done >= stop_after:
                break
    if done == lo.iterations:
        _describe_final(policies, run, snapshot_ids, metrics, done)
        policies.save_role("solver", run / "solver")  # every rank: a collective under ZeRO-3
    trainer.close()
    sink.close()
    dist.barrier()
    return LowerResult(run, done, metrics)


def _describe_final(policies: PolicyPair, run: Path, snapshot_ids, metrics: dict, done: int) -> None:
    """The final solver's card: its source snapshots (online: the batches this run kept) and
    the last iteration's accuracies, labelled as what they are."""
    kept = sorted(p.name for p in (run / "snapshots").glob("snap-*")) if (run / "snapshots").is_dir() else []
    acc = {k: metrics[f"lower/{k}"] for k in ("acc_t1", "acc_final", "delta") if f"lower/{k}" in metrics}
    policies.describe("solver", snapshots=list(snapshot_ids or kept), eval=acc,
                      eval_source=f"the sampled training episodes of iteration {done} (not a held-out eval)")


def _load_offline(ids: list[str], root, verify: bool) -> list[tuple]:
    """(snapshot, episodes) per id."""
    out = []
    for sid in ids:
        snap = load_snapshot(root, sid, verify=verify)
        out.append((snap, snap.episodes()))
    if not any(eps for _, eps in out):
        raise MlmtError("the given snapshots hold no episodes")
    return out


def _warn_off_policy(offline: list[tuple], policies: PolicyPair) -> None:
    current = policies.fingerprint("solver")
    for snap, _ in offline:
        models = snap.manifest.get("models")
        fp = models.get("solver") if isinstance(models, dict) else None
        fp = fp if isinstance(fp, dict) else {}
        if fp.get("adapter_sha") != current["adapter_sha"] or fp.get("base_sha") != current["base_sha"]:
            warnings.warn(f"snapshot {snap.id} was sampled by a different solver than the one being trained: "
                          "the data is off-policy (consider --set lower.old_logprobs=behaviour)", stacklevel=3)
