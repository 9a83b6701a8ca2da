"""``mlmt train-upper``: offline strategic Q-learning + AWR for the feedback writer.

Registered in ``cli/main.py``. Messages and progress go to stderr; stdout's last line is
the trained writer's folder, so ``W=$(mlmt train-upper ...)`` then
``mlmt collect --set model.writer_adapter=$W`` works.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tosca_mlmt.cli.common import (CONFIG, DATA, NO_PROGRESS, NO_WANDB, SEED, SET, command_config, common_overrides,
                                  err, out_folder, parse_sets, print_result, print_summary)


def train_upper(
    snapshot: list[str] = typer.Option(..., "--snapshot", "-s", help="Snapshot id to learn from, or a prefix of exactly one id under --root (repeatable)."),
    root: Optional[Path] = typer.Option(None, help="Snapshot root folder (default: collect.out)."),
    out: Path = typer.Option(..., help="Run folder (config, metrics, checkpoints, writer/, report.md).", parser=out_folder),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its latest checkpoint."),
    allow_drift: list[str] = typer.Option([], "--allow-drift", metavar="FIELD",
                                          help="On --resume, accept this changed config field (repeatable; only "
                                               "fields safe to change: docs/guides/resuming.md)."),
    no_verify: bool = typer.Option(False, "--no-verify",
                                   help="Read snapshots without checking their sizes, hashes and id."),
    deterministic: bool = typer.Option(False, "--deterministic", help="Determinism mode (exactly resumable)."),
    config: Optional[Path] = CONFIG,
    set_: list[str] = SET,
    seed: Optional[int] = SEED,
    data: Optional[str] = DATA,
    no_wandb: bool = NO_WANDB,
    no_progress: bool = NO_PROGRESS,
):
    """Fit the feedback writer's strategy Q-values and feedback text from logged snapshots (no rollouts).

    Prints the trained writer's folder as the last line of stdout."""
    ov: dict = {"upper.snapshots": list(snapshot)}
    if root is not None:
        ov["upper.snapshot_root"] = str(root)
    if deterministic:
        ov["deterministic"] = True
    ov.update(common_overrides(seed, data, no_wandb, no_progress))
    ov.update(parse_sets(set_))
    cfg = command_config(config, ov)
    from tosca_mlmt.pipelines.train_upper import train_upper as run

    res = run(cfg, out, resume=resume, console=err, allow_drift=tuple(allow_drift), verify=not no_verify)
    print_summary(f"train-upper {out} (step {res.step})", res.metrics)
    err.print(f"report: {out / 'report.md'}")
    print_result(res.writer_dir)
