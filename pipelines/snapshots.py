"""``mlmt snapshots`` and ``mlmt setup``: the small commands that inspect snapshots or prepare
the model cache, kept here so that the CLI reaches the library only through pipelines/."""

from __future__ import annotations

from pathlib import Path

from tosca_mlmt.models.loading import resolve_model
from tosca_mlmt.snapshot import (list_snapshots, load_snapshot, read_manifest, snapshot_path, summary_line,
                                 verify_snapshot)


def prepare_model(name: str) -> Path:
    """The model's folder in the cache, converting the embedded model there on first use."""
    return resolve_model(name)


def summary_lines(root: Path) -> list[str]:
    """One line per snapshot under ``root``: id, created, task/split, episodes, accuracies."""
    return [summary_line(m) for m in list_snapshots(root)]


def manifest(root: Path, sid: str) -> dict:
    """The snapshot's manifest, unverified: this is how a damaged snapshot is inspected."""
    return load_snapshot(root, sid, verify=False).manifest


def problems(root: Path, sid: str) -> list[str]:
    """Every size/hash/id mismatch of the snapshot (empty when it is whole). A manifest that
    cannot be parsed raises instead: that is an error, not a verdict."""
    path = snapshot_path(root, sid)
    read_manifest(path)
    return verify_snapshot(path)
