"""What ``mlmt analyze`` reads: run folders, snapshot folders and snapshot ids (read-only).

A run folder has ``metrics.jsonl`` and/or ``snapshots/``; its files are found at any depth
(a joint run nests its stages), snapshots by their folder name ``snap-<hash>`` (ids are
content hashes, and the folder is named by its id), eval folders (``mlmt eval --out``) by
their ``eval.json``. Every snapshot's manifest is read
first, so an unknown format version is refused before any data is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tosca_mlmt.analysis.headline import EvalInput
from tosca_mlmt.errors import MlmtError, SnapshotError
from tosca_mlmt.samples import BONUS_KEYS
from tosca_mlmt.store import find_snapshot_dirs, matching_ids, read_manifest, resolve_snapshot

# ``snapshot_id`` is the name Snapshot.tables() gives the id (added on read: see there);
# ``snapshot`` holds the same id, under the name the report's tables group by.
TURN_COLUMNS = ["snapshot", "episode_id", "problem_id", "turn_index", "round", "role", "kind", "reward", "correct",
                "response_len", "strategy_name", "snapshot_id"]


@dataclass
class Sources:
    metrics: dict[str, Path] = field(default_factory=dict)  # run label -> metrics.jsonl
    snapshots: dict[str, tuple[Path, dict]] = field(default_factory=dict)  # id -> (folder, manifest)
    evals: list[Path] = field(default_factory=list)  # folders holding an eval.json, in argument order


def _visible(path: Path, under: Path) -> bool:
    """Skips hidden folders, among them snapshot builds in progress (``.tmp-*``)."""
    return not any(part.startswith(".") for part in path.relative_to(under).parts)


def _is_run(path: Path) -> bool:
    return (path / "metrics.jsonl").exists() or (path / "snapshots").is_dir()


def _add_snapshot(src: Sources, folder: Path) -> None:
    m = read_manifest(folder)  # raises SnapshotError naming the folder for an unknown version
    m.setdefault("id", folder.name)
    src.snapshots.setdefault(m["id"], (folder, m))  # same id = same content: read once


def _add_run(src: Sources, run: Path) -> None:
    name = run.resolve().name
    metrics = sorted(p for p in run.rglob("metrics.jsonl") if _visible(p, run))
    snaps = sorted(p.parent for p in run.rglob("snap-*/manifest.json") if _visible(p, run))
    if not metrics and not snaps:
        raise MlmtError(f"{run}: holds neither a metrics.jsonl nor snapshots")
    for p in metrics:
        if p.resolve() in {q.resolve() for q in src.metrics.values()}:
            continue  # the same run given twice
        rel = p.parent.relative_to(run)
        label = name if rel == Path(".") else f"{name}/{rel}"
        # Runs in different places can share a folder name; the full path tells them apart.
        src.metrics[str(p.parent) if label in src.metrics else label] = p
    evals = sorted(p for p in run.rglob("eval.json") if _visible(p, run))
    controls = {_control_id(p) for p in evals}
    for folder in snaps:
        if folder.name not in controls:
            _add_snapshot(src, folder)
    for p in evals:
        if p.parent.resolve() not in {e.resolve() for e in src.evals}:
            src.evals.append(p.parent)


def _control_id(eval_json: Path) -> str | None:
    """The snapshot of an eval's controls (``mlmt eval --majority/--resample``: sampled turn-1 answers,
    no feedback), left out of a run folder's snapshots: it is no held-out eval of the pair. Given by
    its id, it is read like any snapshot."""
    try:
        report = json.loads(eval_json.read_text())
    except (OSError, ValueError):
        return None  # read_evals names a broken eval.json
    controls = report.get("controls") if isinstance(report, dict) else None
    return controls.get("snapshot_id") if isinstance(controls, dict) else None


def resolve(args: list[str], root: Path) -> Sources:
    """Each argument: a run folder, a snapshot folder, or a snapshot id or unique id prefix at any
    depth under ``root``."""
    src = Sources()
    for arg in args:
        p = Path(arg)
        if p.is_dir() and (p / "manifest.json").exists() and not _is_run(p):
            _add_snapshot(src, p)
        elif p.is_dir():
            _add_run(src, p)
        elif root.is_dir() and matching_ids(find_snapshot_dirs(root), arg):
            _add_snapshot(src, resolve_snapshot(root, arg))  # an ambiguous prefix raises, naming the candidates
        else:
            raise MlmtError(f"'{arg}' is not a run folder, a snapshot folder, or a snapshot id under {root}")
    return src


# ---------------------------------------------------------------------- metrics


def read_metrics(runs: dict[str, Path]) -> pd.DataFrame:
    """One row per record of every metrics.jsonl, with ``run`` and ``line`` (1-based)."""
    rows = []
    for run, path in runs.items():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                if i == len(lines):  # a run killed mid-write leaves a torn last line: not an error
                    continue
                raise MlmtError(f"{path}:{i}: not valid JSON ({e})") from None
            rows.append({**rec, "run": run, "line": i})
    return pd.DataFrame(rows, columns=None if rows else ["run", "line"])


def read_evals(src: Sources) -> list[EvalInput]:
    """Each eval folder's eval.json, with its snapshot's creation time (which orders before and after)."""
    out = []
    for folder in src.evals:
        path = folder / "eval.json"
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise MlmtError(f"{path}: unreadable ({e})") from None
        if not isinstance(report, dict) or not isinstance(report.get("snapshot_id"), str):
            raise MlmtError(f"{path}: has no snapshot_id (not written by mlmt eval)")
        snap = src.snapshots.get(report["snapshot_id"])
        out.append(EvalInput(str(folder), report, snap[1].get("created_at", "") if snap else ""))
    return out


# ---------------------------------------------------------------------- snapshots


def _turns_v1(folder: Path) -> pd.DataFrame:
    cols = ["episode_id", "problem_id", "turn_index", "round", "role", "kind", "response_ids", "reward", "correct",
            "strategy_name"]
    t = pq.read_table(folder / "turns.parquet", columns=cols)
    # Lengths only: the token ids themselves are the bulk of a snapshot and are not needed.
    t = t.append_column("response_len", pc.fill_null(pc.list_value_length(t["response_ids"]), 0))
    df = t.drop_columns(["response_ids"]).to_pandas()
    df["correct"] = df["correct"].eq(True)  # writer turns have no verdict (null)
    return df


# One reader per supported snapshot format version, each returning TURN_COLUMNS (less
# ``snapshot`` and ``snapshot_id``); tests check that every version in store.manifest.SUPPORTED_VERSIONS has one.
TURN_READERS = {1: _turns_v1, 2: _turns_v1, 3: _turns_v1, 4: _turns_v1}  # 2-4 changed the manifest, not the tables


def read_turns(snapshots: dict[str, tuple[Path, dict]]) -> pd.DataFrame:
    frames = []
    for sid, (folder, m) in snapshots.items():
        reader = TURN_READERS.get(m["format_version"])
        if reader is None:
            raise SnapshotError(f"{folder}: mlmt analyze cannot read snapshot format version "
                                f"{m['format_version']!r} yet (it reads {', '.join(map(str, TURN_READERS))})")
        try:
            frames.append(reader(folder).assign(snapshot=sid, snapshot_id=sid))
        except (OSError, pa.ArrowException) as e:
            raise SnapshotError(f"{folder}: unreadable snapshot data ({e})") from None
    return pd.concat(frames, ignore_index=True)[TURN_COLUMNS] if frames else pd.DataFrame(columns=TURN_COLUMNS)


def read_episode_texts(snapshots: dict[str, tuple[Path, dict]], picks: list[tuple[str, str]]) -> list[dict]:
    """The problem and every turn's text of the (snapshot id, episode id) pairs in ``picks``, for
    the report's sample episodes: {"snapshot", "episode_id", "question", "answer", "turns": [{"role",
    "kind", "round", "strategy_name", "correct", "text", "bonus", "bonus_raw"}]}; the bonus keys
    are a refine's context bonus as train-lower stored it in ``info`` (None elsewhere). Only these
    episodes' rows are kept."""
    out = []
    for sid, eid in picks:
        folder = snapshots[sid][0]
        try:
            ep = pq.read_table(folder / "episodes.parquet", columns=["episode_id", "question", "answer"],
                               filters=[("episode_id", "=", eid)]).to_pylist()
            turns = pq.read_table(folder / "turns.parquet", filters=[("episode_id", "=", eid)],
                                  columns=["turn_index", "round", "role", "kind", "strategy_name", "correct",
                                           "text", "info"]).to_pylist()
        except (OSError, pa.ArrowException) as e:
            raise SnapshotError(f"{folder}: unreadable snapshot data ({e})") from None
        for t in turns:
            info = json.loads(t.pop("info") or "{}")
            t.update({k: info.get(k) for k in BONUS_KEYS})
        if ep:
            out.append({"snapshot": sid, "episode_id": eid, "question": ep[0]["question"], "answer": ep[0]["answer"],
                        "turns": sorted(turns, key=lambda t: t["turn_index"])})
    return out
