"""What every ``mlmt`` command shares: the stderr console, user-error handling, the
``--set`` / logging-switch overrides and the summary table.

Its own module so that the command modules and ``cli/main.py`` (which registers them) both
import it, instead of the command modules importing back from ``main``.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tosca_mlmt.errors import MlmtError

err = Console(stderr=True, soft_wrap=True)  # soft_wrap: never break paths in error lines
# True in the `mlmt` process itself (cli.main.main), not where a test or notebook calls the app:
# only then may a command replace the process (command_config)
STANDALONE = False


def command_config(path, overrides: dict, run=None):
    """A model command's config (load_config). In the `mlmt` process itself it first moves onto
    engine.allocator's malloc, which re-executes the process (runtime.use_allocator): so this runs
    before the command does anything else.

    ``run``: a training run folder (``--run`` of eval, chat, export): the config is the run's
    saved one with ``path`` (-c) and ``overrides`` on top (pipelines.evaluate.run_config), and
    each field they change from what training used is named in a warning on stderr (shown once
    the process runs on its allocator, so not twice)."""
    import warnings

    from tosca_mlmt import runtime
    from tosca_mlmt.config import load_config

    notes: list[str] = []
    if run is None:
        cfg = load_config(path, overrides)
    else:
        from tosca_mlmt.pipelines.evaluate import run_config

        cfg, notes = run_config(run, path, overrides)
    if STANDALONE:
        runtime.use_allocator(cfg.engine.allocator)
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return cfg


def _fail(msg: str):
    # One line, and the message is text, not markup: a field name or path with
    # "[/]" in it must not make rich raise instead of reporting.
    msg = re.sub(r"\s*[\r\n]+\s*", " ", msg).strip()
    err.print(f"[bold red]error:[/] {escape(msg)}", highlight=False)
    raise typer.Exit(2) from None


def no_space_text(e: OSError) -> str:
    """A full disk met by a write (``fsutil.NoSpaceError``, or an ENOSPC from code that is not
    fsutil's, e.g. a snapshot's parquet files), naming the disk: the file's, else that of the run
    folder this process writes."""
    from tosca_mlmt import fsutil

    if isinstance(e, fsutil.NoSpaceError):
        return str(e)
    rundir = sys.modules.get("tosca_mlmt.pipelines.rundir")
    where = e.filename or (rundir and rundir.RunDir.latest_path) or Path.cwd()
    return fsutil.no_space_message(where, cause=e.strerror or e)


def user_errors(fn):
    """Turn MlmtError, and a full disk, into a one-line message and exit code 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        from tosca_mlmt import fsutil

        try:
            return fn(*a, **kw)
        except MlmtError as e:
            _fail(str(e))
        except OSError as e:
            if not fsutil.is_no_space(e):
                raise
            _fail(no_space_text(e))

    return wrapper


def out_folder(value) -> Path:
    """The parser of every ``--out``: typer would read an empty ``--out ''`` (an unset shell
    variable) as the current folder, so it is refused here, where the text is still empty."""
    if isinstance(value, str) and not value:
        err.print("[bold red]error:[/] --out is empty: name a folder (use --out . for the current one)",
                  highlight=False)
        raise typer.Exit(2)
    return Path(value)


def parse_sets(sets: list[str]) -> dict:
    """``--set a.b=value`` options as config overrides."""
    from tosca_mlmt.config import parse_override

    return dict(parse_override(s) for s in sets or [])


# The options every config-driven command takes (collect, train-*, eval, chat): one spelling,
# one help text and one meaning each, so a flag learnt on one command works on the others.
CONFIG = typer.Option(None, "--config", "-c", help="YAML config: a file, or a preset name (mlmt, demo; "
                                                   "`mlmt config --list-presets`).")
SET = typer.Option([], "--set", help="Any config field, e.g. --set lower.lr=1e-5 (repeatable; applied last).")
SEED = typer.Option(None, "--seed", help="Master seed (config field seed): problems, strategy choice, sampling, "
                                         "LoRA init.")
DATA = typer.Option(None, "--data", help="Data root for gsm8k/math500/mbpp (task.data_path).")
# --no-wandb keeps its name from before logging.trackers: it sets logging.wandb=false, which
# turns every tracker off, so scripts written for wandb alone still log nothing but metrics.jsonl.
NO_WANDB = typer.Option(False, "--no-wandb", help="Log to no tracker (logging.trackers: wandb, tensorboard); "
                                                  "metrics.jsonl is always written.")
NO_PROGRESS = typer.Option(False, "--no-progress", help="Hide progress bars.")
# collect, train-lower and eval pick a task on the command line (task.name)
TASK = typer.Option(None, "--task", help="Task: arith, gsm8k, math500, mbpp, jsonl (with --set task.path=FILE), an "
                                         "installed 'tosca_mlmt.tasks' entry point, or module:Class.")


def common_overrides(seed: int | None = None, data: str | None = None, no_wandb: bool = False,
                     no_progress: bool = False) -> dict:
    """The common options as config overrides (``--set`` goes on top of them)."""
    ov: dict = {k: v for k, v in {"seed": seed, "task.data_path": data}.items() if v is not None}
    if no_wandb:
        ov["logging.wandb"] = False
    if no_progress:
        ov["logging.progress"] = False
    return ov


def print_summary(title: str, summary: dict) -> None:
    t = Table(title=title, show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in summary.items():
        t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    err.print(t)


def print_rows(title: str, rows: list[dict]) -> None:
    """``rows`` (dicts with the same keys) as one table on stderr; None shows as '-'."""
    if not rows:
        return
    t = Table(title=title, show_header=True)
    for c in rows[0]:
        t.add_column(c, justify="left" if c == "snapshot" else "right")
    for r in rows:
        t.add_row(*("-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()))
    err.print(t)
