"""What a stage records about how its output was made: the software header of run.json,
provenance.json and manifest.json, and the manifest of every snapshot a stage writes."""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict, dataclass, field

from tosca_mlmt import __version__, runtime
from tosca_mlmt.config import Config
from tosca_mlmt.rollout.turns import to_params


@dataclass
class Manifest:
    """A snapshot's provenance, whoever writes it (collect, train-lower's batches): the same
    fields everywhere, so any stage can read any snapshot. ``write_snapshot`` adds the
    format's own fields (files, rows, id); ``snapshot.INFORMATIONAL`` ones stay out of the id."""

    kind: str
    config: dict
    models: dict  # role -> fingerprint
    task: dict
    seeds: dict
    sampling: dict  # role -> sampling parameters
    strategies: list
    engine: str
    parents: list = field(default_factory=list)
    iteration: int | None = None  # train-lower's batch: the iteration it was sampled for
    tosca_mlmt_version: str | None = None
    git_sha: str | None = None
    packages: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "parents": list(self.parents), "tosca_mlmt_version": self.tosca_mlmt_version,
             "git_sha": self.git_sha, "config": self.config, "models": self.models, "task": self.task,
             "seeds": self.seeds, "sampling": self.sampling, "strategies": self.strategies, "engine": self.engine,
             "packages": self.packages, "summary": self.summary, "timings": self.timings}
        if self.iteration is not None:
            d["iteration"] = self.iteration
        return d


def now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def software() -> dict:
    """Which code made it (informational: never part of an id)."""
    return {"tosca_mlmt_version": __version__, "git_sha": runtime.git_sha(), "packages": runtime.package_versions()}


def snapshot_manifest(kind: str, cfg: Config, *, task, problems: list, models: dict, strategies: list,
                      summary: dict, timings: dict, parents=(), skipped_rows: int = 0,
                      iteration: int | None = None) -> Manifest:
    """The one manifest every snapshot writer fills (collect, train-lower's batches), so that
    any stage can read any snapshot. ``models``: role -> fingerprint, taken on every rank
    (a collective under ZeRO-3)."""
    return Manifest(
        kind=kind, parents=list(parents), config=cfg.to_dict(), models=models,
        task={"name": task.name, "split": cfg.task.split, "verifier_version": task.verifier_version,
              "problem_ids": [p.id for p in problems], "skipped_rows": skipped_rows, "n_problems": len(problems)},
        seeds={"seed": cfg.seed},
        sampling={"solver": asdict(to_params(cfg.solver_sampling, cfg.seed, n=cfg.episode.n_samples)),
                  "writer": asdict(to_params(cfg.writer_sampling, cfg.seed,
                                             max_new_tokens=cfg.episode.max_feedback_tokens))},
        strategies=strategies, engine=cfg.engine.name, iteration=iteration, summary=summary, timings=timings,
        **software())
