"""The ``snapshot_id`` column inside a snapshot's parquet files: the id covers the same tables
without it, verify drops it before re-hashing, a tampered value is a verify problem, and
snapshots written without it (format 2) still read and verify under their old ids. No model."""

import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from factories import make_episodes
from tosca_mlmt.errors import SnapshotError
from tosca_mlmt.fsutil import sha256_file
from tosca_mlmt.store import load_snapshot, verify_snapshot, write_snapshot
from tosca_mlmt.store.manifest import build_manifest, manifest_sha, snapshot_id
from tosca_mlmt.store.tables import content_entry, episodes_to_tables

FILES = ("episodes.parquet", "turns.parquet")
PROVENANCE = {"kind": "collect", "task": {"name": "arith", "split": "train"}, "config": {"seed": 3}}


def write_without_column(root, episodes, provenance):
    """A snapshot as tosca-mlmt wrote them before the column (format 2): plain files, the id over
    their bytes."""
    build = root / "build"
    build.mkdir(parents=True)
    ep_t, turn_t = episodes_to_tables(episodes)
    pq.write_table(ep_t, build / FILES[0])
    pq.write_table(turn_t, build / FILES[1])
    files = {f: {"sha256": sha256_file(build / f), "bytes": (build / f).stat().st_size} for f in FILES}
    m = build_manifest(provenance, files, {"episodes": ep_t.num_rows, "turns": turn_t.num_rows})
    m["format_version"] = 2
    m["id"] = snapshot_id(m)
    m["manifest_sha256"] = manifest_sha(m)
    (build / "manifest.json").write_text(json.dumps(m))
    build.rename(root / m["id"])
    return m["id"]


def _rewrite(folder, name, table):
    """Replace a data file and, as someone who knows the format would, its stored hash and size
    and the manifest's own hash."""
    pq.write_table(table, folder / name)
    m = json.loads((folder / "manifest.json").read_text())
    m["stored_files"][name] = {"sha256": sha256_file(folder / name), "bytes": (folder / name).stat().st_size}
    m["manifest_sha256"] = manifest_sha(m)
    (folder / "manifest.json").write_text(json.dumps(m))


def test_the_id_covers_the_same_tables_without_the_column(tmp_path):
    old = write_without_column(tmp_path / "old", make_episodes(), PROVENANCE)
    new, _ = write_snapshot(tmp_path / "new", make_episodes(), PROVENANCE)
    folder = tmp_path / "new" / new
    m = json.loads((folder / "manifest.json").read_text())
    for f in FILES:
        t = pq.read_table(folder / f)
        assert t.column_names[-1] == "snapshot_id" and set(t["snapshot_id"].to_pylist()) == {new}
        # the id's file table holds the values of the column-less file the older writer wrote
        assert m["files"][f] == content_entry(pq.read_table(tmp_path / "old" / old / f))
        assert m["stored_files"][f]["sha256"] == sha256_file(folder / f)
    # the id is the manifest's covered content with those digests: another format, so another id
    assert new == snapshot_id(m) != old
    assert verify_snapshot(folder) == []


def test_a_snapshot_written_without_the_column_reads_and_verifies_under_its_id(tmp_path):
    sid = write_without_column(tmp_path, make_episodes(), PROVENANCE)
    assert verify_snapshot(tmp_path / sid) == []
    snap = load_snapshot(tmp_path, sid)
    assert snap.id == sid and snap.tables()[1]["snapshot_id"].to_pylist() == [sid] * 9
    assert len(snap.episodes()) == 3


@pytest.mark.parametrize("name", FILES)
def test_a_tampered_snapshot_id_fails_verify(tmp_path, name):
    sid, _ = write_snapshot(tmp_path, make_episodes(), PROVENANCE)
    folder = tmp_path / sid
    t = pq.read_table(folder / name)
    ids = ["snap-0000000000000000"] + [sid] * (t.num_rows - 1)
    forged = t.set_column(t.num_columns - 1, "snapshot_id", pa.array(ids, pa.string()))
    pq.write_table(forged, folder / name)
    (p,) = verify_snapshot(folder)  # the stored bytes changed (their size too, with this encoding)
    assert p.startswith(f"{name}: ") and ("sha256 mismatch" in p or "truncated or replaced" in p)
    _rewrite(folder, name, forged)  # the stored table rewritten to match: the value itself is the problem
    (p,) = verify_snapshot(folder)
    assert p == f"{name}: its snapshot_id column says snap-0000000000000000, not {sid} (edited or copied)"
    with pytest.raises(SnapshotError, match="snapshot_id column says"):
        load_snapshot(tmp_path, sid)


def test_edited_data_under_a_rewritten_stored_table_fails_verify(tmp_path):
    """The id's content is re-derived from the stored file without its column, so an edit is
    caught even when the stored hashes were recomputed."""
    sid, _ = write_snapshot(tmp_path, make_episodes(), PROVENANCE)
    folder = tmp_path / sid
    t = pq.read_table(folder / "episodes.parquet")
    i = t.schema.get_field_index("r_final")
    _rewrite(folder, "episodes.parquet", t.set_column(i, "r_final", pc.subtract(pa.scalar(1.0), t["r_final"])))
    (p,) = verify_snapshot(folder)
    assert p.startswith("episodes.parquet: its data without the snapshot_id column does not hash to the id's content")
    # the digest verify re-derives from the stored file is the one of the table before any file held it
    ep_t, _ = episodes_to_tables(make_episodes())
    m = json.loads((folder / "manifest.json").read_text())
    assert m["files"]["episodes.parquet"] == content_entry(ep_t)


def test_a_stored_table_that_lacks_a_file_is_a_manifest_error(tmp_path):
    sid, _ = write_snapshot(tmp_path, make_episodes(), PROVENANCE)
    folder = tmp_path / sid
    m = json.loads((folder / "manifest.json").read_text())
    del m["stored_files"]["turns.parquet"]
    (folder / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SnapshotError, match=r"file table \('stored_files'\) lacks turns.parquet"):
        load_snapshot(tmp_path, sid)
