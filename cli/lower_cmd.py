"""``mlmt train-lower``: PPO for the solver with the context-dependency bonus."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tosca_mlmt.cli.common import (CONFIG, DATA, NO_PROGRESS, NO_WANDB, SEED, SET, TASK, command_config,
                                  common_overrides, err, out_folder, parse_sets, print_result,
                                  print_summary)

# The last iteration's numbers printed after a run. Acc counts reward >= 1 as right, so partial credit
# moves only the reward statistics: a run with a 0.1-step reward must not look as if it learned nothing.
SUMMARY_KEYS = ("lower/acc_t1", "lower/acc_final", "lower/reward_mean", "lower/reward_std", "lower/frac_reward_zero_std",
                "lower/reward_mean_t1", "lower/reward_mean_final", "lower/kl", "lower/bonus/mean", "lower/entropy",
                "lower/clipfrac", "lower/grad_norm", "lower/iteration_seconds")


def train_lower(
    out: Path = typer.Option(..., "--out", "-o", help="Run folder (checkpoints, metrics, snapshots, final adapter).", parser=out_folder),
    snapshot: list[str] = typer.Option([], "--snapshot", help="Train on these snapshots (ids, or prefixes of exactly one id under --root) instead of collecting (repeatable)."),
    root: Path = typer.Option(Path("snapshots"), help="Folder searched (recursively) for --snapshot."),
    iterations: Optional[int] = typer.Option(None, help="PPO iterations (lower.iterations)."),
    task: Optional[str] = TASK,
    engine: Optional[str] = typer.Option(None, help="Rollout engine: hf or vllm."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its latest checkpoint."),
    allow_drift: list[str] = typer.Option([], "--allow-drift", metavar="FIELD",
                                          help="On --resume, accept this changed config field (repeatable; only "
                                               "fields safe to change: docs/guides/resuming.md)."),
    no_verify: bool = typer.Option(False, "--no-verify",
                                   help="Read snapshots without checking their sizes, hashes and id."),
    config: Optional[Path] = CONFIG,
    set_: list[str] = SET,
    seed: Optional[int] = SEED,
    data: Optional[str] = DATA,
    no_wandb: bool = NO_WANDB,
    no_progress: bool = NO_PROGRESS,
):
    """Train the solver (turn 1 and every refine) with PPO; online unless --snapshot is given."""
    from tosca_mlmt.pipelines.train_lower import train_lower as run

    ov = {k: v for k, v in {"lower.iterations": iterations, "task.name": task, "engine.name": engine}.items()
          if v is not None}
    ov.update(common_overrides(seed, data, no_wandb, no_progress))
    ov.update(parse_sets(set_))
    cfg = command_config(config, ov)
    res = run(cfg, out, snapshot_ids=list(snapshot) or None, snapshot_root=root, resume=resume, console=err,
              allow_drift=tuple(allow_drift), verify=not no_verify)
    print_summary(f"train-lower: {res.iterations} iterations", {k: res.last_metrics[k] for k in SUMMARY_KEYS
                                                                 if k in res.last_metrics})
    print_result(res.run_dir)
