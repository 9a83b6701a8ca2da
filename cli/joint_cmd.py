"""``mlmt train-joint``: alternate collect -> train-upper -> train-lower."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tosca_mlmt.cli.common import NO_WANDB_HELP, err, flag_overrides, parse_sets, print_summary


def train_joint(
    out: Path = typer.Option(..., "--out", "-o", help="Run folder (manifest.json links rounds, snapshots, runs)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config, e.g. configs/mlmt.yaml."),
    rounds: Optional[int] = typer.Option(None, help="Rounds (joint.rounds)."),
    engine: Optional[str] = typer.Option(None, help="Rollout engine: hf or vllm."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out after a crash or kill."),
    allow_drift: list[str] = typer.Option([], "--allow-drift", metavar="FIELD",
                                          help="On --resume, accept this changed config field (repeatable; only "
                                               "fields safe to change, see the README)."),
    set_: list[str] = typer.Option([], "--set", help="Any config field (repeatable)."),
    no_wandb: bool = typer.Option(False, "--no-wandb", help=NO_WANDB_HELP),
):
    """Hierarchical RL: each round collects a snapshot, fits the writer offline on it (plus a replay
    window), then runs online PPO iterations of the solver."""
    from tosca_mlmt.config import load_config
    from tosca_mlmt.pipelines.train_joint import train_joint as run

    ov = {k: v for k, v in {"joint.rounds": rounds, "engine.name": engine}.items() if v is not None}
    ov.update(flag_overrides(no_wandb))
    ov.update(parse_sets(set_))
    res = run(load_config(config, ov), out, resume=resume, console=err, allow_drift=tuple(allow_drift))
    for rec in res.manifest["rounds"]:
        m = rec.get("collect_metrics", {})
        print_summary(f"round {rec['round']}: snapshot {rec.get('snapshot')}", {**m, **{
            f"time/{k}": v for k, v in rec.get("seconds", {}).items()}})
    print(res.run_dir)
