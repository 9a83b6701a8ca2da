"""Snapshots: round trip, content ids, integrity checks, atomicity. No model needed."""

import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factories import make_episodes, rewrite_manifest
from tosca_mlmt.errors import SnapshotError
from tosca_mlmt.records import FeedbackSpan
from tosca_mlmt.store import load_snapshot, verify_snapshot, write_snapshot
from tosca_mlmt.store.index import list_snapshots
from tosca_mlmt.store.snapshot import clean_stale_tmp


def test_round_trip_preserves_every_field(tmp_path):
    eps = make_episodes()
    eps[0].turns[2].feedback_span = FeedbackSpan(7, 8)
    eps[1].turns[1].truncated = True
    sid, created = write_snapshot(tmp_path, eps, {"task": {"name": "arith", "split": "train"}})
    assert created and sid.startswith("snap-")
    snap = load_snapshot(tmp_path, sid)
    back = snap.episodes()
    assert [e.episode_id for e in back] == [e.episode_id for e in eps]
    for a, b in zip(back, eps):
        assert a.problem == b.problem
        for ta, tb in zip(a.turns, b.turns):
            for f in ("prompt_ids", "response_ids", "kind", "role", "reward", "strategy", "state_len", "info",
                      "feedback_span", "truncated"):
                assert getattr(ta, f) == getattr(tb, f), f
            assert ta.logprobs == pytest.approx(tb.logprobs, abs=1e-6)
    assert snap.manifest["rows"] == {"episodes": 3, "turns": 9}


def test_id_is_a_content_hash_and_snapshots_are_never_overwritten(tmp_path):
    # informational fields (timings, summary, versions) and where things live do not change the id
    prov = {"note": "first", "config": {"seed": 1, "collect": {"out": "a"}, "logging": {"wandb": True}}}
    sid1, c1 = write_snapshot(tmp_path, make_episodes(), {**prov, "timings": {"episodes": 1.0}})
    before = (tmp_path / sid1 / "manifest.json").read_text()
    again = {**prov, "timings": {"episodes": 2.0}, "summary": {"tokens_per_s": 9},
             "config": {"seed": 1, "collect": {"out": "b"}, "logging": {"wandb": False}}}
    sid2, c2 = write_snapshot(tmp_path, make_episodes(), again)
    assert sid1 == sid2 and c1 and not c2
    assert (tmp_path / sid1 / "manifest.json").read_text() == before
    sid3, _ = write_snapshot(tmp_path, make_episodes(reward_shift=0.5), prov)
    sid4, _ = write_snapshot(tmp_path, make_episodes(), {**prov, "note": "second"})  # provenance is content
    sid5, _ = write_snapshot(tmp_path, make_episodes(), {**prov, "config": {"seed": 2, "collect": {"out": "a"}}})
    assert len({sid1, sid3, sid4, sid5}) == 4
    assert {m["id"] for m in list_snapshots(tmp_path)} == {sid1, sid3, sid4, sid5}


def test_readable_by_pandas_and_datasets(tmp_path):
    import pandas as pd
    from datasets import load_dataset

    sid, _ = write_snapshot(tmp_path, make_episodes(), {})
    df = pd.read_parquet(tmp_path / sid / "turns.parquet")
    assert len(df) == 9 and list(df["response_ids"][0]) == [7, 8, 2]
    ds = load_dataset("parquet", data_files=str(tmp_path / sid / "episodes.parquet"), split="train",
                      cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == 3 and ds[0]["rewards"] == [0.0, 1.0]


@pytest.mark.parametrize("target", ["turns.parquet", "episodes.parquet", "manifest.json"])
def test_verify_catches_a_flipped_byte(tmp_path, target):
    sid, _ = write_snapshot(tmp_path, make_episodes(), {"task": {"name": "arith"}})
    assert verify_snapshot(tmp_path / sid) == []
    f = tmp_path / sid / target
    data = bytearray(f.read_bytes())
    i = len(data) // 2
    if target == "manifest.json":  # flip a digit inside a value so the JSON stays parseable
        i = data.index(b'"turns": 9') + len(b'"turns": ')
        data[i] = ord("8")
    else:
        data[i] ^= 0x01
    f.write_bytes(bytes(data))
    problems = verify_snapshot(tmp_path / sid)
    assert problems and any(target in p for p in problems)


def test_crash_during_write_leaves_nothing_visible(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = pq.write_table

    def dying_write(table, where, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # like Ctrl-C half-way through the data files
        return real(table, where, **kw)

    monkeypatch.setattr(pq, "write_table", dying_write)
    with pytest.raises(KeyboardInterrupt):
        write_snapshot(tmp_path, make_episodes(), {})
    assert list(tmp_path.iterdir()) == []
    assert list_snapshots(tmp_path) == []


def test_stale_build_folder_of_a_killed_writer_is_removed(tmp_path):
    dead = tmp_path / ".tmp-999999999-abcd"
    dead.mkdir()
    (dead / "episodes.parquet").write_bytes(b"partial")
    live = tmp_path / f".tmp-{os.getpid()}-abcd"
    live.mkdir()
    assert clean_stale_tmp(tmp_path) == 1
    assert not dead.exists() and live.exists()
    assert list_snapshots(tmp_path) == []


def test_unknown_format_version_is_refused_clearly(tmp_path):
    sid, _ = write_snapshot(tmp_path, make_episodes(), {})
    m = json.loads((tmp_path / sid / "manifest.json").read_text())
    m["format_version"] = 99
    (tmp_path / sid / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SnapshotError, match="format version 99 is not supported"):
        load_snapshot(tmp_path, sid)


# ---------------------------------------------------------------- trust: the id covers what matters


@pytest.mark.parametrize("edit", [
    lambda m: m["rows"].update(episodes=2),
    lambda m: m.update(parents=["snap-elsewhere"]),
    lambda m: m["task"].update(split="test"),
    lambda m: m["config"].update(seed=5),
])
def test_an_edited_manifest_with_a_recomputed_hash_fails_verify(tmp_path, edit):
    sid, _ = write_snapshot(tmp_path, make_episodes(), {"task": {"name": "arith", "split": "train"},
                                                        "config": {"seed": 0}, "parents": []})
    rewrite_manifest(tmp_path / sid, edit)
    problems = verify_snapshot(tmp_path / sid)
    assert problems == [f"manifest.json: id {sid} does not match its content (manifest edited)"]
    with pytest.raises(SnapshotError, match=f"snapshot {sid}: manifest.json: id .* does not match"):
        load_snapshot(tmp_path, sid)


def test_replaced_data_files_with_a_matching_file_table_still_fail(tmp_path):
    """Rewriting the rewards and the stored files' table (sizes, hashes, manifest hash): the files
    say another id, and the id still stands for the old content; under the old id's folder name
    a recomputed id is caught too."""
    from tosca_mlmt.fsutil import sha256_file

    sid, _ = write_snapshot(tmp_path, make_episodes(), {})
    other, _ = write_snapshot(tmp_path / "o", make_episodes(reward_shift=0.5), {})
    for f in ("episodes.parquet", "turns.parquet"):
        (tmp_path / sid / f).write_bytes((tmp_path / "o" / other / f).read_bytes())

    def table(m):
        for f in m["stored_files"]:
            m["stored_files"][f] = {"sha256": sha256_file(tmp_path / sid / f),
                                    "bytes": (tmp_path / sid / f).stat().st_size}

    rewrite_manifest(tmp_path / sid, table)
    problems = verify_snapshot(tmp_path / sid)
    assert len(problems) == 2 and all(f"snapshot_id column says {other}, not {sid}" in p for p in problems)
    rewrite_manifest(tmp_path / sid, lambda m: m.update(id=other))  # even with the new id recomputed
    problems = verify_snapshot(tmp_path / sid)
    assert [p.split(":")[0] for p in problems[:2]] == ["episodes.parquet", "turns.parquet"]
    assert all("does not hash to the id's content" in p for p in problems[:2])  # the old id's content, not these
    assert problems[2:] == [f"manifest.json: id {other} does not match its content (manifest edited)",
                            f"folder name {sid} differs from manifest id {other}"]


def test_a_truncated_data_file_is_named_by_its_size_before_any_hashing(tmp_path):
    sid, _ = write_snapshot(tmp_path, make_episodes(), {})
    f = tmp_path / sid / "turns.parquet"
    f.write_bytes(f.read_bytes()[:-10])
    (p,) = verify_snapshot(tmp_path / sid)
    assert p.startswith("turns.parquet: size") and "truncated" in p


@pytest.mark.parametrize("content, needle", [
    (b"[1, 2]", "not a JSON object (a list)"),
    (b"\xff\xfe{}", "unreadable (UnicodeDecodeError"),
    (b"{", "unreadable (JSONDecodeError"),
    (json.dumps({"format_version": 2, "id": "x"}).encode(), "has no file table ('files')"),
    (json.dumps({"format_version": 2, "id": "x", "files": {"episodes.parquet": {}}}).encode(), "lacks turns.parquet"),
    (json.dumps({"format_version": 2, "id": "x", "files": {"episodes.parquet": {"sha256": "a", "bytes": -1},
                                                           "turns.parquet": {"sha256": "a", "bytes": 1}}}).encode(),
     "entry for episodes.parquet is malformed"),
    (json.dumps({"format_version": "2"}).encode(), "format version '2' is not supported"),
])
def test_a_damaged_manifest_is_a_snapshot_error_naming_the_snapshot(tmp_path, content, needle):
    sid, _ = write_snapshot(tmp_path, make_episodes(), {})
    (tmp_path / sid / "manifest.json").write_bytes(content)
    with pytest.raises(SnapshotError, match=f"^snapshot {sid}: .*{re.escape(needle)}"):
        load_snapshot(tmp_path, sid)
    assert verify_snapshot(tmp_path / sid)[0].startswith(f"snapshot {sid}: ")
    (listed,) = list_snapshots(tmp_path)
    assert listed["id"] == sid and needle in listed["error"]


def test_format_1_snapshots_are_still_read_and_verified(tmp_path):
    """Written as tosca-mlmt wrote them before format 2: id = hash of the data files only."""
    import hashlib

    from tosca_mlmt.fsutil import sha256_file
    from tosca_mlmt.store.manifest import _canonical, snapshot_id_v1
    from tosca_mlmt.store.tables import episodes_to_tables

    build = tmp_path / "build"
    build.mkdir()
    ep_t, turn_t = episodes_to_tables(make_episodes())
    pq.write_table(ep_t, build / "episodes.parquet")
    pq.write_table(turn_t, build / "turns.parquet")
    hashes = {f: sha256_file(build / f) for f in ("episodes.parquet", "turns.parquet")}
    m = {"format_version": 1, "id": snapshot_id_v1(hashes), "files": hashes, "rows": {"episodes": 3, "turns": 9}}
    m["manifest_sha256"] = hashlib.sha256(_canonical(m)).hexdigest()
    (build / "manifest.json").write_text(json.dumps(m))
    build.rename(tmp_path / m["id"])
    assert verify_snapshot(tmp_path / m["id"]) == []
    assert len(load_snapshot(tmp_path, m["id"]).episodes()) == 3
    f = tmp_path / m["id"] / "turns.parquet"
    f.write_bytes(f.read_bytes()[:-1] + b"\x00")
    assert verify_snapshot(tmp_path / m["id"]) == ["turns.parquet: sha256 mismatch (file changed since it was written)"]


def _reencode(folder, **parquet_options):
    """The stored files written again by another parquet writer (options stand in for another
    pyarrow: compression, dictionary and page layout change every byte), the stored-file table
    updated to match, as a copy or an upgrade would leave them."""
    from tosca_mlmt.fsutil import sha256_file

    for f in ("episodes.parquet", "turns.parquet"):
        t = pq.read_table(folder / f)
        pq.write_table(t, folder / f, **parquet_options)

    def table(m):
        for f in m["stored_files"]:
            m["stored_files"][f] = {"sha256": sha256_file(folder / f), "bytes": (folder / f).stat().st_size}

    rewrite_manifest(folder, table)


def test_the_id_stands_for_the_values_not_the_parquet_encoding(tmp_path, monkeypatch):
    """Format 3: under another parquet writer (another pyarrow: here zstd pages without dictionaries,
    every byte different) the same episodes get the same id and a stored snapshot still verifies;
    an edit of one value still fails."""
    import functools

    import tosca_mlmt.store.tables as snap_tables

    sid, _ = write_snapshot(tmp_path / "a", make_episodes(), {"task": {"name": "arith"}})
    before = (tmp_path / "a" / sid / "turns.parquet").read_bytes()
    other = functools.partial(pq.write_table, compression="zstd", use_dictionary=False, row_group_size=2)
    monkeypatch.setattr(pq, "write_table", other)
    monkeypatch.setattr(snap_tables, "parquet_bytes", lambda t: pytest.fail("format 3 re-encodes nothing"))
    again, created = write_snapshot(tmp_path / "b", make_episodes(), {"task": {"name": "arith"}})
    assert (again, created) == (sid, True)
    assert (tmp_path / "b" / sid / "turns.parquet").read_bytes() != before
    assert verify_snapshot(tmp_path / "a" / sid) == [] and verify_snapshot(tmp_path / "b" / sid) == []
    assert len(load_snapshot(tmp_path / "b", sid).episodes()) == 3

    folder = tmp_path / "a" / sid
    t = pq.read_table(folder / "turns.parquet")
    lp = t["logprobs"].to_pylist()
    lp[0] = [lp[0][0] + 0.5] + lp[0][1:]
    pq.write_table(t.set_column(t.schema.get_field_index("logprobs"), "logprobs",
                                pa.array(lp, t.schema.field("logprobs").type)), folder / "turns.parquet")
    _reencode(folder)
    assert verify_snapshot(folder) == ["turns.parquet: its data without the snapshot_id column does not hash "
                                       "to the id's content (edited)"]


def test_the_value_digest_reads_past_physical_types_and_chunking():
    """What a reader may pick for the same values (large strings and lists, string views, several
    row groups) leaves the digest as it is; a changed value or column name does not."""
    from tosca_mlmt.store.tables import content_entry, episodes_to_tables

    _, turns = episodes_to_tables(make_episodes())
    want = content_entry(turns)
    wide = pa.schema([pa.field(f.name, pa.large_list(f.type.value_type) if pa.types.is_list(f.type)
                               else pa.large_string() if pa.types.is_string(f.type) else f.type) for f in turns.schema])
    assert content_entry(turns.cast(wide)) == want
    if hasattr(pa, "string_view"):
        views = pa.schema([pa.field(f.name, pa.string_view() if pa.types.is_string(f.type) else f.type)
                           for f in turns.schema])
        assert content_entry(turns.cast(views)) == want
    assert content_entry(pa.concat_tables([turns.slice(0, 4), turns.slice(4)])) == want
    assert content_entry(turns.rename_columns(["x"] + turns.column_names[1:])) != want
    lp = turns["logprobs"].to_pylist()
    lp[8] = [lp[8][0], lp[8][1] + 1e-3]
    edited = turns.set_column(turns.schema.get_field_index("logprobs"), "logprobs",
                              pa.array(lp, turns.schema.field("logprobs").type))
    assert content_entry(edited) != want


def test_format_2_snapshots_are_still_read_and_verified(tmp_path, monkeypatch):
    """Written as tosca-mlmt wrote them before format 3: the id hashes the parquet bytes of the
    tables, so they verify under the pyarrow that wrote them and an edit still fails."""
    import hashlib

    import tosca_mlmt.store.manifest as manifest
    import tosca_mlmt.store.snapshot as snap
    import tosca_mlmt.store.tables as snap_tables
    from tosca_mlmt.store.tables import parquet_bytes

    def other_writer(t):
        sink = pa.BufferOutputStream()
        pq.write_table(t, sink, compression="zstd")
        return sink.getvalue().to_pybytes()

    monkeypatch.setattr(manifest, "FORMAT_VERSION", 2)
    monkeypatch.setattr(snap, "content_entry", lambda t: {"sha256": hashlib.sha256(parquet_bytes(t)).hexdigest(),
                                                          "bytes": len(parquet_bytes(t))})
    sid, _ = write_snapshot(tmp_path, make_episodes(), {})
    monkeypatch.undo()
    assert json.loads((tmp_path / sid / "manifest.json").read_text())["format_version"] == 2
    assert verify_snapshot(tmp_path / sid) == []
    assert len(load_snapshot(tmp_path, sid).episodes()) == 3
    # another pyarrow, whose parquet writer encodes the same tables in other bytes: format 2 cannot tell
    # that from an edit, format 3 is not concerned
    monkeypatch.setattr(snap_tables, "parquet_bytes", lambda t: other_writer(t))
    (p, q) = verify_snapshot(tmp_path / sid)
    assert "does not hash to the id's content (edited; or this pyarrow" in p and q.startswith("turns.parquet")
    v3, _ = write_snapshot(tmp_path / "v3", make_episodes(), {})
    assert verify_snapshot(tmp_path / "v3" / v3) == []


def test_a_snapshot_id_that_is_a_path_is_refused(tmp_path):
    for sid in ("../x", "/etc", ".tmp-1-a", ""):
        with pytest.raises(SnapshotError, match="is not a snapshot id"):
            load_snapshot(tmp_path, sid)


def test_turns_written_before_the_typed_feedback_span_are_read(tmp_path):
    """Older turns files lack the feedback_span and truncated columns and carry the span in info."""
    import pyarrow as pa

    from tosca_mlmt.fsutil import sha256_file
    from tosca_mlmt.store.manifest import build_manifest
    from tosca_mlmt.store.tables import episodes_to_tables

    build = tmp_path / "build"
    build.mkdir()
    ep_t, turn_t = episodes_to_tables(make_episodes())
    turn_t = turn_t.drop_columns(["feedback_span", "truncated"])
    info = [json.dumps({**json.loads(i), "feedback_span": [7, 8]}, sort_keys=True) if k == "refine" else i
            for i, k in zip(turn_t["info"].to_pylist(), turn_t["kind"].to_pylist())]
    turn_t = turn_t.set_column(turn_t.schema.get_field_index("info"), "info", pa.array(info, pa.string()))
    pq.write_table(ep_t, build / "episodes.parquet")
    pq.write_table(turn_t, build / "turns.parquet")
    files = {f: {"sha256": sha256_file(build / f), "bytes": (build / f).stat().st_size}
             for f in ("episodes.parquet", "turns.parquet")}
    m = build_manifest({}, files, {"episodes": 3, "turns": 9})
    (build / "manifest.json").write_text(json.dumps(m))
    build.rename(tmp_path / m["id"])
    assert verify_snapshot(tmp_path / m["id"]) == []
    back = load_snapshot(tmp_path, m["id"]).episodes()
    solve, fb, ref = back[0].turns
    assert ref.feedback_span == FeedbackSpan(7, 8) and ref.info == {"pass_rate": 1.0}
    assert solve.feedback_span is None and not any(t.truncated for t in back[0].turns)


def test_loaded_tables_carry_the_snapshot_id(tmp_path):
    import pyarrow as pa

    from tosca_mlmt.analysis.sources import read_turns

    sid, _ = write_snapshot(tmp_path, make_episodes(), {})
    other, _ = write_snapshot(tmp_path, make_episodes(reward_shift=0.5), {})
    eps, turns = load_snapshot(tmp_path, sid).tables()
    assert set(eps["snapshot_id"].to_pylist()) == {sid} and turns["snapshot_id"].to_pylist() == [sid] * 9
    both = pa.concat_tables([load_snapshot(tmp_path, s).tables()[1] for s in (sid, other)])
    assert both["snapshot_id"].to_pylist() == [sid] * 9 + [other] * 9  # rows still say where they came from
    # the files hold it too, for readers other than ours (tests/unit/store/test_snapshot_id_column.py)
    assert pq.read_table(tmp_path / sid / "turns.parquet")["snapshot_id"].to_pylist() == [sid] * 9
    assert verify_snapshot(tmp_path / sid) == [] and len(load_snapshot(tmp_path, sid).episodes()) == 3
    snaps = {s: (tmp_path / s, json.loads((tmp_path / s / "manifest.json").read_text())) for s in (sid, other)}
    assert set(read_turns(snaps)["snapshot_id"]) == {sid, other}
