"""What every stage does with its output folder before and around the work: check that it
can be written, refuse a ``--resume`` whose config drifted from the run's, and keep
``metrics.jsonl`` in step with the checkpoint a run resumes from.

Drift: a resumed run must train the same thing, so any config field that differs from the
run's ``config.yaml`` is refused, named with its old and new value. ``logging.*`` may always
change (it only decides what is shown and where). A few more fields are safe but change what
the run does, so they need ``--allow-drift FIELD``: checkpoint/log/eval periods and the run's
length, which may only grow (the data of step i is a pure function of the seed and i, so a
longer run extends the shorter one exactly).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import yaml

from tosca_mlmt import parallel as dist
from tosca_mlmt.config import Config
from tosca_mlmt.errors import ConfigError, MlmtError

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


def check_drift(run: Path, cfg: Config, stage: str, allow) -> None:
    """Raise MlmtError naming every field of ``cfg`` that differs from ``<run>/config.yaml``
    and may not (``allow`` lists the fields let through, already checked)."""
    try:
        old = yaml.safe_load((run / "config.yaml").read_text())
    except (OSError, yaml.YAMLError) as e:
        raise MlmtError(f"--resume: {run}/config.yaml unreadable ({e}); cannot tell what the run trained") from None
    new = cfg.to_dict()
    changed = [f for f in diff_fields(old if isinstance(old, dict) else {}, new) if not _covered(f, ALWAYS_ALLOWED)]
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


def write_config(run: Path, cfg: Config) -> None:
    """``<run>/config.yaml`` (atomically): what the next ``--resume`` is compared against."""
    if not dist.is_main():
        return
    run.mkdir(parents=True, exist_ok=True)
    tmp = run / f".config.yaml.{os.getpid()}.tmp"
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, run / "config.yaml")


def metrics_size(folder: Path) -> int:
    """Length of ``<folder>/metrics.jsonl`` now: saved with each checkpoint, so a resume can
    drop what was logged after it (those steps are logged again)."""
    p = folder / "metrics.jsonl"
    return p.stat().st_size if p.exists() else 0


def rewind_metrics(folder: Path, size: int | None) -> None:
    """Cut ``metrics.jsonl`` back to ``size`` bytes (None: unknown, leave it)."""
    p = folder / "metrics.jsonl"
    if size is None or not dist.is_main() or not p.exists() or p.stat().st_size <= size:
        return
    with open(p, "r+b") as f:
        f.truncate(size)
