"""Atomic files and folders (tosca_mlmt.fsutil): old content or new, never a torn file."""

import os

import pytest

from tosca_mlmt.fsutil import atomic_dir, atomic_write_text


def test_atomic_write_text_replaces_whole_and_leaves_no_temp_file(tmp_path):
    p = tmp_path / "sub" / "state.json"
    atomic_write_text(p, "old")
    atomic_write_text(p, "néw")
    assert p.read_text(encoding="utf-8") == "néw" and sorted(os.listdir(p.parent)) == ["state.json"]


def test_a_write_that_fails_before_the_rename_keeps_the_old_content(tmp_path, monkeypatch):
    p = tmp_path / "latest"
    atomic_write_text(p, "step-000001")

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(p, "step-000002")
    assert p.read_text() == "step-000001" and sorted(os.listdir(tmp_path)) == ["latest"]


def test_atomic_dir_appears_whole_or_not_at_all(tmp_path):
    target = tmp_path / "snap"
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "a").write_text("1")
            raise RuntimeError("killed mid-write")
    assert not target.exists() and os.listdir(tmp_path) == []
    with atomic_dir(target) as tmp:
        (tmp / "a").write_text("1")
    assert (target / "a").read_text() == "1"
    with atomic_dir(target, overwrite=False) as tmp:  # someone else finished first: theirs stays
        (tmp / "b").write_text("2")
    assert sorted(os.listdir(target)) == ["a"]
