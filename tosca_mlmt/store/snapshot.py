"""Writing and reading one snapshot: a folder ``<root>/<id>/`` of episodes, turns and manifest.

A snapshot is a folder ``<root>/<id>/`` holding ``episodes.parquet`` (one row per
episode), ``turns.parquet`` (one row per turn, token ids and logprobs included) and
``manifest.json`` (provenance, row counts, each data file's value digest, size and sha256).
What the id stands for is in ``manifest``, how a folder is checked in ``verify``.

Folders are built under ``<root>/.tmp-<pid>-<rand>`` and renamed into place in one step:
a reader never sees a half-written snapshot, an existing snapshot is never overwritten,
and a writer that loses a race to an identical snapshot checks the winner's and succeeds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tosca_mlmt.errors import SnapshotError
from tosca_mlmt.fsutil import MIN_FREE_BYTES, ensure_space, fsync_tree, no_space_is_clear, sha256_file
from tosca_mlmt.records import Episode
from tosca_mlmt.store.manifest import DATA_FILES, build_manifest, manifest_sha, read_manifest
from tosca_mlmt.store.tables import (content_entry, episodes_to_tables, read_tables, tables_to_episodes,
                                     with_snapshot_id)
from tosca_mlmt.store.verify import check_snapshot, verify_snapshot

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


# ------------------------------------------------------------------ write


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_tmp(root: Path) -> int:
    """Remove build folders left by a killed writer (its pid is gone). Returns how many."""
    n = 0
    for d in root.glob(".tmp-*"):
        try:
            pid = int(d.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if not _pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            n += 1
    return n


def write_snapshot(root: str | Path, episodes: list[Episode], manifest: dict) -> tuple[str, bool]:
    """Write atomically; returns (id, created). ``created`` is False when an identical
    snapshot already existed (it is verified and left untouched)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(root)
    tmp = root / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tables = dict(zip(DATA_FILES, episodes_to_tables(episodes)))
        files = {f: content_entry(t) for f, t in tables.items()}  # the values the id stands for
        m = build_manifest(manifest, files, {"episodes": tables["episodes.parquet"].num_rows,
                                             "turns": tables["turns.parquet"].num_rows})
        sid = m["id"]
        # parquet is smaller than the tables in memory: room for those is room for the files (a full disk is a
        # clear error before the write, not an OSError after every episode was generated)
        needed = MIN_FREE_BYTES + sum(t.nbytes for t in tables.values())
        ensure_space(root, needed)
        with no_space_is_clear(root, needed):
            for f, t in tables.items():
                pq.write_table(with_snapshot_id(t, sid), tmp / f)
        m["stored_files"] = {f: {"sha256": sha256_file(tmp / f), "bytes": (tmp / f).stat().st_size} for f in DATA_FILES}
        m["manifest_sha256"] = manifest_sha(m)
        with open(tmp / "manifest.json", "w") as f:
            json.dump(m, f, indent=2, sort_keys=True)
        fsync_tree(tmp)  # the data files too: a manifest that survives a power cut vouches for them
        final = root / sid
        if _publish(tmp, final):
            fsync_tree(root, recursive=False)
            return sid, True
        problems = verify_snapshot(final)
        if problems:
            raise SnapshotError(f"snapshot {sid}: already exists under {root} but is damaged ({problems[0]}); "
                                f"delete that folder to write it again")
        return sid, False
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, final: Path) -> bool:
    """Rename the build folder into place; False when a snapshot of that id is already there."""
    if final.exists():
        return False
    try:
        os.rename(tmp, final)  # atomic on one filesystem; refuses to replace a non-empty folder
    except OSError:
        if final.exists():  # another writer of the same content renamed first
            return False
        raise
    return True


# ------------------------------------------------------------------ read


def snapshot_path(root: str | Path, sid: str) -> Path:
    if not isinstance(sid, str) or not _ID_RE.fullmatch(sid):
        raise SnapshotError(f"{sid!r} is not a snapshot id")
    p = Path(root) / sid
    if not (p / "manifest.json").is_file():
        raise SnapshotError(f"no snapshot '{sid}' under {root}")
    return p


@dataclass
class Snapshot:
    path: Path
    manifest: dict

    @property
    def id(self) -> str:
        return self.manifest["id"]

    def tables(self) -> tuple[pa.Table, pa.Table]:
        """Episodes and turns, each with a last ``snapshot_id`` column: the files' own (verified to
        be the id), or for snapshots written before the files carried it, added here, so rows
        concatenated from several snapshots of any age say where they came from."""
        try:
            tables = read_tables(self.path)
        except (OSError, pa.ArrowException, ValueError) as e:
            raise SnapshotError(f"snapshot {self.path.name}: unreadable data ({type(e).__name__}: {e})") from None
        return tuple(with_snapshot_id(t, self.id) for t in tables)

    def episodes(self) -> list[Episode]:
        tables = self.tables()
        try:
            return tables_to_episodes(*tables)
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a forged or foreign file
            raise SnapshotError(f"snapshot {self.path.name}: malformed rows ({type(e).__name__}: {e})") from None


def load_snapshot(root: str | Path, sid: str, verify: bool = True) -> Snapshot:
    """The snapshot ``sid`` under ``root``; with ``verify`` its sizes, hashes and id are
    checked first (SnapshotError naming the problem), so nothing damaged or edited is read."""
    p = snapshot_path(root, sid)
    m = read_manifest(p)
    if verify:
        check_snapshot(p)
    return Snapshot(p, m)
