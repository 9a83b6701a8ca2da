"""Checking a snapshot folder against its manifest: sizes, hashes, the id and the ``snapshot_id`` column.

The ``snapshot_id`` column: both data files carry the id in a last ``snapshot_id`` column, so
rows read from several snapshots by any parquet reader say where they came from. A file
cannot hold a hash of itself, so the id covers the tables without that column: ``files`` in the
manifest holds each table's value digest (``tables.content_entry``: column names, types
and values, independent of the parquet encoding), and ``stored_files`` (outside the id, under
``manifest_sha256``) the files as stored. ``verify`` checks the stored bytes, that every
``snapshot_id`` value is the manifest's id (an edited or copied value is a problem), and that the
tables read back without that column give the digests (an edit of the data is a problem even
when ``stored_files`` was rewritten to match). Format 2 re-encoded the tables with pyarrow's
parquet writer instead: a pyarrow that encodes differently from the one that wrote such a
snapshot (``packages.pyarrow``) cannot confirm it, and the problem says so. Snapshots without
``stored_files`` (written before the column) are verified as before.

Kept apart from the manifest because this is the part that reads the data files (pyarrow).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tosca_mlmt.errors import SnapshotError
from tosca_mlmt.fsutil import sha256_file
from tosca_mlmt.store.manifest import DATA_FILES, manifest_sha, read_manifest, snapshot_id, snapshot_id_v1
from tosca_mlmt.store.tables import SNAPSHOT_ID, canonical_bytes, content_entry, without_snapshot_id


def _file_problem(path: Path, name: str, want, version: int) -> str | None:
    f = path / name
    if not f.is_file():
        return f"{name}: missing"
    sha = want if version == 1 else want["sha256"]
    if version >= 2 and f.stat().st_size != want["bytes"]:
        return f"{name}: size {f.stat().st_size} bytes, manifest says {want['bytes']} (truncated or replaced)"
    try:
        got = sha256_file(f)
    except OSError as e:
        return f"{name}: unreadable ({e.strerror})"
    return None if got == sha else f"{name}: sha256 mismatch (file changed since it was written)"


def _canonical_problem(path: Path, name: str, m: dict) -> str | None:
    """Whether a stored file holds the id and, without that column, the content the id hashes:
    its values (format 3), or its parquet re-encoding (format 2, tied to the writer's pyarrow)."""
    try:
        t = pq.read_table(path / name)
        got = (content_entry(without_snapshot_id(t))["sha256"] if m["format_version"] >= 3
               else hashlib.sha256(canonical_bytes(t)).hexdigest())
    except (OSError, pa.ArrowException, ValueError, TypeError) as e:
        return f"{name}: unreadable ({type(e).__name__}: {e})"
    if SNAPSHOT_ID not in t.column_names:
        return f"{name}: has no {SNAPSHOT_ID} column, but the manifest lists stored_files"
    others = sorted(set(t[SNAPSHOT_ID].unique().to_pylist()) - {m["id"]}, key=str)
    if others:
        return f"{name}: its {SNAPSHOT_ID} column says {', '.join(map(str, others[:3]))}, not {m['id']} (edited or copied)"
    if got != m["files"][name]["sha256"]:
        if m["format_version"] >= 3:
            return f"{name}: its data without the {SNAPSHOT_ID} column does not hash to the id's content (edited)"
        wrote = (m.get("packages") or {}).get("pyarrow", "?") if isinstance(m.get("packages"), dict) else "?"
        return (f"{name}: its data without the {SNAPSHOT_ID} column does not hash to the id's content (edited; or "
                f"this pyarrow {pa.__version__} encodes parquet unlike the writer's {wrote})")
    return None


def verify_snapshot(path: Path) -> list[str]:
    """Re-hash everything; returns a list of problems (empty = intact)."""
    try:
        m = read_manifest(path)
    except SnapshotError as e:
        return [str(e)]
    v = m["format_version"]
    problems = []
    if m.get("manifest_sha256") != manifest_sha(m):
        problems.append("manifest.json: content does not match its manifest_sha256 (edited or corrupted)")
    on_disk = m.get("stored_files", m["files"])  # stored_files: the files carry a snapshot_id column
    problems += [p for name in DATA_FILES if (p := _file_problem(path, name, on_disk[name], v))]
    if "stored_files" in m and not problems:  # only intact files are parsed
        problems += [p for name in DATA_FILES if (p := _canonical_problem(path, name, m))]
    want_id = snapshot_id_v1(m["files"]) if v == 1 else snapshot_id(m)
    if v >= 2 and want_id != m["id"]:
        problems.append(f"manifest.json: id {m['id']} does not match its content (manifest edited)")
    elif v == 1 and not problems and want_id != m["id"]:
        problems.append(f"id {m['id']} does not match the data hashes")
    if path.name != m["id"]:
        problems.append(f"folder name {path.name} differs from manifest id {m['id']}")
    return problems


def check_snapshot(path: Path) -> None:
    """Raise SnapshotError naming the snapshot and its first problem, if it has any."""
    problems = verify_snapshot(path)
    if problems:
        more = f" (+{len(problems) - 1} more; see mlmt snapshots verify)" if len(problems) > 1 else ""
        first = problems[0]
        prefix = "" if first.startswith(f"snapshot {path.name}:") else f"snapshot {path.name}: "
        raise SnapshotError(f"{prefix}{first}{more}; pass --no-verify to read it anyway")
