"""A snapshot's manifest and the id it carries: what the id stands for, and the shape a reader checks.

Format 3: the id is a hash of everything in the manifest that decides what the data is
and means (the data's value digests, row counts, parents, models, task, seeds, sampling,
strategies, config without its logging and path fields); only informational fields
(creation time, timings, summary, software versions) are left out, so that the same
episodes from the same settings get the same id. Editing a covered field or a data file
breaks the id, which ``verify`` and every reader check. Format 4 (current) is format 3 with the
environment label (``summary.environment``, "honest" or "privileged:<what>") covered too: the rest of
the summary is informational, but that label decides whether readers (``snapshots list``, ``analyze``)
flag the episodes as a privileged control, so an edit of it must break the id. Format 3 snapshots keep
their ids and are verified without it. Format 2 (the same, but ``files``
hashed the tables' parquet bytes, so only a pyarrow encoding like the writer's could confirm
them) and format 1 (id = hash of the data files only) are still read and verified by their
own rules.

Only JSON is handled here: the data files are hashed in ``tables`` and re-checked in ``verify``.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from pathlib import Path

from tosca_mlmt.errors import SnapshotError

FORMAT_VERSION = 4
SUPPORTED_VERSIONS = (1, 2, 3, 4)
DATA_FILES = ("episodes.parquet", "turns.parquet")
# Manifest fields that describe the writing, not the data: left out of the id so that the
# same episodes written again (later, elsewhere, by a newer build) keep their id.
INFORMATIONAL = ("id", "manifest_sha256", "created_at", "timings", "summary", "tosca_mlmt_version", "git_sha",
                 "packages", "stored_files")
# Config fields that say where things live or how they are logged, not what the data is.
LOCATION_FIELDS = ("logging", "collect.out", "upper.snapshot_root", "task.data_path", "task.path",
                   "model.solver_adapter", "model.writer_adapter", "distributed")


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def _without(tree: dict, dotted: tuple[str, ...]) -> dict:
    out = {}
    for k, v in tree.items():
        if k in dotted:
            continue
        inner = tuple(d[len(k) + 1:] for d in dotted if d.startswith(k + "."))
        out[k] = _without(v, inner) if inner and isinstance(v, dict) else v
    return out


def covered_content(manifest: dict) -> dict:
    """The part of a format-2, -3 or -4 manifest that the id stands for. Format 4 adds the environment
    label (``summary.environment``: "honest" or "privileged:<what>", what every reader shows) from the
    otherwise informational summary, so relabelling a privileged snapshot honest changes its id; formats
    2 and 3 are read under their own rules, without it."""
    c = {k: v for k, v in manifest.items() if k not in INFORMATIONAL}
    if isinstance(c.get("config"), dict):
        c["config"] = _without(c["config"], LOCATION_FIELDS)
    summary = manifest.get("summary")
    if _version(manifest) >= 4 and isinstance(summary, dict) and "environment" in summary:
        c["summary"] = {"environment": summary["environment"]}
    return c


def _version(manifest: dict) -> int:
    v = manifest.get("format_version")
    return v if type(v) is int else FORMAT_VERSION


def snapshot_id(manifest: dict) -> str:
    return "snap-" + hashlib.sha256(_canonical(covered_content(manifest))).hexdigest()[:16]


def snapshot_id_v1(file_hashes: dict[str, str]) -> str:
    return "snap-" + hashlib.sha256(_canonical({k: file_hashes[k] for k in DATA_FILES})).hexdigest()[:16]


def manifest_sha(manifest: dict) -> str:
    return hashlib.sha256(_canonical({k: v for k, v in manifest.items() if k != "manifest_sha256"})).hexdigest()


def build_manifest(manifest: dict, files: dict[str, dict], rows: dict[str, int]) -> dict:
    """The caller's provenance plus what the format adds; id and manifest hash included."""
    m = dict(manifest)
    m.update(format_version=FORMAT_VERSION, files=files, rows=rows,
             created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    # Hash exactly what a reader will parse back (tuples become lists, paths strings...).
    m = json.loads(json.dumps(m, default=str))
    m["id"] = snapshot_id(m)
    m["manifest_sha256"] = manifest_sha(m)
    return m


# ------------------------------------------------------------------ read


def _check_files_table(files, version: int, key: str = "files") -> str | None:
    """What is wrong with a manifest's file table ``key``, or None."""
    if not isinstance(files, dict):
        return f"has no file table ('{key}')"
    missing = [f for f in DATA_FILES if f not in files]
    if missing:
        return f"its file table ('{key}') lacks {', '.join(missing)}"
    for name in DATA_FILES:
        e = files[name]
        if version == 1:
            ok = isinstance(e, str)
        else:
            ok = (isinstance(e, dict) and isinstance(e.get("sha256"), str) and type(e.get("bytes")) is int
                  and e["bytes"] >= 0)
        if not ok:
            return f"file table entry for {name} is malformed"
    return None


def read_manifest(path: Path) -> dict:
    """The parsed manifest of the snapshot folder ``path``, checked for shape (not content)."""
    where = f"snapshot {path.name}: manifest.json"
    try:
        m = json.loads((path / "manifest.json").read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SnapshotError(f"{where}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(m, dict):
        raise SnapshotError(f"{where}: not a JSON object (a {type(m).__name__})")
    v = m.get("format_version")
    if type(v) is not int or v not in SUPPORTED_VERSIONS:
        raise SnapshotError(f"snapshot {path.name}: snapshot format version {v!r} is not supported by this "
                            f"tosca-mlmt (supported: {', '.join(map(str, SUPPORTED_VERSIONS))}); upgrade tosca-mlmt")
    if not isinstance(m.get("id"), str):
        raise SnapshotError(f"{where}: has no id")
    bad = _check_files_table(m.get("files"), v)
    if not bad and "stored_files" in m:
        bad = _check_files_table(m["stored_files"], 2, "stored_files")
    if bad:
        raise SnapshotError(f"{where}: {bad}")
    rows = m.get("rows")
    if v >= 2 and not (isinstance(rows, dict) and all(type(rows.get(k)) is int for k in ("episodes", "turns"))):
        raise SnapshotError(f"{where}: row counts ('rows') missing or malformed")
    return m
