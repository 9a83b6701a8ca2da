"""``mlmt train-lower``: PPO for the solver, online or from snapshots.

Per iteration (each step timed): pick problems -> generate (episodes, scored) ->
old/ref log-probs, advantages, bonus, update (inside LowerLearner) -> snapshot (the batch,
each refine turn with its bonus) -> weight sync -> metrics -> checkpoint. The problems of
iteration i are a pure function of (seed, i), so a resumed run sees exactly the data the
uninterrupted run would have. ``LowerStage`` holds these steps in the stage shape
(pipelines/support/stage.py); each iteration returns a typed record (lower/stats.LowerIteration)
that the metrics row and the checkpoint are read from.
"""

from __future__ import annotations

import time
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

from tosca_mlmt import runtime
from tosca_mlmt import parallel as dist
from tosca_mlmt.config import Config
from tosca_mlmt.errors import ConfigError, MlmtError
from tosca_mlmt.lower.learner import LowerLearner
from tosca_mlmt.lower.stats import LowerIteration, UpdateStats, iteration_metrics, with_refine_bonus
from tosca_mlmt.lower.trajectory import episode_to_trajectory
from tosca_mlmt.metrics import StageTimer, summarize
from tosca_mlmt.models.policies import PolicyPair
from tosca_mlmt.rollout.engines import make_engine
from tosca_mlmt.rollout.engines.base import hit_rate, prefix_counts
from tosca_mlmt.rollout.runner import EpisodeRunner
from tosca_mlmt.rollout.turns import first_samples
from tosca_mlmt.samples import sample_rows
from tosca_mlmt.seeds import stream
from tosca_mlmt.store import full_ids, open_snapshot, write_snapshot
from tosca_mlmt.tasks import make_task
from tosca_mlmt.train.checkpoint import CheckpointManager
from tosca_mlmt.pipelines.support.provenance import snapshot_manifest
from tosca_mlmt.pipelines.support.rundir import RunDir
from tosca_mlmt.pipelines.support.stage import drive


@dataclass
class LowerResult:
    run_dir: Path
    iterations: int
    last_metrics: dict
    samples: list[dict] = field(default_factory=list)  # the last batch, readable, with its bonus (samples.sample_rows)


@dataclass(frozen=True)
class _Batch:
    """One iteration's episodes, and what playing them measured (online; from snapshots, nothing)."""

    episodes: list
    gen_tokens: int = 0  # over all ranks
    prefix_hit_rate: float | None = None  # this rank's rollout, before the bonus scores
    problems: list = field(default_factory=list)  # the problems played, in the manifest's order


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
    stage = LowerStage(cfg, out, console=console, resume=resume, allow_drift=allow_drift, verify=verify,
                       snapshot_ids=snapshot_ids, snapshot_root=snapshot_root, policies=policies, engine=engine,
                       init_from=init_from, tee=tee)
    return drive(stage, stop_after)


class LowerStage:
    """train-lower in the stage shape (pipelines/support/stage.py); ``train_lower`` documents the
    arguments. Online, each batch is played with ``engine`` (or one started here, and closed in
    ``release``); from snapshots, the iterations cycle through their episodes in order."""

    def __init__(self, cfg: Config, out: str | Path, *, console=None, resume: bool = False, allow_drift=(),
                 verify: bool = True, snapshot_ids: list[str] | None = None,
                 snapshot_root: str | Path = "snapshots", policies: PolicyPair | None = None, engine=None,
                 init_from: Path | None = None, tee=None):
        self.cfg, self.out, self.console, self.tee = cfg, out, console, tee
        self.resume, self.allow_drift, self.init_from = resume, allow_drift, init_from
        self.snapshot_ids, self.snapshot_root, self.verify = snapshot_ids, snapshot_root, verify
        self.policies, self.engine = policies, engine
        self.started: list = []  # an engine started here is closed here, also when the run fails
        self.offline: list | None = None  # from snapshots: all their episodes, in order
        self.last: LowerIteration | None = None  # the last iteration logged
        self.metrics: dict = {}  # its row
        self.done = 0
        self._display = ExitStack()  # the progress display: close or release stops it

    @property
    def online(self) -> bool:
        return self.offline is None

    def setup(self) -> tuple[int, int]:
        self._check_run()
        self.done = self._load_models()
        self._sources()
        self.sink = self.rd.sink(self.cfg, tee=self.tee)
        progress = self._display.enter_context(self.rd.progress(self.cfg))
        self.bar = progress.add_task("", total=self.cfg.lower.iterations, completed=self.done)
        self.progress = progress
        return self.done, self.cfg.lower.iterations

    def _check_run(self) -> None:
        """The run folder and its resume point, checked before any model loads."""
        cfg, lo = self.cfg, self.cfg.lower
        if self.snapshot_ids and lo.bonus.scorer == "engine" and lo.bonus.coef > 0:
            raise ConfigError("lower.bonus.scorer=engine scores the bonus with the rollout engine, and training from "
                              "snapshots starts none; set lower.bonus.scorer=trainer")
        runtime.setup(cfg)
        self.rd = rd = RunDir(self.out, "train-lower", self.console)
        # prefixes become full ids before run.json records them: a resume compares full ids
        self.snapshot_ids = full_ids(self.snapshot_root, self.snapshot_ids or [])
        _open_run(rd, cfg, self.resume, self.allow_drift, self.snapshot_ids)
        self.ck = CheckpointManager(rd.path, keep=lo.keep_checkpoints)
        self.latest = self.ck.latest() if self.resume else None  # verified; decided before the model loads
        self.snapshots = None
        if self.snapshot_ids:  # read (and verified) before the model loads: a bad snapshot fails fast
            self.snapshots = _load_offline(self.snapshot_ids, self.snapshot_root, self.verify)
        rd.claim(cfg)
        if not (rd.path / "run.json").exists():  # a resume reads its snapshot ids
            rd.write_json("run.json", rd.provenance(snapshots=self.snapshot_ids))

    def _load_models(self) -> int:
        """The models and the learner, at the resume point; returns the first iteration to run."""
        self.policies = self.policies or PolicyPair(self.cfg.model, seed=self.cfg.seed)
        self.trainer = LowerLearner(self.cfg, self.policies)
        self.policies.describe("solver", stage="train-lower", config=self.cfg, snapshots=list(self.snapshot_ids))
        if self.latest is not None:
            self.trainer.load(self.latest)
            state = CheckpointManager.load_state(self.latest)
            self.rd.rewind_metrics(state.get("metrics_bytes"))
            return state["iteration"]
        if self.resume:  # nothing was checkpointed: every logged iteration runs again
            self.rd.rewind_metrics(0)
        if self.init_from is not None:
            self.trainer.load_trainer_state(Path(self.init_from))
        return 0

    def _sources(self) -> None:
        """Where the batches come from: the snapshots' episodes, or the task's problems played online."""
        cfg = self.cfg
        self.task = make_task(cfg.task)
        if self.snapshots is not None:
            _warn_off_policy(self.snapshots, self.policies)
            self.offline = [g for _, eps in self.snapshots for g in problem_groups(eps)]
            self.snapshots = None
            return
        self.loaded = self.task.load(cfg.task.split, cfg.task.limit or None, cfg.task.skip_bad_rows)
        if self.engine is None:
            self.engine = make_engine(cfg, self.policies)
            self.started.append(self.engine)
        self.runner = EpisodeRunner(rollout_config(cfg), self.task, self.engine, self.policies,
                                     refines=cfg.lower.refine_samples)

    def iteration(self, i: int) -> LowerIteration:
        timer, t0 = StageTimer(), time.perf_counter()
        sync0 = getattr(self.engine, "sync_seconds", 0.0)
        batch = self._play(i, timer) if self.online else self._replay(i)
        summary = summarize(batch.episodes)
        manifest = self._manifest(i, batch, summary, timer) if self.online and self.cfg.lower.keep_snapshots else None
        rows, trajs = _trainable(batch.episodes, i, self.cfg)
        upd = self.trainer.update(trajs, i, timer, engine=self.engine if self.online else None)
        sid, kept = self._write_snapshot(batch.episodes, rows, upd, manifest, timer)
        with timer("weight_sync"):
            if self.online:
                self.engine.sync_weights("solver")
                # every reload of the iteration, also those generate() made between roles
                timer.seconds["engine_sync_total"] = getattr(self.engine, "sync_seconds", 0.0) - sync0
        return LowerIteration(
            step=i + 1, summary=summary, update=upd, turn_rewards=tuple(tuple(t.turn_rewards) for t in trajs),
            problem_ids=tuple(t.problem_id for t in trajs), seconds=timer.seconds,
            wall_seconds=time.perf_counter() - t0, gen_tokens=batch.gen_tokens, snapshot=sid, batch=kept,
            prefix_hit_rate=batch.prefix_hit_rate, **self._readings(batch.episodes),
            attempts=tuple(t.attempt for t in trajs) if any(t.branch is not None for t in trajs) else ())

    def _play(self, i: int, timer: StageTimer) -> _Batch:
        """Iteration ``i``'s problems, played: each rank plays its share, every rank gets all episodes."""
        cfg, runner, engine, pool = self.cfg, self.runner, self.engine, self.loaded.problems
        idx = iteration_indices(len(pool), cfg.lower.problems_per_iteration, i, cfg.seed)
        gen0, tokens0, cache0 = runner.gen_seconds, runner.gen_tokens, prefix_counts(engine)
        t0 = time.perf_counter()
        share = dist.shard(len(idx))
        mine = [pool[idx[j]] for j in share]
        # sample numbers over the whole iteration: a problem drawn twice on two ranks keeps unique ids
        firsts = first_samples([pool[j] for j in idx], cfg.episode.n_samples)
        with self.policies.full_weights():  # ZeRO-3: ranks generate different amounts
            local = runner.run(mine, batch_index=i, firsts=[firsts[j] for j in share]) if mine else []
        episodes = dist.gather_sharded(local, len(idx) * cfg.episode.n_samples * cfg.lower.refine_samples)
        played = time.perf_counter() - t0
        hits = hit_rate(cache0, prefix_counts(engine))
        # the episodes' time is the engine's generation and the rest, mostly the verifier's scoring
        generate = runner.gen_seconds - gen0
        timer.seconds.update(generate=generate, score=played - generate)
        gen_tokens = int(dist.all_sum({"t": runner.gen_tokens - tokens0})["t"])
        return _Batch(episodes, gen_tokens, hits, [pool[j] for j in idx])

    def _replay(self, i: int) -> _Batch:
        """Iteration ``i``'s episodes from the snapshots: its problems' whole groups, cycling in order."""
        return _Batch(replay_batch(self.offline, i, self.cfg.lower.problems_per_iteration))

    def _manifest(self, i: int, batch: _Batch, summary: dict, timer: StageTimer):
        """The batch snapshot's manifest: the same as collect's, so train-upper can learn from these
        batches; taken before the update, so the fingerprints are of the solver that sampled."""
        with timer("snapshot"):
            return snapshot_manifest(
                "train-lower-batch", self.cfg, task=self.task, problems=batch.problems,
                skipped_rows=self.loaded.skipped_rows, iteration=i, strategies=self.runner.strategies,
                # every rank: fingerprints are collectives under ZeRO-3
                models={r: self.policies.fingerprint(r) for r in ("solver", "writer")},
                summary=summary, timings=timer.as_metrics(""))

    def _write_snapshot(self, episodes: list, rows: list[int], upd: UpdateStats, manifest,
                        timer: StageTimer) -> tuple[str | None, tuple]:
        """(snapshot id, its episodes); written after the update, so each refine turn carries the
        bonus it was trained with. Rank 0 writes; (None, ()) elsewhere and without a manifest."""
        if manifest is None or not dist.is_main():
            return None, ()
        with timer("snapshot"):
            kept = with_refine_bonus(episodes, rows, upd.refine_bonus)
            sid, _ = write_snapshot(self.rd.path / "snapshots", kept, manifest.to_dict())
        return sid, tuple(kept)

    def _readings(self, episodes: list) -> dict:
        """What an iteration's record reads off the engine, the task and the process."""
        route = getattr(self.engine, "sync_route", None) if self.online else None
        errors = sum("reward_error" in t.info for e in episodes for t in e.turns) if self.cfg.task.reward else None
        return {"sync_route": route, "reward_errors": errors,
                "peak_rss_gib": round(runtime.peak_rss_mb()["self"] / 1024, 2), "peak_gpu_gib": runtime.peak_gpu_gib()}

    def log(self, i: int, record: LowerIteration) -> None:
        self.metrics = iteration_metrics(record)
        self.sink.log(self.metrics, step=record.step)
        acc = f"acc_t1={record.summary['acc_t1']:.2f} acc_final={record.summary['acc_final']:.2f}"
        self.progress.update(self.bar, advance=1, description=acc)
        self.last, self.done = record, record.step

    def save(self, i: int, record: LowerIteration) -> None:
        lo, done = self.cfg.lower, record.step
        if done % lo.save_every == 0 or done == lo.iterations:
            self.ck.save(done, self.trainer.save, {"iteration": done, "stage": record.update.stage,
                                                   "optimizer_steps": self.trainer.optimizer_steps,
                                                   "metrics_bytes": self.rd.metrics_bytes()})

    def close(self) -> LowerResult:
        self._display.close()
        # the last batch's episodes with the bonus each refine was trained with (offline: no new batch)
        samples = sample_rows(list(self.last.batch)) if self.last is not None and self.last.batch else []
        self.sink.log_table("lower/samples", samples, step=self.done)
        if self.done == self.cfg.lower.iterations:
            _describe_final(self.policies, self.rd.path, self.snapshot_ids, self.metrics, self.done,
                            self.cfg.solver_sampling.temperature)
            self.policies.save_role("solver", self.rd.path / "solver")  # every rank: a collective under ZeRO-3
        self.trainer.close()
        self.rd.close()
        dist.barrier()
        return LowerResult(self.rd.path, self.done, self.metrics, samples)

    def release(self) -> None:
        self._display.close()
        for e in self.started:
            e.close()


def problem_groups(episodes: list) -> list[list]:
    """A snapshot's episodes cut where the problem changes: one problem's turn-1 samples and, under refine
    groups, every branch of each attempt (adjacent, as the runner plays them). A replayed batch takes whole
    groups: a group split across two batches would give each half its own GRPO baseline and, under refine
    groups, train an attempt's shared turn 1 once in each batch (its first branch owns it in each)."""
    groups: list[list] = []
    for ep in episodes:
        if groups and groups[-1][-1].problem.id == ep.problem.id:
            groups[-1].append(ep)
        else:
            groups.append([ep])
    return groups


def replay_batch(groups: list[list], i: int, problems: int) -> list:
    """Iteration ``i``'s episodes: ``problems`` groups from ``problem_groups``, cycling through them."""
    return [ep for j in range(problems) for ep in groups[(i * problems + j) % len(groups)]]


def _trainable(episodes: list, it: int, cfg: Config) -> tuple[list[int], list]:
    """(index in ``episodes`` of each trajectory, the trajectories): an episode whose prompt was
    cut has none (its log-probs are of another context)."""
    kept = [(i, t) for i, t in enumerate(map(episode_to_trajectory, episodes)) if t is not None]
    if not kept:
        raise MlmtError(f"iteration {it + 1}: all {len(episodes)} episodes had a prompt cut to "
                        f"episode.max_prompt_tokens={cfg.episode.max_prompt_tokens}, so none can be trained on "
                        "(their log-probs are of another context); raise episode.max_prompt_tokens")
    if len(kept) < len(episodes):
        warnings.warn(f"{len(episodes) - len(kept)} episodes had truncated prompts and were not trained on")
    return [i for i, _ in kept], [t for _, t in kept]


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
                          "the data is off-policy (consider --set lower.old_logprobs=behaviour)",
                          stacklevel=5)  # train_lower's frame (via LowerStage._sources, setup, drive)
