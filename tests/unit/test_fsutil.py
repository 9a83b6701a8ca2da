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


def test_fsync_tree_flushes_every_file_and_folder_under_it_or_one_folder(tmp_path, monkeypatch):
    from tosca_mlmt import fsutil

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f.bin").write_bytes(b"1")
    (tmp_path / "a" / "g.txt").write_text("2")
    opened = {}
    real_open = os.open

    def fake_open(p, flags):
        fd = real_open(p, flags)
        opened[fd] = str(p)  # a closed descriptor's number is reused: the latest open names it
        return fd

    monkeypatch.setattr(fsutil.os, "open", fake_open)
    synced = []
    monkeypatch.setattr(fsutil.os, "fsync", lambda fd: synced.append(opened[fd]))
    fsutil.fsync_tree(tmp_path / "a")
    names = {os.path.relpath(p, tmp_path) for p in synced}
    assert names == {"a", os.path.join("a", "b"), os.path.join("a", "b", "f.bin"), os.path.join("a", "g.txt")}
    synced.clear()
    fsutil.fsync_tree(tmp_path / "a", recursive=False)
    assert [os.path.relpath(p, tmp_path) for p in synced] == ["a"]


# ---------------------------------------------------------------- a full disk (issue 68, point 8)


def _free(monkeypatch, free):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, (1 << 40) - free, free))


def test_a_write_the_disk_has_no_room_for_is_refused_naming_it_and_the_old_content_stays(tmp_path, monkeypatch):
    import errno

    p = tmp_path / "manifest.json"
    atomic_write_text(p, "old")
    _free(monkeypatch, 10)
    with pytest.raises(OSError, match=rf"not enough space on the disk of {tmp_path}: 10 bytes free, at least "
                                      r"2.0 KiB \(2048 bytes\) needed") as e:
        atomic_write_text(p, "x" * 2048)
    assert e.value.errno == errno.ENOSPC
    assert p.read_text() == "old" and os.listdir(tmp_path) == ["manifest.json"]


def test_atomic_dir_refuses_a_full_disk_before_making_its_folder(tmp_path, monkeypatch):
    from tosca_mlmt import fsutil

    _free(monkeypatch, fsutil.MIN_FREE_BYTES - 1)
    with pytest.raises(OSError, match="not enough space on the disk of"):
        with atomic_dir(tmp_path / "snap"):
            raise AssertionError("the block ran on a full disk")
    assert os.listdir(tmp_path) == []


def test_atomic_dir_turns_enospc_in_its_block_into_a_clear_error_leaving_nothing(tmp_path):
    import errno

    with pytest.raises(OSError, match=f"not enough space on the disk of {tmp_path}: .* free .*No space left") as e:
        with atomic_dir(tmp_path / "snap") as tmp:
            (tmp / "part").write_text("half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert e.value.errno == errno.ENOSPC and os.listdir(tmp_path) == []
