"""``mlmt train-joint``: alternate collect -> train-upper -> train-lower."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tosca_mlmt.cli.common import (CONFIG, DATA, NO_PROGRESS, NO_WANDB, SEED, SET, command_config, common_overrides,
                                  err, out_folder, parse_sets, print_result, print_rows)


def train_joint(
    out: Path = typer.Option(..., "--out", "-o", help="Run folder (manifest.json links rounds, snapshots, runs).", parser=out_folder),
    rounds: Optional[int] = typer.Option(None, help="Rounds (joint.rounds)."),
    engine: Optional[str] = typer.Option(None, help="Rollout engine: hf or vllm."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out after a crash or kill."),
    allow_drift: list[str] = typer.Option([], "--allow-drift", metavar="FIELD",
                                          help="On --resume, accept this changed config field (repeatable; only "
                                               "fields safe to change: docs/guides/resuming.md)."),
    config: Optional[Path] = CONFIG,
    set_: list[str] = SET,
    seed: Optional[int] = SEED,
    data: Optional[str] = DATA,
    no_wandb: bool = NO_WANDB,
    no_progress: bool = NO_PROGRESS,
):
    """Hierarchical RL: each round collects a snapshot, fits the writer offline on it (plus a replay
    window), then runs online PPO iterations of the solver."""
    from tosca_mlmt.pipelines.support.timeline import summary_rows
    from tosca_mlmt.pipelines.train_joint import train_joint as run

    ov = {k: v for k, v in {"joint.rounds": rounds, "engine.name": engine}.items() if v is not None}
    ov.update(common_overrides(seed, data, no_wandb, no_progress))
    ov.update(parse_sets(set_))
    res = run(command_config(config, ov), out, resume=resume, console=err, allow_drift=tuple(allow_drift))
    # each round already had its line as it finished; the end repeats only one row per round
    print_rows("train-joint rounds", summary_rows(res.manifest))
    print_result(res.run_dir)
