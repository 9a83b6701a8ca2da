"""What every ``mlmt`` command shares: the stderr console, user-error handling, the
``--set`` / logging-switch overrides, the summary table, and the split of the process's output
between results (stdout) and everything else (stderr; third-party logs quiet unless ``--verbose``).

Its own module so that the command modules and ``cli/main.py`` (which registers them) both
import it, instead of the command modules importing back from ``main``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
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
# `mlmt --verbose`: commands print their long tables whole (eval's every metric)
VERBOSE = False
# True once third_party_logs quieted this process (the `mlmt` process without --verbose): library
# warnings and logs below ERROR are not shown
QUIET = False


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
        with _real_stdout():  # a re-executed process must start with the real stdout as its fd 1
            runtime.use_allocator(cfg.engine.allocator)
    from tosca_mlmt.config.origin import origin_line

    err.print(origin_line(cfg, path, len(overrides), run), highlight=False, markup=False)
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
    rundir = sys.modules.get("tosca_mlmt.pipelines.support.rundir")
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


# --- stdout carries results only ---
# A model command's stdout is its result (eval's JSON line, a snapshot id, a folder, chat's transcript), so
# `mlmt eval ... | jq` and `ID=$(mlmt collect ...)` work. Libraries write to stdout in many ways: vLLM's and
# DeepSpeed's logging handlers keep the sys.stdout object they got at import, C++ code (torch, vLLM's kernels)
# and child processes (vLLM's engine core, compilers of DeepSpeed ops) write to file descriptor 1. Swapping
# sys.stdout misses all three, so while a model command runs fd 1 itself points at stderr (os.dup2): every
# writer, in any language and in every child, lands on stderr, whenever it was set up. The real stdout lives
# on as a duplicate descriptor that only `print_result` / `results()` write to: nothing reaches stdout unless
# a command hands it over as a result. Where the app runs without a process stdout of its own (a test's
# CliRunner, a notebook), only sys.stdout is swapped, the same split at the Python level.
_results = None  # the stream results go to while a command runs (results_on_stdout), else None
_saved_fd: int | None = None  # the real stdout's descriptor while fd 1 points at stderr


def results_on_stdout(fn):
    """Run the command with stdout reserved for what it passes to ``print_result``/``results()``."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        with _stdout_for_results():
            return fn(*a, **kw)

    return wrapper


def results():
    """The text stream of the command's results: the real stdout."""
    return _results if _results is not None else sys.stdout


def print_result(*values) -> None:
    print(*values, file=results(), flush=True)


def _stdout_is_fd1() -> bool:
    try:
        return sys.stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):  # no stdout, or one that is no file (CliRunner)
        return False


@contextlib.contextmanager
def _stdout_for_results():
    global _results, _saved_fd
    if _results is not None:  # nested: already split
        yield
        return
    kept = sys.stdout
    kept.flush()
    saved = None
    if _stdout_is_fd1():
        try:
            saved = os.dup(1)  # not inherited across exec or by children (PEP 446)
            os.dup2(2, 1)
        except OSError:  # fd 1 or 2 closed: nothing at the descriptor level to protect
            saved = None
    if saved is not None:
        _results = os.fdopen(saved, "w", buffering=1, encoding=getattr(kept, "encoding", None) or "utf-8",
                             errors=getattr(kept, "errors", None) or "strict")
        _saved_fd = saved
    else:
        _results = kept
    sys.stdout = sys.stderr  # Python-level prints keep their order with the rest of stderr
    try:
        yield
    finally:
        sys.stdout = kept
        stream, _results, _saved_fd = _results, None, None
        stream.flush()
        if saved is not None:
            sys.stderr.flush()
            os.dup2(saved, 1)
            stream.close()


@contextlib.contextmanager
def _real_stdout():
    """fd 1 back on the real stdout for a moment (around os.execve: the new process starts from fd 1)."""
    if _saved_fd is None:
        yield
        return
    sys.stderr.flush()
    os.dup2(_saved_fd, 1)
    try:
        yield
    finally:
        os.dup2(2, 1)


# --- third-party logs: quiet unless --verbose ---
# Set in the `mlmt` process before torch, transformers or vLLM is imported (the CLI callback): each reads
# its variable once, at import, and child processes (vLLM's engine core, DeepSpeed's op builds, a
# re-executed mlmt) inherit them. An explicit setting in the environment wins.
QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" bars; vLLM's follow it (vllm/launch.py)
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10 warnings from C++ (vLLM's "NUMA binding" notice)
}


def third_party_logs(verbose: bool) -> None:
    """Route every library's log to stderr (vLLM logs to stdout by default) and, unless ``verbose``,
    keep only its errors (Python warnings of libraries too: cli.main). Changes the process (environment,
    logging): the `mlmt` process only."""
    global QUIET
    QUIET = not verbose
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if verbose:
        return
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    # Python logging of any library (torch's "Triton not available", DeepSpeed's accelerator notice,
    # vLLM's in-process engine): errors only. mlmt's own messages to the user are warnings.warn (one
    # `warning:` line each, cli.main) or the rich console, which this leaves alone.
    logging.disable(logging.WARNING)

