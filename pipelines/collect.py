"""``mlmt collect``: run episodes with the current models, verify, write a snapshot.

Steps (each timed): load_task -> load_models -> start_engine -> episodes -> write_snapshot.
Interrupted runs leave nothing visible: episodes live in memory until the atomic
snapshot write, so a rerun simply starts clean. ``CollectStage`` holds the steps in the stage
shape (pipelines/support/stage.py); an iteration is one engine batch (a ``CollectBatch``).
"""

from __future__ import annotations

import datetime as _dt
import os
import time
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

from tosca_mlmt import runtime
from tosca_mlmt import parallel as dist
from tosca_mlmt.config import Config
from tosca_mlmt.metrics import StageTimer, summarize
from tosca_mlmt.pipelines.support.provenance import snapshot_manifest
from tosca_mlmt.pipelines.support.rundir import RunDir
from tosca_mlmt.pipelines.support.stage import drive
from tosca_mlmt.models.policies import PolicyPair
from tosca_mlmt.rollout.engines import make_engine
from tosca_mlmt.rollout.engines.base import hit_rate, prefix_counts
from tosca_mlmt.rollout.runner import EpisodeRunner
from tosca_mlmt.rollout.tool import require_check
from tosca_mlmt.rollout.turns import first_samples
from tosca_mlmt.samples import sample_rows
from tosca_mlmt.store import write_snapshot
from tosca_mlmt.tasks import make_task


@dataclass
class CollectResult:
    snapshot_id: str
    created: bool
    path: Path
    summary: dict
    samples: list[dict] = field(default_factory=list)  # a few episodes, readable (samples.sample_rows)


@dataclass(frozen=True)
class CollectBatch:
    """One engine batch this rank played: its place among all ranks' batches, and its episodes."""

    index: int
    episodes: list


def collect(cfg: Config, out: str | Path | None = None, *, console=None, policies: PolicyPair | None = None,
            engine=None, log_dir: str | None = None, problems: list | None = None,
            prefix: str = "collect") -> CollectResult:
    """``out``: the snapshot root (default ``collect.out``). ``problems`` overrides the task's
    first ``task.limit`` problems (train-joint rotates them). ``prefix``: the metrics' namespace
    (``eval`` for mlmt eval: held-out numbers must not share a chart with training batches)."""
    if out is not None:
        cfg = replace(cfg, collect=replace(cfg.collect, out=str(out)))
    return drive(CollectStage(cfg, console=console, policies=policies, engine=engine, log_dir=log_dir,
                              problems=problems, prefix=prefix))


class CollectStage:
    """collect in the stage shape (pipelines/support/stage.py): an iteration plays one engine batch
    of this rank's share; ``close`` gathers every rank's episodes and writes the snapshot. An
    engine started here is closed in ``release``, also when a batch raised; a caller's stays open."""

    def __init__(self, cfg: Config, *, console=None, policies: PolicyPair | None = None, engine=None,
                 log_dir: str | None = None, problems: list | None = None, prefix: str = "collect"):
        self.cfg, self.console, self.log_dir, self.prefix = cfg, console, log_dir, prefix
        self.policies, self.engine, self.problems = policies, engine, problems
        self.own_engine = False
        self.timer = StageTimer()
        self.local: list[list] = []  # this rank's batches of episodes, in order, until the snapshot
        # held over all the batches: the progress display, the episodes' timer, whole weights (ZeRO-3)
        self._playing = ExitStack()

    def setup(self) -> tuple[int, int]:
        runtime.setup(self.cfg)
        # Episodes live in memory until the end: a snapshot root that cannot be written must
        # fail now, not after all of them were generated.
        self.rd = RunDir(self.cfg.collect.out, "collect", self.console, what="collect.out")
        self._load()
        self._plan()
        self._start()
        return 0, len(self.mine)

    def _load(self) -> None:
        cfg, timer = self.cfg, self.timer
        with timer("load_task"):
            self.task = make_task(cfg.task)
            require_check(cfg.episode, self.task)  # writer_sees/feedback: tool, refused before any model loads
            self.skipped = 0
            if self.problems is None:
                loaded = self.task.load(cfg.task.split, cfg.task.limit or None, cfg.task.skip_bad_rows)
                self.problems, self.skipped = loaded.problems, loaded.skipped_rows
        with timer("load_models"):
            self.policies = self.policies or PolicyPair(cfg.model, seed=cfg.seed)
        with timer("start_engine"):
            self.own_engine = self.engine is None
            self.engine = self.engine or make_engine(cfg, self.policies)

    def _plan(self) -> None:
        """The problems in engine batches, and this rank's share of them."""
        problems, n = self.problems, self.cfg.episode.n_samples
        # hf: one engine batch of turn-1 prompts per runner batch (so progress moves); vllm schedules
        # the whole turn itself, so it gets every problem at once.
        per_batch = len(problems) if self.cfg.engine.name == "vllm" else max(1, self.cfg.engine.batch_size // n)
        starts = range(0, len(problems), per_batch)
        self.batches = [problems[s:s + per_batch] for s in starts]
        firsts = first_samples(problems, n)  # over the whole list: a problem in two batches keeps unique ids
        self.batch_firsts = [firsts[s:s + per_batch] for s in starts]
        # Under several processes each rank plays a contiguous share of the batches, so the
        # snapshot holds the same episodes, in the same order, as a one-process run.
        self.mine = dist.shard(len(self.batches))

    def _start(self) -> None:
        """The progress display, the runner, and the block the batches are played in."""
        cfg, n = self.cfg, self.cfg.episode.n_samples
        progress = self.rd.progress(cfg)
        self.rd.say(f"collect: {len(self.problems)} problems x {n} samples on {cfg.engine.name}, "
                    f"{cfg.episode.rounds} feedback round(s)")
        self._playing.enter_context(progress)
        n_mine = sum(len(self.batches[b]) for b in self.mine)  # rank 0's bar counts its own share
        bar = progress.add_task(cfg.task.name, total=n_mine * n * (1 + 2 * cfg.episode.rounds))
        self.runner = EpisodeRunner(cfg, self.task, self.engine, self.policies,
                                    on_turn=lambda kind, k: progress.update(
                                        bar, advance=0 if kind == "counterfactual" else k,
                                        description=f"{cfg.task.name}: {kind}"),
                                    solve_temperature=cfg.collect.solve_temperature,
                                    refine_temperature=cfg.collect.refine_temperature,
                                    writer_temperature=cfg.collect.writer_temperature)
        self.cache0 = prefix_counts(self.engine)
        self._playing.enter_context(self.timer("episodes"))
        self._playing.enter_context(self.policies.full_weights())  # ZeRO-3: no per-forward collectives

    def iteration(self, i: int) -> CollectBatch:
        b = self.mine[i]
        return CollectBatch(b, self.runner.run(self.batches[b], batch_index=b, firsts=self.batch_firsts[b]))

    def log(self, i: int, record: CollectBatch) -> None:
        """Nothing per batch: collect's one metrics row is the whole snapshot's (``close``)."""

    def save(self, i: int, record: CollectBatch) -> None:
        """Kept in memory: the snapshot is written whole, and atomically, in ``close``."""
        self.local.append(record.episodes)

    def close(self) -> CollectResult:
        episodes = [e for batch in dist.gather_sharded(self.local, len(self.batches)) for e in batch]
        self._playing.close()  # whole weights, the episodes' timer, the progress display
        cfg, timer = self.cfg, self.timer
        summary = self._summary(episodes)
        manifest = snapshot_manifest("collect", cfg, task=self.task, problems=self.problems,
                                     skipped_rows=self.skipped,
                                     models={r: self.policies.fingerprint(r) for r in ("solver", "writer")},
                                     strategies=self.runner.strategies, summary=summary,
                                     timings=timer.as_metrics(""), parents=cfg.collect.parents)
        with timer("write_snapshot"):
            sid, created = write_snapshot(cfg.collect.out, episodes, manifest.to_dict()) if dist.is_main() else (None, False)
            sid, created = dist.broadcast((sid, created))  # readers on every rank may open it now
        summary.update(timer.as_metrics())
        sink = self.rd.sink(cfg, self.log_dir or self.rd.path / "_logs" / f"collect-{_stamp()}-{os.getpid()}", name=sid)
        sink.log({f"{self.prefix}/{k}": v for k, v in summary.items()} | {"snapshot_id": sid})
        samples = sample_rows(episodes)
        sink.log_table(f"{self.prefix}/samples", samples)
        self.rd.close()
        return CollectResult(sid, created, self.rd.path / sid, summary, samples)

    def release(self) -> None:
        self._playing.close()
        if self.own_engine:  # a failed collect in a caller's loop must not keep vLLM's memory
            self.engine.close()

    def _counts(self) -> dict:
        """The run's counters, summed over the ranks (a collective)."""
        runner, task, cache = self.runner, self.task, prefix_counts(self.engine)
        cached = ({"prompt_tokens": cache[0] - self.cache0[0], "cached_prompt_tokens": cache[1] - self.cache0[1]}
                  if cache else {})
        return dist.all_sum({"gen_tokens": runner.gen_tokens, "gen_seconds": runner.gen_seconds, **cached,
                             "truncated_prompts": runner.truncated_prompts,
                             "score_seconds": self.timer.seconds["episodes"] - runner.gen_seconds,
                             "reward_calls": getattr(task, "calls", 0), "reward_errors": getattr(task, "errors", 0)})

    def _summary(self, episodes: list) -> dict:
        """The snapshot's summary: summarize's numbers, then the run's counters over all ranks."""
        summary, counts = summarize(episodes), self._counts()
        summary.update({
            "gen_tokens": int(counts["gen_tokens"]),
            "gen_seconds": round(counts["gen_seconds"], 3),
            "tokens_per_s": round(counts["gen_tokens"] / max(counts["gen_seconds"], 1e-9), 2),
            "truncated_prompts": int(counts["truncated_prompts"]),
            "score_seconds": round(counts["score_seconds"], 3),
            "processes": dist.world(),
        })
        if self.cfg.task.reward:  # a failing reward function scores 0 and never stops the run: say how often
            summary.update(reward_calls=int(counts["reward_calls"]), reward_errors=int(counts["reward_errors"]))
            if summary["reward_errors"] and dist.is_main():
                warnings.warn(f"task.reward {self.cfg.task.reward}: {summary['reward_errors']} of "
                              f"{summary['reward_calls']} call(s) failed and scored 0 "
                              f"(first: {getattr(self.task, 'first_error', None)})",
                              stacklevel=5)  # collect's caller (via close, drive, collect)
        if hasattr(self.engine, "sync_seconds"):
            summary["weight_sync_seconds"] = round(self.engine.sync_seconds, 3)
        if "prompt_tokens" in counts:  # prompt tokens vLLM's prefix cache served (a refine extends its turn 1)
            summary["prefix_hit_rate"] = hit_rate((0, 0), (counts["prompt_tokens"], counts["cached_prompt_tokens"]))
        return summary


def _stamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S") + f"-{int(time.time() * 1000) % 1000:03d}"
