"""Immutable, content-addressed dataset snapshots of episodes.

A snapshot is a folder ``<root>/<id>/`` holding ``episodes.parquet`` (one row per
episode), ``turns.parquet`` (one row per turn, token ids and logprobs included) and
``manifest.json`` (provenance). The id is a hash of the data files only, so the same
episodes always get the same id. Folders are built under ``<root>/.tmp-<pid>-<rand>``
and renamed into place in one step: a reader never sees a half-written snapshot, and
an existing snapshot is never overwritten.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tosca_mlmt.episode import Episode, Turn
from tosca_mlmt.errors import SnapshotError
from tosca_mlmt.tasks.base import Problem

FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
DATA_FILES = ("episodes.parquet", "turns.parquet")

EPISODE_SCHEMA = pa.schema([
    ("episode_id", pa.string()), ("problem_id", pa.string()), ("task", pa.string()), ("split", pa.string()),
    ("sample", pa.int32()), ("question", pa.string()), ("answer", pa.string()), ("problem_meta", pa.string()),
    ("r1", pa.float64()), ("r_final", pa.float64()), ("rewards", pa.list_(pa.float64())),
    ("strategies", pa.list_(pa.int32())), ("strategy_names", pa.list_(pa.string())), ("n_turns", pa.int32()),
])
TURN_SCHEMA = pa.schema([
    ("episode_id", pa.string()), ("problem_id", pa.string()), ("turn_index", pa.int32()), ("round", pa.int32()),
    ("role", pa.string()), ("kind", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())), ("logprobs", pa.list_(pa.float32())), ("finish_reason", pa.string()),
    ("text", pa.string()), ("reward", pa.float64()), ("correct", pa.bool_()), ("extracted", pa.string()),
    ("info", pa.string()), ("strategy", pa.int32()), ("strategy_name", pa.string()),
    ("behaviour_prob", pa.float64()), ("behaviour_probs", pa.list_(pa.float64())),
    ("q_values", pa.list_(pa.float64())), ("state_len", pa.int32()),
])
_TURN_FIELDS = [f.name for f in TURN_SCHEMA if f.name not in ("episode_id", "problem_id", "turn_index", "info")]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def snapshot_id(file_hashes: dict[str, str]) -> str:
    return "snap-" + hashlib.sha256(_canonical({k: file_hashes[k] for k in DATA_FILES})).hexdigest()[:16]


# ------------------------------------------------------------------ episodes <-> tables


def episodes_to_tables(episodes: list[Episode]) -> tuple[pa.Table, pa.Table]:
    ep_rows, turn_rows = [], []
    for ep in episodes:
        fbs = [t for t in ep.turns if t.kind == "feedback"]
        p = ep.problem
        ep_rows.append(dict(
            episode_id=ep.episode_id, problem_id=p.id, task=p.task, split=p.split, sample=ep.sample,
            question=p.question, answer=p.answer, problem_meta=p.meta_json(), r1=ep.r1, r_final=ep.r_final,
            rewards=[t.reward for t in ep.solver_turns], strategies=[t.strategy for t in fbs],
            strategy_names=[t.strategy_name for t in fbs], n_turns=len(ep.turns)))
        for t in ep.turns:
            row = {k: getattr(t, k) for k in _TURN_FIELDS}
            row.update(episode_id=ep.episode_id, problem_id=p.id, turn_index=t.index,
                       info=json.dumps(t.info, sort_keys=True, default=str))
            turn_rows.append(row)
    return (pa.Table.from_pylist(ep_rows, schema=EPISODE_SCHEMA),
            pa.Table.from_pylist(turn_rows, schema=TURN_SCHEMA))


def tables_to_episodes(ep_table: pa.Table, turn_table: pa.Table) -> list[Episode]:
    by_ep: dict[str, list[Turn]] = {}
    for r in turn_table.to_pylist():
        info = json.loads(r.pop("info") or "{}")
        eid, _pid, idx = r.pop("episode_id"), r.pop("problem_id"), r.pop("turn_index")
        by_ep.setdefault(eid, []).append(Turn(index=idx, info=info, **r))
    out = []
    for r in ep_table.to_pylist():
        p = Problem(r["task"], r["problem_id"], r["question"], r["answer"], r["split"], json.loads(r["problem_meta"]))
        out.append(Episode(r["episode_id"], p, r["sample"], sorted(by_ep.get(r["episode_id"], []), key=lambda t: t.index)))
    return out


# ------------------------------------------------------------------ write / read / verify


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
    snapshot already existed (it is left untouched)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(root)
    tmp = root / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        ep_t, turn_t = episodes_to_tables(episodes)
        pq.write_table(ep_t, tmp / "episodes.parquet")
        pq.write_table(turn_t, tmp / "turns.parquet")
        hashes = {f: sha256_file(tmp / f) for f in DATA_FILES}
        sid = snapshot_id(hashes)
        m = dict(manifest)
        m.update(format_version=FORMAT_VERSION, id=sid, files=hashes,
                 created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                 rows={"episodes": ep_t.num_rows, "turns": turn_t.num_rows})
        m["manifest_sha256"] = hashlib.sha256(_canonical(m)).hexdigest()
        with open(tmp / "manifest.json", "w") as f:
            json.dump(m, f, indent=2, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        final = root / sid
        if final.exists():
            return sid, False
        os.rename(tmp, final)  # atomic on one filesystem; fails rather than overwrite a non-empty dir
        return sid, True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def snapshot_path(root: str | Path, sid: str) -> Path:
    p = Path(root) / sid
    if not (p / "manifest.json").exists():
        raise SnapshotError(f"no snapshot '{sid}' under {root}")
    return p


def read_manifest(path: Path) -> dict:
    try:
        m = json.loads((path / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SnapshotError(f"{path}/manifest.json: unreadable ({e})") from None
    v = m.get("format_version")
    if v not in SUPPORTED_VERSIONS:
        raise SnapshotError(f"{path}: snapshot format version {v!r} is not supported by this tosca-mlmt "
                            f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))}); upgrade tosca-mlmt")
    return m


def verify_snapshot(path: Path) -> list[str]:
    """Re-hash everything; returns a list of problems (empty = intact)."""
    problems = []
    try:
        m = read_manifest(path)
    except SnapshotError as e:
        return [str(e)]
    claimed = m.pop("manifest_sha256", None)
    if claimed != hashlib.sha256(_canonical(m)).hexdigest():
        problems.append("manifest.json: content does not match its manifest_sha256 (edited or corrupted)")
    for name, want in m.get("files", {}).items():
        f = path / name
        if not f.exists():
            problems.append(f"{name}: missing")
        elif sha256_file(f) != want:
            problems.append(f"{name}: sha256 mismatch (file changed since it was written)")
    if not problems and snapshot_id(m["files"]) != m.get("id"):
        problems.append(f"id {m.get('id')} does not match the data hashes")
    if path.name != m.get("id"):
        problems.append(f"folder name {path.name} differs from manifest id {m.get('id')}")
    return problems


@dataclass
class Snapshot:
    path: Path
    manifest: dict

    @property
    def id(self) -> str:
        return self.manifest["id"]

    def tables(self) -> tuple[pa.Table, pa.Table]:
        return pq.read_table(self.path / "episodes.parquet"), pq.read_table(self.path / "turns.parquet")

    def episodes(self) -> list[Episode]:
        return tables_to_episodes(*self.tables())


def load_snapshot(root: str | Path, sid: str) -> Snapshot:
    p = snapshot_path(root, sid)
    return Snapshot(p, read_manifest(p))


def list_snapshots(root: str | Path) -> list[dict]:
    root = Path(root)
    out = []
    for d in sorted(root.iterdir()) if root.exists() else []:
        if d.is_dir() and not d.name.startswith(".") and (d / "manifest.json").exists():
            try:
                out.append(read_manifest(d))
            except SnapshotError as e:
                out.append({"id": d.name, "error": str(e)})
    return sorted(out, key=lambda m: m.get("created_at", ""))
