"""``mlmt snapshots`` and ``mlmt setup``: the small commands that inspect snapshots or prepare
the model cache, kept here so that the CLI reaches the library only through pipelines/.

Snapshots are found at any depth under ``--root`` and named by a unique id prefix
(tosca_mlmt/store/index.py), so a run folder can be given as the root."""

from __future__ import annotations

from pathlib import Path

from tosca_mlmt.models.loading import resolve_model
from tosca_mlmt.samples import LOGGED_EXTRAS, bonus_text, episode_record, select  # noqa: F401 (the first two: for cli/)
from tosca_mlmt.store import (environment_of, open_snapshot, read_manifest, resolve_snapshot, row_line, snapshot_rows,
                              terminal_safe, verify_snapshot)  # noqa: F401 (terminal_safe: for cli/)


def prepare_environment(name: str) -> tuple[Path, str | None]:
    """What ``mlmt setup`` prepares: the model's folder in the cache (the embedded model converted
    there on first use), and DeepSpeed's CPU comm op built where it applies (its folder, else None)."""
    from tosca_mlmt.train.distributed import prebuild_deepspeed_ops

    return resolve_model(name), prebuild_deepspeed_ops()


def summary_lines(root: Path) -> list[str]:
    """One line per snapshot at any depth under ``root``: id, kind, environment, episodes, created, folder;
    control characters escaped (store.terminal_safe)."""
    return [row_line(r) for r in snapshot_rows(root)]


def manifest(root: Path, ref: str) -> dict:
    """The snapshot's manifest, unverified: this is how a damaged snapshot is inspected."""
    return open_snapshot(root, ref, verify=False).manifest


def problems(root: Path, ref: str) -> tuple[str, list[str]]:
    """The snapshot's full id and every size/hash/id mismatch (empty when it is whole). A
    manifest that cannot be parsed raises instead: that is an error, not a verdict."""
    path = resolve_snapshot(root, ref)
    read_manifest(path)
    return terminal_safe(path.name), [terminal_safe(p) for p in verify_snapshot(path)]


def episode_records(root: Path, ref: str, n: int, which: str | None = None,
                    verify: bool = True) -> tuple[dict, list[dict]]:
    """The snapshot's id, kind and environment, and its first ``n`` episodes passing ``which``
    (samples.FILTERS), decoded for reading (samples.episode_record)."""
    snap = open_snapshot(root, ref, verify=verify)
    head = {"id": snap.id, "kind": str(snap.manifest.get("kind") or "?"), "environment": environment_of(snap.manifest)}
    head = {k: terminal_safe(v) for k, v in head.items()}  # from a manifest anyone can edit
    return head, [episode_record(ep) for ep in select(snap.episodes(), n, which)]
