"""Immutable, content-addressed dataset snapshots of episodes.

A snapshot is a folder ``<root>/<id>/`` holding ``episodes.parquet`` (one row per
episode), ``turns.parquet`` (one row per turn, token ids and logprobs included) and
``manifest.json`` (provenance, row counts, each data file's value digest, size and sha256).

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

The ``snapshot_id`` column: both data files carry the id in a last ``snapshot_id`` column, so
rows read from several snapshots by any parquet reader say where they came from. A file
cannot hold a hash of itself, so the id covers the tables without that column: ``files`` in the
manifest holds each table's value digest (``snapshot_tables.content_entry``: column names, types
and values, independent of the parquet encoding), and ``stored_files`` (outside the id, under
``manifest_sha256``) the files as stored. ``verify`` checks the stored bytes, that every
``snapshot_id`` value is the manifest's id (an edited or copied value is a problem), and that the
tables read back without that column give the digests (an edit of the data is a problem even
when ``stored_files`` was rewritten to match). Format 2 re-encoded the tables with pyarrow's
parquet writer instead: a pyarrow that encodes differently from the one that wrote such a
snapshot (``packages.pyarrow``) cannot confirm it, and the problem says so. Snapshots without
``stored_files`` (written before the column) are verified as before.

Folders are built under ``<root>/.tmp-<pid>-<rand>`` and renamed into place in one step:
a reader never sees a half-written snapshot, an existing snapshot is never overwritten,
and a writer that loses a race to an identical snapshot checks the winner's and succeeds.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import shutil
import unicodedata
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tosca_mlmt.errors import SnapshotError
from tosca_mlmt.fsutil import MIN_FREE_BYTES, ensure_space, fsync_tree, no_space_is_clear, sha256_file
from tosca_mlmt.records import Episode
from tosca_mlmt.snapshot_tables import (SNAPSHOT_ID, canonical_bytes, content_entry, episodes_to_tables, read_tables,
                                        tables_to_episodes, with_snapshot_id, without_snapshot_id)

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
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

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


def _snapshot_id_v1(file_hashes: dict[str, str]) -> str:
    return "snap-" + hashlib.sha256(_canonical({k: file_hashes[k] for k in DATA_FILES})).hexdigest()[:16]


def _manifest_sha(manifest: dict) -> str:
    return hashlib.sha256(_canonical({k: v for k, v in manifest.items() if k != "manifest_sha256"})).hexdigest()


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


def build_manifest(manifest: dict, files: dict[str, dict], rows: dict[str, int]) -> dict:
    """The caller's provenance plus what the format adds; id and manifest hash included."""
    m = dict(manifest)
    m.update(format_version=FORMAT_VERSION, files=files, rows=rows,
             created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    # Hash exactly what a reader will parse back (tuples become lists, paths strings...).
    m = json.loads(json.dumps(m, default=str))
    m["id"] = snapshot_id(m)
    m["manifest_sha256"] = _manifest_sha(m)
    return m


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
        m["manifest_sha256"] = _manifest_sha(m)
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


# ------------------------------------------------------------------ read / verify


def snapshot_path(root: str | Path, sid: str) -> Path:
    if not isinstance(sid, str) or not _ID_RE.fullmatch(sid):
        raise SnapshotError(f"{sid!r} is not a snapshot id")
    p = Path(root) / sid
    if not (p / "manifest.json").is_file():
        raise SnapshotError(f"no snapshot '{sid}' under {root}")
    return p


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
    if m.get("manifest_sha256") != _manifest_sha(m):
        problems.append("manifest.json: content does not match its manifest_sha256 (edited or corrupted)")
    on_disk = m.get("stored_files", m["files"])  # stored_files: the files carry a snapshot_id column
    problems += [p for name in DATA_FILES if (p := _file_problem(path, name, on_disk[name], v))]
    if "stored_files" in m and not problems:  # only intact files are parsed
        problems += [p for name in DATA_FILES if (p := _canonical_problem(path, name, m))]
    want_id = _snapshot_id_v1(m["files"]) if v == 1 else snapshot_id(m)
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


def list_snapshots(root: str | Path) -> list[dict]:
    root = Path(root)
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if d.is_dir() and not d.name.startswith(".") and (d / "manifest.json").exists():
            try:
                out.append(read_manifest(d))
            except SnapshotError as e:
                out.append({"id": d.name, "error": str(e)})
    return sorted(out, key=lambda m: str(m.get("created_at", "")))


def terminal_safe(value, keep_newlines: bool = False) -> str:
    """``str(value)`` with control characters (ESC and the other C0/C1 codes, DEL, bidi overrides,
    line and paragraph separators) written as escapes (``\\x1b``, ``\\u202e``): a manifest, a folder
    name or a text can be edited by anyone, and printed raw its escape codes would repaint the terminal
    or hide what is listed. ``keep_newlines`` keeps ``\\n`` and ``\\t`` (multi-line texts)."""
    text = str(value)
    if text.isprintable():
        return text
    keep = "\n\t" if keep_newlines else ""
    return "".join(ch if ch.isprintable() and unicodedata.category(ch) != "Cf" or ch in keep or ch == " "
                   else ch.encode("unicode_escape").decode("ascii") for ch in text)


def summary_line(m: dict) -> str:
    """One line for ``mlmt snapshots list``: id, created, task/split, episodes, accuracies.
    Any field may be missing or odd (old or hand-made manifests): shown as '?'."""
    return terminal_safe(_summary_line(m))


def _summary_line(m: dict) -> str:
    if "error" in m:
        return f"{m.get('id')}  ERROR {m['error']}"

    def get(*keys):
        v = m
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        return "?" if v is None else v

    def num(*keys):
        v = get(*keys)
        return f"{v:.3f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "?"

    return (f"{m.get('id')}  {get('created_at')}  {get('task', 'name')}/{get('task', 'split')}  "
            f"episodes={get('rows', 'episodes')}  acc_t1={num('summary', 'acc_t1')}  "
            f"acc_final={num('summary', 'acc_final')}")
