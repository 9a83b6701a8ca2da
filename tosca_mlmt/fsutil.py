"""Files and folders that appear whole or not at all."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def fsync_tree(path: str | Path, recursive: bool = True) -> None:
    """Flush ``path`` (a file, or a folder with everything under it; with ``recursive=False`` the
    folder's own entries only, e.g. a rename into it) to disk. A rename is atomic against a killed
    process, not against a power cut: without this the renamed folder can come back with empty
    files, after a prune already removed the checkpoint before it."""
    path = Path(path)
    for p in [*(sorted(path.rglob("*")) if recursive and path.is_dir() else []), path]:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:  # a folder on a system that cannot open one (Windows)
            continue
        try:
            os.fsync(fd)
        except OSError:  # a filesystem that cannot sync a folder
            pass
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_dir(target: str | Path, overwrite: bool = True):
    """Yield an empty temp folder beside ``target``; when the block succeeds it is renamed to
    ``target``. A crash inside the block leaves ``target`` as it was and removes the temp folder.

    With ``overwrite=False`` an existing ``target`` wins (another process finished first). With
    ``overwrite=True`` the old folder is removed just before the rename: readers may briefly see
    no folder, never a partial one."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        fsync_tree(tmp)
        if target.exists():
            if not overwrite:
                return
            shutil.rmtree(target)
        os.replace(tmp, target)
        fsync_tree(target.parent, recursive=False)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``path`` through a temp file beside it and one rename: a reader (or a resume after a
    kill) sees the old content or the new, never a torn file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        fsync_tree(tmp)
        os.replace(tmp, path)
        fsync_tree(path.parent, recursive=False)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks (checkpoint and snapshot files can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
