"""``mlmt collect``: run episodes with the current models, verify, write a snapshot.

Steps (each timed): load_task -> load_models -> start_engine -> episodes -> write_snapshot.
Interrupted runs leave nothing visible: episodes live in memory until the atomic
snapshot write, so a rerun simply starts clean.
"""

from __future__ import annotations

import datetime as _dt
import os
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

from tosca_mlmt import runtime
from tosca_mlmt import parallel as dist
from tosca_mlmt.config import Config
from tosca_mlmt.metrics import StageTimer, summarize
from tosca_mlmt.pipelines.provenance import snapshot_manifest
from tosca_mlmt.pipelines.rundir import RunDir
from tosca_mlmt.models.policies import PolicyPair
from tosca_mlmt.rollout.engines import make_engine
from tosca_mlmt.rollout.engines.base import hit_rate, prefix_counts
from tosca_mlmt.rollout.runner import EpisodeRunner, first_samples
from tosca_mlmt.samples import sample_rows
from tosca_mlmt.snapshot import write_snapshot
from tosca_mlmt.tasks import make_task


@dataclass
class CollectResult:
    snapshot_id: str
    created: bool
    path: Path
    summary: dict
    samples: list[dict] = field(default_factory=list)  # a few episodes, readable (samples.sample_rows)


def collect(cfg: Config, out: str | Path | None = None, *, console=None, policies: PolicyPair | None = None,
            engine=None, log_dir: str | None = None, problems: list | None = None,
            prefix: str = "collect") -> CollectResult:
    """``out``: the snapshot root (default ``collect.out``). ``problems`` overrides the task's
    first ``task.limit`` problems (train-joint rotates them). ``prefix``: the metrics' namespace
    (``eval`` for mlmt eval: held-out numbers must not share a chart with training batches)."""
    if out is not None:
        cfg = replace(cfg, collect=replace(cfg.collect, out=str(out)))
    runtime.setup(cfg)
    # Episodes live in memory until the end: a snapshot root that cannot be written must
    # fail now, not after all of them were generated.
    rd = RunDir(cfg.collect.out, "collect", console, what="collect.out")
    timer = StageTimer()
    with timer("load_task"):
        task = make_task(cfg.task)
        skipped = 0
        if problems is None:
            loaded = task.load(cfg.task.split, cfg.task.limit or None, cfg.task.skip_bad_rows)
            problems, skipped = loaded.problems, loaded.skipped_rows
    with timer("load_models"):
        policies = policies or PolicyPair(cfg.model, seed=cfg.seed)
    with timer("start_engine"):
        own_engine = engine is None
        engine = engine or make_engine(cfg, policies)
    try:
        n = cfg.episode.n_samples
        turns_per_episode = 1 + 2 * cfg.episode.rounds
        # hf: one engine batch of turn-1 prompts per runner batch (so progress moves); vllm schedules
        # the whole turn itself, so it gets every problem at once.
        per_batch = len(problems) if cfg.engine.name == "vllm" else max(1, cfg.engine.batch_size // n)
        progress = rd.progress(cfg)
        rd.say(f"collect: {len(problems)} problems x {n} samples on {cfg.engine.name}, "
               f"{cfg.episode.rounds} feedback round(s)")
        with progress:
            starts = range(0, len(problems), per_batch)
            batches = [problems[s:s + per_batch] for s in starts]
            firsts = first_samples(problems, n)  # over the whole list: a problem in two batches keeps unique ids
            batch_firsts = [firsts[s:s + per_batch] for s in starts]
            mine = dist.shard(len(batches))
            n_mine = sum(len(batches[b]) for b in mine)  # rank 0's bar counts its own share
            bar = progress.add_task(cfg.task.name, total=n_mine * n * turns_per_episode)
            runner = EpisodeRunner(cfg, task, engine, policies,
                                   on_turn=lambda kind, k: progress.update(
                                       bar, advance=0 if kind == "counterfactual" else k,
                                       description=f"{cfg.task.name}: {kind}"),
                                   solve_temperature=cfg.collect.solve_temperature,
                                   refine_temperature=cfg.collect.refine_temperature,
                                   writer_temperature=cfg.collect.writer_temperature)
            cache0 = prefix_counts(engine)
            with timer("episodes"), policies.full_weights():  # ZeRO-3: whole weights, no per-forward collectives
                # Under several processes each rank plays a contiguous share of the batches, so the
                # snapshot holds the same episodes, in the same order, as a one-process run.
                local = [runner.run(batches[b], batch_index=b, firsts=batch_firsts[b]) for b in mine]
                episodes = [e for batch in dist.gather_sharded(local, len(batches)) for e in batch]
        summary = summarize(episodes)
        cache = prefix_counts(engine)
        counts = dist.all_sum({"gen_tokens": runner.gen_tokens, "gen_seconds": runner.gen_seconds,
                               **({"prompt_tokens": cache[0] - cache0[0], "cached_prompt_tokens": cache[1] - cache0[1]}
                                  if cache else {}),
                               "truncated_prompts": runner.truncated_prompts,
                               "score_seconds": timer.seconds["episodes"] - runner.gen_seconds,
                               "reward_calls": getattr(task, "calls", 0), "reward_errors": getattr(task, "errors", 0)})
        summary.update({
            "gen_tokens": int(counts["gen_tokens"]),
            "gen_seconds": round(counts["gen_seconds"], 3),
            "tokens_per_s": round(counts["gen_tokens"] / max(counts["gen_seconds"], 1e-9), 2),
            "truncated_prompts": int(counts["truncated_prompts"]),
            "score_seconds": round(counts["score_seconds"], 3),
            "processes": dist.world(),
        })
        if cfg.task.reward:  # a failing reward function scores 0 and never stops the run: say how often
            summary.update(reward_calls=int(counts["reward_calls"]), reward_errors=int(counts["reward_errors"]))
            if summary["reward_errors"] and dist.is_main():
                warnings.warn(f"task.reward {cfg.task.reward}: {summary['reward_errors']} of {summary['reward_calls']} "
                              f"call(s) failed and scored 0 (first: {getattr(task, 'first_error', None)})",
                              stacklevel=2)
        if hasattr(engine, "sync_seconds"):
            summary["weight_sync_seconds"] = round(engine.sync_seconds, 3)
        if cache:  # prompt tokens vLLM's prefix cache served (a refine extends its turn 1), all ranks
            summary["prefix_hit_rate"] = hit_rate((0, 0), (counts["prompt_tokens"], counts["cached_prompt_tokens"]))
        manifest = snapshot_manifest("collect", cfg, task=task, problems=problems, skipped_rows=skipped,
                                     models={r: policies.fingerprint(r) for r in ("solver", "writer")},
                                     strategies=runner.strategies, summary=summary, timings=timer.as_metrics(""),
                                     parents=cfg.collect.parents)
        with timer("write_snapshot"):
            sid, created = write_snapshot(cfg.collect.out, episodes, manifest.to_dict()) if dist.is_main() else (None, False)
            sid, created = dist.broadcast((sid, created))  # readers on every rank may open it now
        summary.update(timer.as_metrics())
        sink = rd.sink(cfg, log_dir or rd.path / "_logs" / f"collect-{_stamp()}-{os.getpid()}", name=sid)
        sink.log({f"{prefix}/{k}": v for k, v in summary.items()} | {"snapshot_id": sid})
        samples = sample_rows(episodes)
        sink.log_table(f"{prefix}/samples", samples)
        rd.close()
        return CollectResult(sid, created, rd.path / sid, summary, samples)
    finally:
        if own_engine:  # a failed collect in a caller's loop must not keep vLLM's memory
            engine.close()


def _stamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S") + f"-{int(time.time() * 1000) % 1000:03d}"
