"""Snapshots: round trip, content ids, integrity checks, atomicity. No model needed."""

import json
import os

import pyarrow.parquet as pq
import pytest

from tosca_mlmt.episode import Episode, Turn
from tosca_mlmt.errors import SnapshotError
from tosca_mlmt.snapshot import (clean_stale_tmp, list_snapshots, load_snapshot, verify_snapshot,
                                 write_snapshot)
from tosca_mlmt.tasks.base import Problem


def make_episodes(n=3, reward_shift=0.0):
    eps = []
    for i in range(n):
        p = Problem("arith", f"arith-L1-{i:06d}", f"What is {i} + 1?", str(i + 1), "train", {"level": 1})
        ep = Episode(f"{p.id}/s0", p, 0)
        ep.turns = [
            Turn(0, 0, "solver", "solve", [1, 2, 3], [7, 8, 2], [-0.1, -0.2, -0.3], "stop", "x", reward=0.0 + reward_shift,
                 correct=False, extracted="9"),
            Turn(1, 1, "writer", "feedback", [1, 5, 7, 8, 6], [9, 2], [-1.0, -0.5], "stop", "check", strategy=2,
                 strategy_name="verify", behaviour_prob=1 / 6, behaviour_probs=[1 / 6] * 6, state_len=4),
            Turn(2, 1, "solver", "refine", [1, 2, 3, 7, 8, 2, 4, 9, 4], [5, 2], [-0.4, -0.01], "stop", "y",
                 reward=1.0, correct=True, extracted=str(i + 1), info={"pass_rate": 1.0}),
        ]
        eps.append(ep)
    return eps


def test_round_trip_preserves_every_field(tmp_path):
    eps = make_episodes()
    sid, created = write_snapshot(tmp_path, eps, {"task": {"name": "arith", "split": "train"}})
    assert created and sid.startswith("snap-")
    snap = load_snapshot(tmp_path, sid)
    back = snap.episodes()
    assert [e.episode_id for e in back] == [e.episode_id for e in eps]
    for a, b in zip(back, eps):
        assert a.problem == b.problem
        for ta, tb in zip(a.turns, b.turns):
            for f in ("prompt_ids", "response_ids", "kind", "role", "reward", "strategy", "state_len", "info"):
                assert getattr(ta, f) == getattr(tb, f), f
            assert ta.logprobs == pytest.approx(tb.logprobs, abs=1e-6)
    assert snap.manifest["rows"] == {"episodes": 3, "turns": 9}


def test_id_is_a_content_hash_and_snapshots_are_never_overwritten(tmp_path):
    sid1, c1 = write_snapshot(tmp_path, make_episodes(), {"note": "first"})
    before = (tmp_path / sid1 / "manifest.json").read_text()
    sid2, c2 = write_snapshot(tmp_path, make_episodes(), {"note": "second"})
    assert sid1 == sid2 and c1 and not c2
    assert (tmp_path / sid1 / "manifest.json").read_text() == before
    sid3, _ = write_snapshot(tmp_path, make_episodes(reward_shift=0.5), {})
    assert sid3 != sid1
    assert [m["id"] for m in list_snapshots(tmp_path)] == sorted([sid1, sid3], key=[sid1, sid3].index)


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
