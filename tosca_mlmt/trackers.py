"""The trackers a :class:`~tosca_mlmt.metrics.MetricsSink` mirrors its records to, built by name
(``logging.trackers``) from accelerate's tracking classes, so the sink drives every backend through
one interface: accelerate's ``log(values, step)`` and ``finish()`` (through :func:`log`, which adds
tensorboard's resume marker), and :func:`log_table` for sample rows.

The names live in ``config/run.py`` (``TRACKERS``: config/ imports only the ground floor);
``BUILDERS`` maps each to its accelerate class, and tests/unit/test_trackers.py fails when they differ.

No ``Accelerator`` is involved. In accelerate 1.x a tracker's constructor only stores its
arguments and ``start()`` opens it (``Accelerator.init_trackers`` calls it lazily), so each builder
constructs and then starts. Trackers are built on rank 0 only (the sink of another rank is off),
and nothing here creates accelerate's ``PartialState``: creating one sets up accelerate's own
process state (the device, under torchrun a process group if none exists yet, on CPU the thread
count) beside the one ``tosca_mlmt.parallel`` manages, and on rank 0 alone. Two things in
accelerate.tracking would ask for one, and :func:`_standalone` turns both off: the
``main_process_only`` check (every tracker gets ``False``; the sink already is rank 0's) and its
debug lines, logged through accelerate's multi-process logger, which raises without a state.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tosca_mlmt.config.run import TRACKERS
from tosca_mlmt.errors import MlmtError
from tosca_mlmt.fsutil import atomic_write_text

TENSORBOARD_DIR = "tb"  # <sink folder>/tb/: the event files of one run
# <sink folder>/wandb_run_id: the wandb run this folder logs to. Written when the folder first
# opens one; a later sink on the same folder (a --resume, in this process or another) reads it
# and continues that run (resume="allow") instead of starting a second one.
WANDB_RUN_ID = "wandb_run_id"
_RUN_ID = re.compile(r"[a-z0-9]{1,64}")


def _standalone(tracker):
    """``tracker`` usable without a ``PartialState`` (module docstring): rank checks off, and
    accelerate.tracking's logger a plain one of the same name (its debug lines are kept)."""
    import accelerate.tracking

    if isinstance(accelerate.tracking.logger, logging.LoggerAdapter):
        accelerate.tracking.logger = logging.getLogger(accelerate.tracking.__name__)
    tracker.main_process_only = False
    return tracker


def wandb_run_id(folder: Path) -> str:
    """The wandb run id of the sink folder ``folder``: the stored one, else a new one, stored
    (atomically) before the run opens, so a kill right after still resumes into it."""
    path = folder / WANDB_RUN_ID
    try:
        stored = path.read_text().strip()
    except FileNotFoundError:
        stored = None
    if stored is not None:
        if not _RUN_ID.fullmatch(stored):
            raise MlmtError(f"{path}: not a wandb run id ({stored[:40]!r}); delete the file to start a new run")
        return stored
    new = uuid.uuid4().hex[:16]  # wandb's own ids are 8 of [a-z0-9]; any such string is one
    atomic_write_text(path, new + "\n")
    return new


def _wandb(folder: Path, config: dict, project: str, name: str | None, wandb_mode: str):
    os.environ.setdefault("WANDB_SILENT", "true")
    from accelerate.tracking import WandBTracker

    # WandBTracker's first argument is wandb's *project*; the rest goes to wandb.init as it is.
    # reinit: train-joint opens the stages' runs one after another in one process. id + resume:
    # a resumed run continues the folder's wandb run (offline: a new offline-run-* folder with the
    # same id, which `wandb sync` uploads into that one run).
    tracker = _standalone(WandBTracker(project, mode=wandb_mode, dir=str(folder), config=config, name=name,
                                       reinit="finish_previous", id=wandb_run_id(folder), resume="allow"))
    tracker.start()
    return tracker


def _tensorboard(folder: Path, config: dict, project: str, name: str | None, wandb_mode: str):
    from accelerate.tracking import TensorBoardTracker

    # start() writes to os.path.join(logging_dir, run_name): run_name "tb" puts the events in
    # <folder>/tb, beside metrics.jsonl. The config is not stored as hparams: add_hparams takes
    # flat scalars only, and the run folder's config.yaml already holds it.
    tracker = _standalone(TensorBoardTracker(TENSORBOARD_DIR, str(folder)))
    try:
        tracker.start()
    except ImportError as e:  # accelerate falls back to tensorboardX when torch's writer cannot import
        raise MlmtError(f"logging.trackers has tensorboard but it cannot be imported ({e}); "
                        "pip install tensorboard") from None
    return tracker


# name -> (folder, config, project, run name, wandb_mode) -> a started accelerate tracker
BUILDERS: dict[str, Callable[..., Any]] = {"wandb": _wandb, "tensorboard": _tensorboard}


def open_trackers(names: Sequence[str], folder: str | Path, config: dict, project: str, name: str | None,
                  wandb_mode: str) -> list:
    """Started trackers for ``names`` (a subset of ``TRACKERS``), in that order."""
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:  # the config refuses these at load; a sink built in code gets the same words
        raise MlmtError(f"unknown tracker(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(TRACKERS)}")
    opened: list = []
    try:
        for n in names:
            opened.append(BUILDERS[n](Path(folder), config, project, name, wandb_mode))
    except BaseException:
        for t in opened:  # a wandb run left open would block the next one in this process
            t.finish()
        raise
    return opened


def plain(value: Any) -> Any:
    """A numpy or torch scalar as a Python number: accelerate's TensorBoardTracker writes only
    int/float/str/dict values and silently drops the rest (np.int64 and np.float32 among them)."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def log(tracker, values: dict, step: int | None = None) -> None:
    """``tracker.log``; on tensorboard the first record with a step also marks a session start at
    that step. A resumed run writes a new event file into the same ``tb/`` and logs again the steps
    after its checkpoint; TensorBoard hides what earlier files hold at or after a session start,
    so each step shows once, as the resumed run logged it (what ``SummaryWriter(purge_step=)``
    does, which needs the step before the writer opens)."""
    if tracker.name == "tensorboard" and step is not None and not getattr(tracker, "session_started", False):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        tracker.writer.file_writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))
        tracker.session_started = True
    tracker.log(values, step=step)


def log_table(tracker, key: str, rows: list[dict], step: int | None = None) -> None:
    """``rows`` (dicts with the same keys) as a table: a wandb.Table on a tracker that has tables
    (accelerate's ``log_table``), a markdown table in TensorBoard's Text tab on tensorboard."""
    columns = list(rows[0])
    data = [[r.get(c) for c in columns] for r in rows]
    if hasattr(tracker, "log_table"):
        tracker.log_table(key, columns=columns, data=data, step=step)
    elif tracker.name == "tensorboard":
        tracker.writer.add_text(key, markdown_table(columns, data), global_step=step)
        tracker.writer.flush()


def markdown_table(columns: list[str], data: list[list]) -> str:
    """A markdown table; a cell's ``|`` is escaped and its line breaks become ``<br>`` (a cell is
    one line in markdown, and the samples' problems and attempts span several)."""
    def cell(v: Any) -> str:
        text = "" if v is None else str(v)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")

    lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in data]
    return "\n".join(lines)
