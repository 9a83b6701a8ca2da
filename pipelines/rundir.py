"""A stage's output folder (``RunDir``) and what every stage does with it: check that it can
be written before any work, refuse to reuse it without ``--resume`` and a ``--resume`` whose
config drifted from the run's, write ``config.yaml`` and the run's provenance, keep
``metrics.jsonl`` in step with the checkpoint a run resumes from, show the progress bar,
and write files atomically (rank 0 only).

Drift: a resumed run must train the same thing, so any config field that differs from the
run's ``config.yaml`` is refused, named with its old and new value. ``logging.*`` may always
change (it only decides what is shown and where). A few more fields are safe but change what
the run does, so they need ``--allow-drift FIELD``: checkpoint/log/eval periods and the run's
length, which may only grow (the data of step i is a pure function of the seed and i, so a
longer run extends the shorter one exactly). A field the run's ``config.yaml`` lacks (written
before the knob existed) counts as what that version did, its default or its BEFORE_KNOB value, with a
warning naming it.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

import yaml
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tosca_mlmt import parallel as dist
from tosca_mlmt.config import Config
from tosca_mlmt.errors import ConfigError, MlmtError
from tosca_mlmt.fsutil import atomic_write_text
from tosca_mlmt.metrics import MetricsSink
from tosca_mlmt.pipelines.provenance import now, software

ALWAYS_ALLOWED = ("logging",)
_UPPER_PERIODS = ("upper.save_every", "upper.keep_checkpoints", "upper.log_every", "upper.eval_every")
_LOWER_PERIODS = ("lower.save_every", "lower.keep_checkpoints")
SAFE_DRIFT = {
    "train-lower": ("lower.iterations", *_LOWER_PERIODS),
    # snapshot ids are content hashes, so where they are read from cannot change the data
    "train-upper": ("upper.steps", "upper.snapshot_root", *_UPPER_PERIODS),
    "train-joint": ("joint.rounds", "joint.max_seconds", *_LOWER_PERIODS, *_UPPER_PERIODS),
}
# Lengths: shrinking one below the progress made would leave a run past its own end.
GROW_ONLY = ("lower.iterations", "upper.steps", "joint.rounds")


def _covered(field: str, patterns) -> bool:
    return any(field == p or field.startswith(p + ".") for p in patterns)


def check_allow_drift(stage: str, fields) -> tuple[str, ...]:
    """The user's ``--allow-drift`` fields, each checked to be safe for ``stage``."""
    safe = SAFE_DRIFT[stage]
    for f in fields:
        if not _covered(f, (*safe, *ALWAYS_ALLOWED)):
            raise ConfigError(f"--allow-drift {f}: not a field that may change when {stage} resumes "
                              f"(it would change the training); allowed: {', '.join(safe)}")
    return tuple(fields)


def diff_fields(old, new, prefix: str = "") -> list[str]:
    """Dotted names of the leaves that differ between two nested dicts."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += diff_fields(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    return [] if old == new else [prefix.rstrip(".")]


def _get(tree, field: str):
    for part in field.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


# Knobs whose default does not keep what runs written before them did, with the value those runs had:
# engine.vllm.cpu_norm_kernel (vLLM's C++ RMSNorm rounds bf16 rollouts differently from the PyTorch norm).
BEFORE_KNOB = {"engine.vllm.cpu_norm_kernel": False}


def _fill_missing(old: dict, defaults: dict, prefix: str = "") -> list[str]:
    """Put each field of ``defaults`` that ``old`` (a run's config.yaml) lacks into it, at what the
    version that wrote the run did: the default, which a knob is added with where it keeps the old
    behaviour, else its BEFORE_KNOB value; returns their dotted names. A run written before a knob
    existed then resumes as it was, or is told which setting would make it."""
    added = []
    for k, v in defaults.items():
        if k not in old:
            old[k] = BEFORE_KNOB.get(prefix + k, v)
            added.append(prefix + k)
        elif isinstance(v, dict) and v and isinstance(old[k], dict):
            added += _fill_missing(old[k], v, f"{prefix}{k}.")
    return added


def check_drift(run: Path, cfg: Config, stage: str, allow) -> None:
    """Raise MlmtError naming every field of ``cfg`` that differs from ``<run>/config.yaml``
    and may not (``allow`` lists the fields let through, already checked)."""
    try:
        old = yaml.safe_load((run / "config.yaml").read_text())
    except (OSError, yaml.YAMLError) as e:
        raise MlmtError(f"--resume: {run}/config.yaml unreadable ({e}); cannot tell what the run trained") from None
    new = cfg.to_dict()
    old = old if isinstance(old, dict) else {}
    added = _fill_missing(old, Config().to_dict())
    if added:
        warnings.warn(f"--resume: {run}/config.yaml predates the fields {', '.join(added)}; each counts as what "
                      "the version that wrote the run did (its default, or the value before the knob)", stacklevel=2)
    changed = [f for f in diff_fields(old, new) if not _covered(f, ALWAYS_ALLOWED)]
    show = lambda f: f"{f} ({_get(old, f)!r} -> {_get(new, f)!r})"  # noqa: E731
    unsafe = [f for f in changed if not _covered(f, SAFE_DRIFT[stage])]
    shrunk = [f for f in changed if f in GROW_ONLY and _covered(f, allow) and isinstance(_get(old, f), int)
              and isinstance(_get(new, f), int) and _get(new, f) < _get(old, f)]
    unallowed = [f for f in changed if f not in unsafe and not _covered(f, allow)]
    if unsafe:
        raise MlmtError(f"--resume: the config differs from {run}/config.yaml in {', '.join(map(show, unsafe))}; "
                        f"that changes what the run trains: resume with the run's config or choose a new --out")
    if shrunk:
        raise MlmtError(f"--resume: {', '.join(map(show, shrunk))}: a run's length may only grow")
    if unallowed:
        flags = " ".join(f"--allow-drift {f}" for f in unallowed)
        raise MlmtError(f"--resume: the config differs from {run}/config.yaml in {', '.join(map(show, unallowed))}; "
                        f"safe to change, but say so: pass {flags}")


def check_writable(path: str | Path, what: str = "--out") -> None:
    """Fail now, before any model loads or episode runs, when ``path`` (a folder, possibly
    not there yet) could not be created and written. Creates nothing."""
    path = Path(path)
    probe = path
    while not probe.exists() and not probe.is_symlink() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "is a file" if probe == path else f"cannot be created: {probe} is a file"
        raise MlmtError(f"{what} {path} {where}, not a folder")
    try:
        fd, name = tempfile.mkstemp(prefix=".write-probe-", dir=probe)
    except OSError as e:
        raise MlmtError(f"{what} {path}: cannot write in {probe} ({e.strerror})") from None
    os.close(fd)
    os.unlink(name)


class RunDir:
    """The folder a stage writes: ``RunDir(path, stage)`` checks it can be written (creating
    nothing); the training stages then ``check`` it before any model loads and ``claim`` it
    once their inputs are read. Files are written by rank 0, atomically."""

    def __init__(self, path: str | Path, stage: str, console=None, what: str = "--out"):
        self.path = Path(path)
        self.stage = stage
        self.console = console
        self._sink: MetricsSink | None = None
        check_writable(self.path, what)

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
        used = self.holds_run()
        if used and not resume:
            raise MlmtError(f"{self.path} already holds a {self.stage} run; pass --resume to continue it "
                            "or choose another --out")
        if used and allow_drift is not None and (self.path / "config.yaml").exists():
            check_drift(self.path, cfg, self.stage, allow_drift)
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
