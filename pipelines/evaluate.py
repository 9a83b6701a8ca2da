"""``mlmt eval``: the three-turn loop, greedy decoding, on held-out problems only.

Strategies are chosen by the same rule before and after training (``episode.strategy_selection``,
default ``auto``: uniform without a trained Q head, epsilon-softmax over Q with one), drawn with
the run's seed; eval.json records the rule.

There is no oracle stop: every episode runs all K rounds even when turn 1 was already
right, so Acc@final measures what a user of the system would get, and right->wrong
(breaking a correct answer) is counted.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from tosca_mlmt import parallel as dist
from tosca_mlmt.config import Config
from tosca_mlmt.errors import ConfigError
from tosca_mlmt.pipelines.collect import collect
from tosca_mlmt.pipelines.rundir import check_writable


def adapters_from_run(run: Path) -> dict[str, str]:
    """A run folder's trained policies: ``solver/`` (train-lower/joint), ``writer/`` (train-upper/joint)."""
    found = {}
    for role in ("solver", "writer"):
        if (run / role / "adapter_config.json").exists():
            found[f"model.{role}_adapter"] = str(run / role)
    if not found:
        raise ConfigError(f"--run {run}: no trained solver/ or writer/ adapter folder in it")
    return found


def evaluate(cfg: Config, out: str | Path, console=None) -> dict:
    if cfg.task.split != "test":
        raise ConfigError("invalid value for field 'task.split': eval runs on held-out problems only (test)")
    check_writable(out)
    cfg = replace(cfg, solver_sampling=replace(cfg.solver_sampling, temperature=0.0),
                  writer_sampling=replace(cfg.writer_sampling, temperature=0.0),
                  # the same selection rule before and after training (episode.strategy_selection, seeded):
                  # switching to argmax only once a writer is trained would compare two protocols
                  episode=replace(cfg.episode, n_samples=1),
                  collect=replace(cfg.collect, out=str(Path(out) / "snapshots")))
    res = collect(cfg, console=console)
    report = {"snapshot_id": res.snapshot_id, "task": cfg.task.name, "split": cfg.task.split,
              "solver_adapter": cfg.model.solver_adapter or None, "writer_adapter": cfg.model.writer_adapter or None,
              "strategy_selection": cfg.episode.strategy_selection, "epsilon": cfg.episode.epsilon, **res.summary}
    if dist.is_main():  # under torchrun every rank collected its share; one writes
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "eval.json").write_text(json.dumps(report, indent=2))
    return report
