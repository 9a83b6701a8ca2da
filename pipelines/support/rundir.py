"""A stage's output folder (``RunDir``) and what every stage does with it: check that it can
be written before any work, refuse to reuse it without ``--resume`` (and, through ``drift.py``,
a ``--resume`` whose config drifted from the run's), write ``config.yaml`` and the run's
provenance, keep ``metrics.jsonl`` in step with the checkpoint a run resumes from, show the
progress bar, and write files atomically (rank 0 only).

Surroundings: a training stage holds an advisory lock on its folder (``.mlmt.lock``, taken in
``check`` before the folder is read, released by ``close`` or when the process ends, however it
ends), so a second run on the same ``--out`` is refused naming the holder; a lock file left by a
killed run holds no lock and is taken over. A path that is empty or too long for the filesystem
is refused with the other output checks, and so is a disk with less than ``fsutil.MIN_FREE_BYTES``
free: before any model loads or episode runs.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import tempfile
import time
import warnings
import weakref
from pathlib import Path

import yaml
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tosca_mlmt import parallel as dist
from tosca_mlmt.config import Config
from tosca_mlmt.errors import MlmtError
from tosca_mlmt.fsutil import NoSpaceError, atomic_write_text, ensure_space
from tosca_mlmt.metrics import MetricsSink
from tosca_mlmt.pipelines.support.drift import check_allow_drift, check_drift
from tosca_mlmt.pipelines.support.provenance import now, software


def check_writable(path: str | Path, what: str = "--out") -> None:
    """Fail now, before any model loads or episode runs, when ``path`` (a folder, possibly
    not there yet) could not be created and written, or its disk is (almost) full. Creates
    nothing."""
    if isinstance(path, str) and not path:
        raise MlmtError(f"{what} is empty: name a folder (use . for the current one)")
    path = Path(path)
    try:
        probe = path
        while not probe.exists() and not probe.is_symlink() and probe.parent != probe:
            probe = probe.parent
    except OSError as e:  # a name too long for the filesystem (os.stat raises it on Python < 3.12)
        raise MlmtError(f"{what} {path}: {_path_problem(e)}") from None
    if probe.exists() and not probe.is_dir():
        where = "is a file" if probe == path else f"cannot be created: {probe} is a file"
        raise MlmtError(f"{what} {path} {where}, not a folder")
    too_long = _too_long(path, probe)
    if too_long:
        raise MlmtError(f"{what} {path}: {too_long}")
    try:
        fd, name = tempfile.mkstemp(prefix=".write-probe-", dir=probe)
    except OSError as e:
        raise MlmtError(f"{what} {path}: cannot write in {probe} ({e.strerror})") from None
    os.close(fd)
    os.unlink(name)
    try:
        ensure_space(probe)
    except NoSpaceError as e:
        raise MlmtError(f"{what} {path}: {e}") from None


def _limit(folder: Path, name: str, default: int) -> int:
    try:
        return os.pathconf(folder, name)
    except (OSError, ValueError, AttributeError):
        return default


def _too_long(path: Path, probe: Path) -> str | None:
    """Why the folders of ``path`` below ``probe`` (the nearest that exists) could not be made:
    a name or the whole path longer than the filesystem allows."""
    name_max = _limit(probe, "PC_NAME_MAX", 255)
    for part in path.relative_to(probe).parts if path != probe else ():
        if len(os.fsencode(part)) > name_max:
            return (f"the name '{part[:40]}...' is {len(os.fsencode(part))} bytes, longer than the "
                    f"{name_max} its filesystem allows; choose a shorter name")
    path_max = _limit(probe, "PC_PATH_MAX", 4096)
    full = len(os.fsencode(os.path.abspath(path)))
    if full >= path_max:
        return f"the path is {full} bytes, longer than the {path_max - 1} its filesystem allows; choose a shorter one"
    return None


def _path_problem(e: OSError) -> str:
    if e.errno == errno.ENAMETOOLONG:
        return "a name in it is longer than its filesystem allows (File name too long); choose a shorter name"
    return f"cannot be used ({e.strerror or e})"


LOCK_NAME = ".mlmt.lock"
# This process's locks by folder: a folder locked here may be locked again here (a run that failed in this
# process, its RunDir kept alive by the traceback, resumed in it); released by the first close, or when the
# last RunDir holding it is collected.
_HELD: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class _Lock:
    """An flock on ``<folder>/.mlmt.lock`` (pid, host and start time in it, for the message of
    whoever is refused). The kernel drops it when the process ends, however it ends, so the file a
    killed run leaves blocks nothing: it is stale, and the next run takes it over."""

    def __init__(self, folder: Path):
        import fcntl

        made = []  # the folders made here: an empty one is removed again on release
        p = folder
        while not p.exists() and p.parent != p:
            made.append(p)
            p = p.parent
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / LOCK_NAME
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise MlmtError(f"{folder} is in use by another run ({holder or 'holder unknown'}; "
                                    f"lock {self.path}); wait for it to end or choose another --out") from None
                warnings.warn(f"{folder}: cannot lock the run folder ({e.strerror}); a second run on it would not "
                              "be refused", stacklevel=4)
                self.fd, self.stale, self._finalizer = None, "", None
                return
            try:  # the file may have been removed by a holder releasing it between the open and the lock
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        self.stale = _read_holder(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        self._finalizer = weakref.finalize(self, _release, fd, str(self.path), [str(m) for m in made], os.getpid())

    @property
    def held(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def _release(fd: int, path: str, made: list[str], pid: int) -> None:
    """Remove the lock file while still holding it (whoever opened it before then sees it gone and
    opens the new one), then unlock; and remove the folders made for the lock if they stayed empty.
    A forked child that inherited the lock leaves it to its parent."""
    if os.getpid() != pid:
        return
    try:
        os.unlink(path)
    except OSError:
        pass
    os.close(fd)
    for folder in made:
        try:
            os.rmdir(folder)
        except OSError:
            break


class RunDir:
    """The folder a stage writes: ``RunDir(path, stage)`` checks it can be written (creating
    nothing); the training stages then ``check`` it before any model loads, which locks it, and
    ``claim`` it once their inputs are read; ``close`` unlocks it. Files are written by rank 0,
    atomically."""

    # the folder of the RunDir made last in this process: the disk a failed write is reported on
    # when the error does not say which file it was writing (cli.common.user_errors)
    latest_path: Path | None = None

    def __init__(self, path: str | Path, stage: str, console=None, what: str = "--out"):
        check_writable(path, what)
        self.path = Path(path)
        self.stage = stage
        self.console = console
        self._sink: MetricsSink | None = None
        self._lock: _Lock | None = None
        RunDir.latest_path = self.path

    def lock(self) -> None:
        """Hold the folder's lock until ``close`` (or the process's end), or raise MlmtError naming
        the run that holds it. Rank 0 locks for every rank: the others learn its outcome."""
        problem = None
        if dist.is_main() and self._lock is None:
            key = os.path.realpath(self.path)
            held = _HELD.get(key)
            held = held if held is not None and held.held else None
            try:
                self._lock = held if held is not None else _Lock(self.path)
            except MlmtError as e:
                problem = str(e)
            else:
                _HELD[key] = self._lock
                if held is None and self._lock.stale:
                    self.say(f"{self.path}: took over the lock file of a run that ended without releasing it "
                             f"({self._lock.stale})")
        problem = dist.broadcast(problem)
        if problem:
            raise MlmtError(problem)

    def unlock(self) -> None:
        """Release the lock: the stage is over (the lock file goes with it)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def holds_run(self) -> bool:
        # config.yaml is the claim; a checkpoint or train-joint manifest alone is a run that predates it
        return (any((self.path / f).exists() for f in ("config.yaml", "manifest.json"))
                or any((self.path / "checkpoints").glob("step-*")))

    def check(self, cfg: Config, resume: bool, allow_drift) -> bool:
        """Refuse a used folder without ``resume``, and with it a config that drifted from the
        run's. ``allow_drift``: the user's ``--allow-drift`` fields; None when the caller
        (train-joint) checked its own config. Returns whether there is a run to continue."""
        if allow_drift is not None:
            allow_drift = check_allow_drift(self.stage, allow_drift)
        self.lock()  # before the folder is read: two runs started together must not both find it unused
        try:
            used = self.holds_run()
            if used and not resume:
                raise MlmtError(f"{self.path} already holds a {self.stage} run; pass --resume to continue it "
                                "or choose another --out")
            if used and allow_drift is not None and (self.path / "config.yaml").exists():
                check_drift(self.path, cfg, self.stage, allow_drift)
        except BaseException:
            self.unlock()
            raise
        return used

    def claim(self, cfg: Config) -> None:
        """(Re)write ``config.yaml``, what the next ``--resume`` is compared against, once every
        rank has checked the folder."""
        dist.barrier()
        self.write_text("config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    def provenance(self, **fields) -> dict:
        """The header of the run's own record (run.json, provenance.json, manifest.json)."""
        return {"stage": self.stage, "started_at": now(), **software(), **fields}

    def write_text(self, name: str, text: str) -> Path:
        path = self.path / name
        if dist.is_main():  # every rank holds the same content; one writes it
            atomic_write_text(path, text)
        return path

    def write_json(self, name: str, obj) -> Path:
        return self.write_text(name, json.dumps(obj, indent=2, default=str))

    def read_json(self, name: str) -> dict:
        """``<run>/<name>`` as a dict; empty when it is missing or not a JSON object."""
        try:
            rec = json.loads((self.path / name).read_text())
        except (OSError, ValueError):
            return {}
        return rec if isinstance(rec, dict) else {}

    def say(self, text: str) -> None:
        if self.console is not None and dist.is_main():
            self.console.print(text, highlight=False)

    def progress(self, cfg: Config) -> Progress:
        return Progress(TextColumn(f"[bold]{self.stage}[/] {{task.description}}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), disable=not (cfg.logging.progress and dist.is_main()),
                        console=self.console, transient=False)

    def sink(self, cfg: Config, folder: str | Path | None = None, name: str | None = None, tee=None) -> MetricsSink:
        """The run's metrics sink (``<folder or run>/metrics.jsonl``, and the ``logging.trackers``
        when ``logging.wandb`` is on: ``wandb/``, ``tb/`` beside it); ``close`` ends it.
        ``tee(metrics, step)`` also gets every record (train-joint's timeline), first those the
        file already holds: a resumed run's records from before its checkpoint, which it does not
        log again but the timeline (cut back to the last finished step) lost."""
        self._sink = MetricsSink(folder or self.path, cfg.to_dict(), cfg.logging.active_trackers(),
                                 cfg.logging.wandb_mode, cfg.logging.project, name=name or self.path.name)
        if tee is not None and self._sink.enabled and self._sink.path.exists():
            for line in self._sink.path.read_text().splitlines():
                rec = json.loads(line)
                rec.pop("time", None)
                step = rec.pop("step", None)
                tee(rec, step)
        self._sink.tee = tee
        return self._sink

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
        self.unlock()

    def metrics_bytes(self) -> int:
        """Length of ``metrics.jsonl`` now: saved with each checkpoint, so a resume can drop
        what was logged after it (those steps are logged again)."""
        p = self.path / "metrics.jsonl"
        return p.stat().st_size if p.exists() else 0

    def rewind_metrics(self, size: int | None) -> None:
        """Cut ``metrics.jsonl`` back to ``size`` bytes (None: unknown, leave it)."""
        p = self.path / "metrics.jsonl"
        if size is None or not dist.is_main() or not p.exists() or p.stat().st_size <= size:
            return
        with open(p, "r+b") as f:
            f.truncate(size)
