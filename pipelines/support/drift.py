"""Resume trust: what a ``--resume`` may change, and what a command that uses a trained run is
warned about. Kept apart from the run folder (``rundir.py``) because it is a question about two
configs, not about files: the folder asks it once, when a run is continued.

Drift: a resumed run must train the same thing, so any config field that differs from the
run's ``config.yaml`` is refused, named with its old and new value. ``logging.*`` may always
change (it only decides what is shown and where). A few more fields are safe but change what
the run does, so they need ``--allow-drift FIELD``: checkpoint/log/eval periods and the run's
length, which may only grow (the data of step i is a pure function of the seed and i, so a
longer run extends the shorter one exactly). A field the run's ``config.yaml`` lacks (written
before the knob existed) counts as what that version did, its default or its BEFORE_KNOB value, with a
warning naming it.

The same comparison serves the commands that use a trained run (``eval``/``chat``/``export --run``):
they start from the run's ``config.yaml`` and only warn, naming each field ``-c``/``--set`` changed
from what training used, but those of ``USE_SAFE`` (where and how the command runs).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import yaml

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
# A command that uses a trained run (eval, chat, export --run) starts from the run's config.yaml; these
# fields say where and how it runs (engine, logging, processes, seed, which held-out problems, where
# output goes), not what the policies were trained to do, so changing them draws no drift warning.
USE_SAFE = (*ALWAYS_ALLOWED, "engine", "distributed", "deterministic", "seed", "task.split", "task.limit",
            "task.data_path", "task.skip_bad_rows", "collect.out")


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


def read_run_config(run: Path, flag: str = "--resume") -> tuple[dict, list[str]]:
    """``<run>/config.yaml`` as a dict (what the run trained with) and the dotted fields it predates,
    filled in as the version that wrote it ran them (``_fill_missing``); ``flag`` names the option
    in the error when it cannot be read."""
    try:
        old = yaml.safe_load((run / "config.yaml").read_text())
    except (OSError, yaml.YAMLError) as e:
        raise MlmtError(f"{flag}: {run}/config.yaml unreadable ({e}); cannot tell what the run trained") from None
    old = old if isinstance(old, dict) else {}
    return old, _fill_missing(old, Config().to_dict())


def predates_text(run: Path, flag: str, added: list[str]) -> str:
    """The warning for a run's config.yaml that lacks ``added`` (read_run_config)."""
    return (f"{flag}: {run}/config.yaml predates the fields {', '.join(added)}; each counts as what "
            "the version that wrote the run did (its default, or the value before the knob)")


def drifted(old: dict, new: dict, safe=ALWAYS_ALLOWED) -> list[str]:
    """The dotted fields of ``new`` that differ from ``old`` (a run's config.yaml), but those
    ``safe`` covers (a field or a section of them)."""
    return [f for f in diff_fields(old, new) if not _covered(f, safe)]


def show_drift(old: dict, new: dict, fields) -> str:
    """``fields`` with their old and new values, for a message."""
    return ", ".join(f"{f} ({_get(old, f)!r} -> {_get(new, f)!r})" for f in fields)


def check_drift(run: Path, cfg: Config, stage: str, allow) -> None:
    """Raise MlmtError naming every field of ``cfg`` that differs from ``<run>/config.yaml``
    and may not (``allow`` lists the fields let through, already checked)."""
    old, added = read_run_config(run, "--resume")
    new = cfg.to_dict()
    if added:
        warnings.warn(predates_text(run, "--resume", added), stacklevel=2)
    changed = drifted(old, new)
    show = lambda fields: show_drift(old, new, fields)  # noqa: E731
    unsafe = [f for f in changed if not _covered(f, SAFE_DRIFT[stage])]
    shrunk = [f for f in changed if f in GROW_ONLY and _covered(f, allow) and isinstance(_get(old, f), int)
              and isinstance(_get(new, f), int) and _get(new, f) < _get(old, f)]
    unallowed = [f for f in changed if f not in unsafe and not _covered(f, allow)]
    if unsafe:
        raise MlmtError(f"--resume: the config differs from {run}/config.yaml in {show(unsafe)}; "
                        f"that changes what the run trains: resume with the run's config or choose a new --out")
    if shrunk:
        raise MlmtError(f"--resume: {show(shrunk)}: a run's length may only grow")
    if unallowed:
        flags = " ".join(f"--allow-drift {f}" for f in unallowed)
        raise MlmtError(f"--resume: the config differs from {run}/config.yaml in {show(unallowed)}; "
                        f"safe to change, but say so: pass {flags}")
