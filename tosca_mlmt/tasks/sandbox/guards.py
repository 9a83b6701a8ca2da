"""In-process guards for the pure-Python fallback, used only where bubblewrap is missing.

The child executes this text (stdlib only, no ``tosca_mlmt`` imports) and calls
``install(root)`` before the candidate's code. They replace the Python-level ways to
start or signal processes, to open sockets and to write outside ``root``. They are
monkeypatches: code can undo them (re-importing ``posix``, ``ctypes`` via a fresh
import machinery, frames found with ``gc``), and native code is not covered at all.
That is why the fallback is announced loudly and recorded in the run's manifest.
"""

import _io
import _posixsubprocess
import _socket
import builtins
import functools
import io
import os
import posix
import resource
import socket
import sys

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
ALWAYS_WRITABLE = ("/dev/null",)
PROCESS_CALLS = (
    "fork", "forkpty", "system", "popen", "execv", "execve", "execl", "execle", "execlp",
    "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl",
    "spawnle", "spawnlp", "spawnlpe", "posix_spawn", "posix_spawnp", "kill", "killpg",
    "setsid", "setpgid", "setpgrp", "pidfd_open",
)
NETWORK_CALLS = (
    "create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo",
    "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getnameinfo",
)
# (argument position, keyword, dir_fd keyword, follow the final symlink?)
ENTRY = ((0, "path", "dir_fd", False),)
TARGET = ((0, "path", "dir_fd", True),)
FD = ((0, "fd", None, True),)
MOVE = ((0, "src", "src_dir_fd", False), (1, "dst", "dst_dir_fd", False))
PATH_CALLS = {
    "remove": ENTRY, "unlink": ENTRY, "rmdir": ENTRY, "mkdir": ENTRY, "mkfifo": ENTRY,
    "mknod": ENTRY, "lchown": ENTRY, "lchmod": ENTRY, "chmod": TARGET, "chown": TARGET,
    "truncate": TARGET, "utime": TARGET, "setxattr": TARGET, "removexattr": TARGET,
    "fchmod": FD, "fchown": FD, "ftruncate": FD, "rename": MOVE, "replace": MOVE,
    # A hard link to an outside file would let later writes reach it through the link.
    "link": ((0, "src", "src_dir_fd", True), (1, "dst", "dst_dir_fd", False)),
    "symlink": ((1, "dst", "dir_fd", False),),
}


def denied(what):
    def deny(*args, **kwargs):
        raise PermissionError(what + " is disabled in the sandbox")
    return deny


def replace_all(modules, names, replacement):
    for module in modules:
        for name in names:
            if hasattr(module, name):
                setattr(module, name, replacement)


def guard_processes():
    deny = denied("starting or signalling processes")
    replace_all((os, posix), PROCESS_CALLS, deny)
    _posixsubprocess.fork_exec = deny
    resource.setrlimit = resource.prlimit = denied("changing resource limits")
    # Raw libc calls would bypass all of this; sqlite3 can write files in native code.
    for name in ("ctypes", "_ctypes", "sqlite3", "_sqlite3"):
        sys.modules[name] = None


def guard_network():
    message = "network access is disabled in the sandbox"

    class DeniedSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            raise PermissionError(message)

    class DeniedRawSocket(_socket.socket):
        def __init__(self, *args, **kwargs):
            raise PermissionError(message)

    replace_all((socket, _socket), NETWORK_CALLS, denied("network access"))
    socket.socket = DeniedSocket
    socket.SocketType = _socket.socket = _socket.SocketType = DeniedRawSocket


def resolve(path, dir_fd, follow):
    if isinstance(path, int):
        path = os.readlink("/proc/self/fd/%d" % path)
    else:
        path = os.fsdecode(os.fspath(path))
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink("/proc/self/fd/%d" % dir_fd), path)
    head, tail = os.path.split(path)
    if follow or tail in ("", ".", ".."):
        return os.path.realpath(path)
    return os.path.join(os.path.realpath(head or "."), tail)


def guard_writes(root):
    def require_inside(path, dir_fd=None, follow=True):
        resolved = resolve(path, dir_fd, follow)
        if not (resolved == root or resolved.startswith(root + os.sep) or resolved in ALWAYS_WRITABLE):
            raise PermissionError("writing outside the sandbox directory is disabled: %r" % (path,))

    def is_write_mode(mode):
        return any(c in mode for c in "wax+")

    def guard_paths(fn, checks):
        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            for position, keyword, dir_keyword, follow in checks:
                path = args[position] if position < len(args) else kwargs.get(keyword)
                if path is not None:
                    require_inside(path, kwargs.get(dir_keyword) if dir_keyword else None, follow)
            return fn(*args, **kwargs)
        return guarded

    real_open, real_os_open = builtins.open, os.open

    @functools.wraps(real_open)
    def guarded_open(file, mode="r", *args, **kwargs):
        # An int is an already-open descriptor; the kernel enforces how it was opened.
        if not isinstance(file, int) and is_write_mode(mode):
            require_inside(file)
        return real_open(file, mode, *args, **kwargs)

    @functools.wraps(real_os_open)
    def guarded_os_open(path, flags, *args, dir_fd=None, **kwargs):
        if flags & WRITE_FLAGS:
            require_inside(path, dir_fd)
        return real_os_open(path, flags, *args, dir_fd=dir_fd, **kwargs)

    class GuardedFileIO(_io.FileIO):
        def __init__(self, file, mode="r", *args, **kwargs):
            if not isinstance(file, int) and is_write_mode(mode):
                require_inside(file)
            super().__init__(file, mode, *args, **kwargs)

    builtins.open = io.open = _io.open = guarded_open
    io.FileIO = _io.FileIO = GuardedFileIO
    os.open = posix.open = guarded_os_open
    for name, checks in PATH_CALLS.items():
        if hasattr(os, name):
            guarded = guard_paths(getattr(os, name), checks)
            replace_all((os, posix), (name,), guarded)


def install(root):
    guard_processes()
    guard_network()
    guard_writes(root)
