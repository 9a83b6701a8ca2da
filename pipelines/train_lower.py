"""``mlmt train-lower``: PPO for the solver, online or from snapshots.

Per iteration (each step timed): pick problems -> generate (episodes, scored) ->
old/ref log-probs, advantages, bonus, update (inside LowerLearner) -> snapshot (the batch,
each refine turn with its bonus) -> weight sync -> metrics -> checkpoint. The problems of
iteration i are a pure function of (seed, i), so a resumed run sees exactly the data the
uninterrupted run would have.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from tosca_mlmt import runtime
from tosca_mlmt import parallel as dist
from tosca_mlmt.config import Config
from tosca_mlmt.errors import ConfigError, MlmtError
from tosca_mlmt.lower.learner import LowerLearner
from tosca_mlmt.lower.stats import group_reward_stats, with_refine_bonus
from tosca_mlmt.lower.trajectory import episode_to_trajectory
from tosca_mlmt.metrics import StageTimer, summarize
from tosca_mlmt.models.policies import PolicyPair
from tosca_mlmt.rollout.engines import make_engine
from tosca_mlmt.rollout.engines.base import hit_rate, prefix_counts
from tosca_mlmt.rollout.runner import EpisodeRunner, first_samples
from tosca_mlmt.samples import sample_rows
from tosca_mlmt.seeds import stream
from tosca_mlmt.snapshot import write_snapshot
from tosca_mlmt.snapshot_index import full_ids, open_snapshot
from tosca_mlmt.tasks import make_task
from tosca_mlmt.train.checkpoint import CheckpointManager
from tosca_mlmt.pipelines.provenance import snapshot_manifest
from tosca_mlmt.pipelines.rundir import RunDir


@dataclass
class LowerResult:
    run_dir: Path
    iterations: int
    last_metrics: dict
    samples: list[dict] = field(default_factory=list)  # the last batch, readable, with its bonus (samples.sample_rows)


def iteration_indices(n_pool: int, per_iter: int, iteration: int, seed: int) -> list[int]:
    """Problems for an iteration: walk a seeded permutation per epoch of the pool."""
    out = []
    pos = iteration * per_iter
    while len(out) < per_iter:
        epoch, offset = divmod(pos, n_pool)
        perm = stream(seed, "problems", epoch).permutation(n_pool)
        take = min(per_iter - len(out), n_pool - offset)
        out += perm[offset: offset + take].tolist()
        pos += take
    return out


def _open_run(rd: RunDir, cfg: Config, resume: bool, allow_drift, snapshot_ids: list[str]) -> None:
    """Refuse what cannot be continued before any model loads: a resumed run must read the
    same snapshots (their ids are in run.json, not in the config)."""
    if rd.check(cfg, resume, allow_drift) and allow_drift is not None:
        before = rd.read_json("run.json").get("snapshots", [])
        if before != snapshot_ids:
            raise MlmtError(f"--resume: --snapshot {' '.join(snapshot_ids) or '(none: online)'} differs from "
                            f"the run's ({' '.join(before) or 'none: online'}); resume with the same snapshots")


def rollout_config(cfg: Config) -> Config:
    """The config train-lower's batches are played with: lower.strategy_temperature / strategy_epsilon,
    when set, replace the episode's in the writer's strategy choice (the rest is the episode's)."""
    lo, e = cfg.lower, cfg.episode
    return replace(cfg, episode=replace(
        e, strategy_temperature=e.strategy_temperature if lo.strategy_temperature == -1 else lo.strategy_temperature,
        epsilon=e.epsilon if lo.strategy_epsilon == -1 else lo.strategy_epsilon))


def train_lower(cfg: Config, out: str | Path, *, console=None, resume: bool = False, allow_drift=(),
                verify: bool = True, snapshot_ids: list[str] | None = None, snapshot_root: str | Path = "snapshots",
                policies: PolicyPair | None = None, engine=None, stop_after: int | None = None,
                init_from: Path | None = None, tee=None) -> LowerResult:
    """``stop_after`` ends the process-equivalent of a crash after that many iterations
    (used by resume tests); checkpoints are written as usual up to then. ``init_from`` is a
    checkpoint whose value head and optimizer state a fresh run starts from (train-joint
    carries the solver's critic and Adam moments from round to round this way).
    ``allow_drift``: config fields that may differ from the run's on resume; None when the
    caller (train-joint) checked its own config. ``verify``: check each ``snapshot_ids``
    snapshot's sizes, hashes and id before reading it. ``tee``: where each metrics record also
    goes (train-joint's timeline; see ``RunDir.sink``)."""
    started: list = []  # an engine started here is closed here, also when the run fails
    try:
        return _train_lower(cfg, out, console=console, resume=resume, allow_drift=allow_drift, verify=verify,
                            snapshot_ids=snapshot_ids, snapshot_root=snapshot_root, policies=policies,
                            engine=engine, stop_after=stop_after, init_from=init_from, tee=tee, started=started)
    finally:
        for e in started:
            e.close()


def _train_lower(cfg: Config, out, *, console, resume, allow_drift, verify, snapshot_ids, snapshot_root,
                 policies, engine, stop_after, init_from, tee, started: list) -> LowerResult:
    lo = cfg.lower
    if snapshot_ids and lo.bonus.scorer == "engine" and lo.bonus.coef > 0:
        raise ConfigError("lower.bonus.scorer=engine scores the bonus with the rollout engine, and training from "
                          "snapshots starts none; set lower.bonus.scorer=trainer")
    runtime.setup(cfg)
    rd = RunDir(out, "train-lower", console)
    run = rd.path
    # prefixes become full ids before run.json records them: a resume compares full ids
    snapshot_ids = full_ids(snapshot_root, snapshot_ids or [])
    _open_run(rd, cfg, resume, allow_drift, snapshot_ids)
    timer = StageTimer()
    ck = CheckpointManager(run, keep=lo.keep_checkpoints)
    latest = ck.latest() if resume else None  # verified; decided before the model loads
    offline = None
    if snapshot_ids:  # read (and verified) before the model loads: a bad snapshot fails fast
        offline = _load_offline(snapshot_ids, snapshot_root, verify)
    rd.claim(cfg)
    if not (run / "run.json").exists():  # a resume reads its snapshot ids
        rd.write_json("run.json", rd.provenance(snapshots=snapshot_ids))
    with timer("load_models"):
        policies = policies or PolicyPair(cfg.model, seed=cfg.seed)
        trainer = LowerLearner(cfg, policies)
    policies.describe("solver", stage="train-lower", config=cfg, snapshots=list(snapshot_ids or []))
    start = 0
    if latest is not None:
        trainer.load(latest)
        state = CheckpointManager.load_state(latest)
        start = state["iteration"]
        rd.rewind_metrics(state.get("metrics_bytes"))
    else:
        if resume:  # nothing was checkpointed: every logged iteration runs again
            rd.rewind_metrics(0)
        if init_from is not None:
            trainer.load_trainer_state(Path(init_from))
    task = make_task(cfg.task)
    if offline is not None:
        _warn_off_policy(offline, policies)
        offline = [e for _, eps in offline for e in eps]
    else:
        loaded = task.load(cfg.task.split, cfg.task.limit or None, cfg.task.skip_bad_rows)
        pool = loaded.problems
        if engine is None:
            engine = make_engine(cfg, policies)
            started.append(engine)
        runner = EpisodeRunner(rollout_config(cfg), task, engine, policies)
    sink = rd.sink(cfg, tee=tee)
    metrics: dict = {}
    done, last_batch = start, []
    progress = rd.progress(cfg)
    with progress:
        bar = progress.add_task("", total=lo.iterations, completed=start)
        for it in range(start, lo.iterations):
            it_timer = StageTimer()
            t0 = time.perf_counter()
            rollout_hits = None
            if offline is None:
                idx = iteration_indices(len(pool), lo.problems_per_iteration, it, cfg.seed)
                gen0, score0 = runner.gen_seconds, runner.gen_tokens
                sync0, cache0 = getattr(engine, "sync_seconds", 0.0), prefix_counts(engine)
                with it_timer("episodes"):
                    # each rank plays its share of the problems; every rank gets all episodes
                    share = dist.shard(len(idx))
                    mine = [pool[idx[i]] for i in share]
                    # sample numbers over the whole iteration: a problem drawn twice on two ranks keeps unique ids
                    firsts = first_samples([pool[i] for i in idx], cfg.episode.n_samples)
                    with policies.full_weights():  # ZeRO-3: ranks generate different amounts
                        local = runner.run(mine, batch_index=it, firsts=[firsts[i] for i in share]) if mine else []
                    episodes = dist.gather_sharded(local, len(idx) * cfg.episode.n_samples)
                rollout_hits = hit_rate(cache0, prefix_counts(engine))  # this rank's rollout, before the bonus scores
                it_timer.seconds["generate"] = runner.gen_seconds - gen0
                it_timer.seconds["score"] = it_timer.seconds.pop("episodes") - it_timer.seconds["generate"]
                gen_tokens, sid, manifest = int(dist.all_sum({"t": runner.gen_tokens - score0})["t"]), None, None
                if lo.keep_snapshots:
                    with it_timer("snapshot"):
                        # the same manifest as collect's, so train-upper can learn from these batches;
                        # taken before the update: the fingerprints are of the solver that sampled
                        manifest = snapshot_manifest(
                            "train-lower-batch", cfg, task=task, problems=[pool[i] for i in idx],
                            skipped_rows=loaded.skipped_rows, iteration=it, strategies=runner.strategies,
                            # every rank: fingerprints are collectives under ZeRO-3
                            models={r: policies.fingerprint(r) for r in ("solver", "writer")},
                            summary=summarize(episodes), timings=it_timer.as_metrics(""))
            else:
                per = lo.problems_per_iteration * cfg.episode.n_samples
                episodes = [offline[(it * per + j) % len(offline)] for j in range(per)]
                gen_tokens, sid, manifest = 0, None, None
            kept = [(i, t) for i, t in enumerate(map(episode_to_trajectory, episodes)) if t is not None]
            rows, trajs = [i for i, _ in kept], [t for _, t in kept]
            if not trajs:
                raise MlmtError(f"iteration {it + 1}: all {len(episodes)} episodes had a prompt cut to "
                                f"episode.max_prompt_tokens={cfg.episode.max_prompt_tokens}, so none can be trained on "
                                "(their log-probs are of another context); raise episode.max_prompt_tokens")
            if len(trajs) < len(episodes):
                warnings.warn(f"{len(episodes) - len(trajs)} episodes had truncated prompts and were not trained on")
            upd = trainer.update(trajs, it, it_timer, engine=engine if offline is None else None)
            if manifest is not None and dist.is_main():
                with it_timer("snapshot"):
                    # written after the update, so each refine turn carries the bonus it was trained with
                    last_batch = with_refine_bonus(episodes, rows, trainer.refine_bonus)
                    sid, _ = write_snapshot(run / "snapshots", last_batch, manifest.to_dict())
            with it_timer("weight_sync"):
                if offline is None:
                    engine.sync_weights("solver")
                    # every reload of the iteration, also those generate() made between roles
                    it_timer.seconds["engine_sync_total"] = getattr(engine, "sync_seconds", 0.0) - sync0
            summary = summarize(episodes)
            metrics = {f"lower/{k}": v for k, v in {**summary, **upd}.items()}
            metrics.update({f"lower/{k}": v for k, v in group_reward_stats(
                [sum(t.turn_rewards) for t in trajs], [t.problem_id for t in trajs]).items()})
            for k in range(max(len(t.turn_rewards) for t in trajs)):
                metrics[f"lower/reward_turn{k}"] = float(np.mean([t.turn_rewards[k] for t in trajs if k < len(t.turn_rewards)]))
            if rollout_hits is not None:  # vLLM: prompt tokens of the rollout its prefix cache served
                metrics["lower/prefix_hit_rate"] = rollout_hits
            if offline is None and getattr(engine, "sync_route", None):  # vLLM: how the post-update sync travelled
                metrics["lower/sync_route"] = engine.sync_route
            if cfg.task.reward:  # failed reward calls scored 0 (never fatal): how many, this batch
                metrics["lower/reward_errors"] = sum("reward_error" in t.info for e in episodes for t in e.turns)
            wall = time.perf_counter() - t0
            metrics.update({f"lower/time/{k}": round(v, 4) for k, v in it_timer.seconds.items()})
            metrics.update({"lower/iteration": it + 1, "lower/gen_tokens_per_s": gen_tokens / max(it_timer.seconds.get("generate", 0), 1e-9),
                            "lower/train_tokens_per_s": upd["train_tokens"] / max(it_timer.seconds.get("update", 0), 1e-9),
                            "lower/iteration_seconds": wall, "lower/snapshot": sid,
                            # the process's peak so far: where it rises, this iteration set it
                            "lower/peak_rss_gib": round(runtime.peak_rss_mb()["self"] / 1024, 2),
                            **{f"lower/{k}": v for k, v in runtime.peak_gpu_gib().items()}})
            sink.log(metrics, step=it + 1)
            progress.update(bar, advance=1, description=f"acc_t1={summary['acc_t1']:.2f} acc_final={summary['acc_final']:.2f}")
            done = it + 1
            if done % lo.save_every == 0 or done == lo.iterations:
                with it_timer("checkpoint"):
                    ck.save(done, trainer.save, {"iteration": done, "stage": upd.get("stage", 0),
                                                 "optimizer_steps": trainer.optimizer_steps,
                                                 "metrics_bytes": rd.metrics_bytes()})
            if stop_after is not None and done >= stop_after:
                break
    # the last batch's episodes with the bonus each refine was trained with (offline: no new batch)
    samples = sample_rows(last_batch) if last_batch else []
    sink.log_table("lower/samples", samples, step=done)
    if done == lo.iterations:
        _describe_final(policies, run, snapshot_ids, metrics, done, cfg.solver_sampling.temperature)
        policies.save_role("solver", run / "solver")  # every rank: a collective under ZeRO-3
    trainer.close()
    rd.close()
    dist.barrier()
    return LowerResult(run, done, metrics, samples)


def _describe_final(policies: PolicyPair, run: Path, snapshot_ids, metrics: dict, done: int,
                    temperature: float) -> None:
    """The final solver's card: its source snapshots (online: the batches this run kept) and
    the last iteration's accuracies, labelled as what they are: a few sampled training episodes."""
    kept = sorted(p.name for p in (run / "snapshots").glob("snap-*")) if (run / "snapshots").is_dir() else []
    acc = {k: metrics[f"lower/{k}"] for k in ("acc_t1", "acc_final", "delta") if f"lower/{k}" in metrics}
    n = int(metrics.get("lower/episodes", 0))
    source = (f"the {n} episodes of iteration {done}, read from snapshots (sampled by the models that collected them)"
              if snapshot_ids else f"the {n} training episodes of iteration {done}, sampled at temperature {temperature:g}")
    policies.describe("solver", snapshots=list(snapshot_ids or kept), eval=acc,
                      eval_source=source + " (a training batch, not a held-out eval)")


def _load_offline(ids: list[str], root, verify: bool) -> list[tuple]:
    """(snapshot, episodes) per id."""
    out = []
    for sid in ids:
        snap = open_snapshot(root, sid, verify=verify)
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
