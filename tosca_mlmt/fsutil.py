"""Files and folders that appear whole or not at all, and a clear error when the disk is full.

A full disk: each atomic write first checks the free space of the disk it writes to (the size
being written where it is known, else ``MIN_FREE_BYTES``), and an ENOSPC (or EDQUOT) raised
while it writes becomes a ``NoSpaceError`` naming the folder and its free bytes; in both cases
nothing partial is left visible (the temp file or folder is removed).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

# The free space a write of unknown size (a folder: a snapshot, a checkpoint, an adapter) needs
# before it starts; a checkpoint asks for more once it knows the size of the one before it.
MIN_FREE_BYTES = 32 << 20
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class NoSpaceError(OSError):
    """A write would not fit, or did not fit, on its disk. An OSError (errno ENOSPC), so code
    that handles a failed write still does; its text names the folder and the free and needed
    bytes, and the command line prints it as an ``error:`` line (cli.common.user_errors)."""

    def __init__(self, message: str, path: str | Path | None = None):
        super().__init__(errno.ENOSPC, message, None if path is None else str(path))

    def __str__(self) -> str:
        return self.strerror


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} bytes"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        x /= 1024
        if x < 1024 or unit == "TiB":
            break
    return f"{x:.1f} {unit} ({n} bytes)"


def _existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where a not-yet-made folder will live)."""
    path = Path(os.path.abspath(path))
    while path.parent != path:
        try:
            if path.exists():
                break
        except OSError:  # a name too long, a component that is a file: ask its parent
            pass
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int | None:
    """Bytes free to this user on the disk ``path`` (or the folder it would be made in) is on;
    None when the system cannot say."""
    try:
        return shutil.disk_usage(_existing(Path(path))).free
    except (OSError, ValueError):
        return None


def no_space_message(path: str | Path, needed: int | None = None, cause: BaseException | None = None) -> str:
    """What to tell the user when the disk of ``path`` is (or will be) full."""
    free = free_bytes(path)
    have = "free space unknown" if free is None else f"{_size(free)} free"
    want = f", at least {_size(needed)} needed" if needed else ""
    why = f" ({cause})" if cause is not None and str(cause) else ""
    return (f"not enough space on the disk of {path}: {have}{want}{why}; "
            "free some space there or write somewhere else")


def is_no_space(e: BaseException) -> bool:
    """Whether ``e`` says a write failed because its disk is full (or the user's quota)."""
    if isinstance(e, OSError) and e.errno in _NO_SPACE:
        return True
    # pyarrow's and some C++ writers' errors carry the errno in their text only
    return isinstance(e, OSError) and "no space left on device" in str(e).lower()


def ensure_space(path: str | Path, needed: int | None = None) -> None:
    """Raise NoSpaceError unless the disk of ``path`` has ``needed`` bytes free
    (``MIN_FREE_BYTES`` when None); a disk that cannot say how full it is passes."""
    needed = MIN_FREE_BYTES if needed is None else needed
    free = free_bytes(path)
    if free is not None and free < needed:
        raise NoSpaceError(no_space_message(path, needed), path)


@contextlib.contextmanager
def no_space_is_clear(path: str | Path, needed: int | None = None):
    """Turn an ENOSPC raised inside the block into a NoSpaceError naming ``path``'s disk."""
    try:
        yield
    except NoSpaceError:
        raise
    except OSError as e:
        if not is_no_space(e):
            raise
        raise NoSpaceError(no_space_message(path, needed, e.strerror or e), path) from e


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
def atomic_dir(target: str | Path, overwrite: bool = True, needed: int | None = None):
    """Yield an empty temp folder beside ``target``; when the block succeeds it is renamed to
    ``target``. A crash inside the block leaves ``target`` as it was and removes the temp folder.

    With ``overwrite=False`` an existing ``target`` wins (another process finished first). With
    ``overwrite=True`` the old folder is removed just before the rename: readers may briefly see
    no folder, never a partial one.

    A disk with less than ``needed`` bytes free (``MIN_FREE_BYTES`` when None) is refused before
    the folder is made, and an ENOSPC inside the block becomes a NoSpaceError: both name it."""
    target = Path(target)
    with no_space_is_clear(target.parent, needed):
        ensure_space(target.parent, needed)
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
    data = text.encode("utf-8")
    with no_space_is_clear(path.parent, len(data)):
        ensure_space(path.parent, len(data))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(data)
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
