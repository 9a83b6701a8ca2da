"""Run untrusted, model-written Python against assert-style tests in a child process.

What it does
------------
Each call gets a fresh temporary working directory (deleted afterwards) and a child
``python -I -S`` (isolated mode, no site-packages, no inherited environment
variables, so trainer secrets such as API tokens never reach the code). Before the
user code runs, the child:

* lowers its resource limits: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE,
  RLIMIT_NPROC and RLIMIT_CORE=0;
* replaces the standard Python-level ways to start or signal processes (``os.fork``,
  ``os.system``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn``, ``subprocess`` via
  ``_posixsubprocess.fork_exec``, hence ``multiprocessing`` too, ``os.kill``,
  ``os.setsid``) with functions that raise ``PermissionError``, and makes ``ctypes``
  unimportable, because RLIMIT_NPROC is ignored for root and counts all processes of
  the uid otherwise, so it cannot be the only fork-bomb defence;
* replaces ``socket.socket``, ``socket.create_connection``, name resolution and their
  ``_socket`` counterparts with functions that raise ``PermissionError``;
* wraps ``open``/``io.open``/``io.FileIO``/``os.open`` (write, append, create modes)
  and the path-mutating ``os`` calls (remove, unlink, rmdir, rename, replace, mkdir,
  link, symlink, chmod, chown, truncate, utime, xattrs; ``shutil.rmtree``,
  ``pathlib`` and ``tempfile`` go through these) so that touching a path outside the
  temp directory (symlinks resolved) raises ``PermissionError``;
* runs each test statement separately under ``try/except BaseException`` and streams
  one JSON record per test over a dedicated pipe, tagged with a per-run random nonce,
  so the pass rate is exact, output printed by the code cannot be mistaken for
  results, and the tests finished before a hang or crash still count.

The parent enforces a wall-clock timeout and, after every run, SIGKILLs the child's
whole process group (the child starts its own session), which also ends processes
started by code that got past the fork guard. When ``unshare -n`` (or ``unshare -r -n``)
works on this machine, the child also runs in an empty network namespace, which
blocks the network at the kernel level, including from native code.

What it does not stop
---------------------
This is a best-effort guard against accidents and casual reward hacking by a model,
not a security boundary against a determined attacker. The in-process guards are
plain Python monkeypatches, so code can undo them (for example by deleting ``posix``
from ``sys.modules`` and importing it again, or by digging the nonce out of the
runner's frames with ``gc``), and a process that gets past them and calls
``setsid`` leaves the process group and survives the kill; native code is not
covered at all; there is no
filesystem or PID namespace, so reading files outside the temp directory is allowed,
and path checks race with concurrent symlink swaps; without ``unshare`` the network
block is only the monkeypatch; RLIMIT_AS bounds virtual memory, not resident memory.
It also does nothing about tests that can be satisfied by a wrong answer (e.g. an
object whose ``__eq__`` always returns True): that is the verifier's concern. For
real isolation run the whole verifier inside a container or VM.
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

SANDBOX_VERSION = "sandbox-v1"

_OUTPUT_LIMIT = 8 * 1024  # bytes of the code's stdout/stderr kept for the caller
_RESULT_LIMIT = 1024 * 1024  # bytes read from the result pipe; bounds forged-record spam
_FILE_LIMIT = 16 * 1024 * 1024  # RLIMIT_FSIZE: the code may write scratch files, not fill the disk
_DONE_GRACE_S = 0.5  # after the final record, how long to wait for the child to exit
_CHILD_PATH = "/usr/bin:/bin"


@dataclass(frozen=True)
class SandboxResult:
    passed: int
    total: int
    all_passed: bool  # False when there are no tests: vacuous success must not earn reward
    timed_out: bool
    error: str  # "" when all passed; else "timeout", a load error, or the first failing test
    per_test: list[bool]
    output: str = ""  # the code's stdout and stderr, truncated

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else 0.0


def run_python(
    code: str,
    tests: list[str],
    setup: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_procs: int = 32,
) -> SandboxResult:
    """Run ``code``, then ``setup``, then each test statement, in a sandboxed child.

    ``timeout_s`` bounds the whole run (start-up included). A test counts as passed only
    if it ran to completion without raising; tests not reached count as failed.
    """
    tests = list(tests)
    nonce = secrets.token_hex(16)
    job = {
        "nonce": nonce,
        "code": code,
        "setup": setup,
        "tests": tests,
        "memory_bytes": memory_mb * 1024 * 1024,
        # A single-threaded child cannot use more CPU than wall time, so this limit only
        # bites if the code spins threads; the wall-clock deadline is the real bound.
        "cpu_seconds": math.ceil(timeout_s) + 1,
        "file_bytes": _FILE_LIMIT,
        "max_procs": max_procs,
    }
    workdir = tempfile.mkdtemp(prefix="tosca-sbx-")
    try:
        records, output, finished, hit_deadline, returncode = _run_child(workdir, job, timeout_s)
    finally:
        _remove_tree(workdir)
    timed_out = not finished and (hit_deadline or returncode == -signal.SIGXCPU)
    return _summarize(tests, records, output, timed_out, returncode)


def _run_child(workdir: str, job: dict[str, Any], timeout_s: float) -> tuple[list[dict], str, bool, bool, int]:
    """Run the job in ``workdir``; (records, output, finished, hit deadline, exit status)."""
    job_path = os.path.join(workdir, "job.json")
    with open(job_path, "w", encoding="utf-8") as f:
        json.dump(job, f)
    read_fd, write_fd = os.pipe()
    try:
        try:
            proc = subprocess.Popen(
                [*_network_isolation_prefix(), sys.executable, "-I", "-S", "-X", "utf8",
                 "-c", _CHILD_PROGRAM, job_path, str(write_fd)],
                cwd=workdir,
                env={"PATH": _CHILD_PATH, "HOME": workdir, "TMPDIR": workdir, "LC_ALL": "C.UTF-8"},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                start_new_session=True,
            )
        finally:
            # Only the child may hold the write end, so EOF means the child side is gone.
            os.close(write_fd)
        with proc:
            result_buf, out_buf, out_seen, finished, hit_deadline = _collect(
                proc.stdout.fileno(), read_fd, job["nonce"], timeout_s
            )
            # Kill before reaping: an unreaped leader keeps its pid, so the group id cannot
            # have been recycled for someone else's processes. This also ends strays.
            _kill_group(proc.pid)
            returncode = proc.wait()
    finally:
        os.close(read_fd)
    return (
        _parse_records(result_buf, job["nonce"]),
        _decode_output(out_buf, out_seen),
        finished,
        hit_deadline,
        returncode,
    )


def _collect(out_fd: int, result_fd: int, nonce: str, timeout_s: float) -> tuple[bytes, bytes, int, bool, bool]:
    """Drain both pipes until EOF or the deadline; keep bounded prefixes of each.

    Returns (result bytes, output bytes, output bytes seen, finished, hit deadline).
    """
    kept = {out_fd: bytearray(), result_fd: bytearray()}
    limits = {out_fd: _OUTPUT_LIMIT, result_fd: _RESULT_LIMIT}
    out_seen = 0
    finished = False
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        for fd in kept:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(kept[result_fd]), bytes(kept[out_fd]), out_seen, finished, not finished
            for key, _ in sel.select(remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = kept[key.fd]
                buf += chunk[: max(0, limits[key.fd] - len(buf))]
                if key.fd == out_fd:
                    out_seen += len(chunk)
                elif not finished and _has_done(buf, nonce):
                    finished = True
                    # Stray processes could keep the output pipe open; do not wait on them.
                    deadline = min(deadline, time.monotonic() + _DONE_GRACE_S)
    return bytes(kept[result_fd]), bytes(kept[out_fd]), out_seen, finished, False


def _parse_records(buf: bytes, nonce: str) -> list[dict]:
    """Result records from the runner; lines without this run's nonce are forgeries."""
    records = []
    for line in bytes(buf).split(b"\n"):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("nonce") == nonce:
            records.append(record)
    return records


def _has_done(buf: bytes, nonce: str) -> bool:
    return any(r.get("kind") == "done" for r in _parse_records(buf, nonce))


def _decode_output(kept: bytes, seen: int) -> str:
    text = kept.decode("utf-8", errors="replace")
    return text + f"\n[output truncated: {seen} bytes total]" if seen > len(kept) else text


def _summarize(tests: list[str], records: list[dict], output: str, timed_out: bool, returncode: int) -> SandboxResult:
    per_test = [False] * len(tests)
    reported = [False] * len(tests)
    load_error = ""
    test_errors: list[str] = []
    for record in records:
        if record.get("kind") == "load" and not record.get("ok"):
            load_error = str(record.get("err", ""))
        elif record.get("kind") == "test" and record.get("i") in range(len(tests)):
            i = record["i"]
            reported[i] = True
            per_test[i] = record.get("ok") is True
            if not per_test[i]:
                test_errors.append(str(record.get("err", "")))
    passed = sum(per_test)
    if timed_out:
        error = "timeout"
    elif load_error:
        error = load_error
    elif test_errors:
        error = test_errors[0]
    elif not all(reported):
        error = _tail(f"sandbox process {_describe_exit(returncode)} before finishing the tests\n{output}")
    else:
        error = ""
    return SandboxResult(
        passed=passed,
        total=len(tests),
        all_passed=bool(tests) and passed == len(tests),
        timed_out=timed_out,
        error=error,
        per_test=per_test,
        output=output,
    )


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _tail(text: str, max_lines: int = 12, max_chars: int = 1500) -> str:
    """The end of a traceback carries the exception; keep that part."""
    text = "\n".join(text.rstrip().splitlines()[-max_lines:])
    return text if len(text) <= max_chars else "..." + text[-max_chars:]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _remove_tree(path: str) -> None:
    try:
        shutil.rmtree(path)
    except OSError:
        # The code may have made its own directories unreadable; as a non-root user we
        # must restore permissions before we can delete them. Never follow symlinks here:
        # chmod through a planted link would change a directory outside the sandbox.
        for root, dirs, _ in os.walk(path):
            for name in dirs:
                sub = os.path.join(root, name)
                if not os.path.islink(sub):
                    os.chmod(sub, 0o700)
        shutil.rmtree(path, ignore_errors=True)


@functools.lru_cache(maxsize=1)
def _network_isolation_prefix() -> tuple[str, ...]:
    """``unshare -n`` (root) or ``unshare -r -n`` (user namespaces) if either works here.

    An empty network namespace blocks the network in the kernel, so it also holds for
    native code; it needs privileges or user namespaces, hence probe once and otherwise
    rely on the in-process guard alone.
    """
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    for prefix in ((exe, "-n"), (exe, "-r", "-n")):
        try:
            probe = subprocess.run([*prefix, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return prefix
    return ()


# The program the child runs (via ``python -c``). It is a string rather than a function of
# this module so that the child imports only what it needs: start-up time is paid on every
# verification. Arguments: the job file (read, then deleted) and the result pipe's fd.
_CHILD_PROGRAM = r'''
import _io, _posixsubprocess, _socket, builtins, functools, io, json, linecache, os, posix
import resource, signal, socket, sys, traceback

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
ALWAYS_WRITABLE = ("/dev/null",)
RESERVE_BYTES = 4 * 1024 * 1024
PROCESS_CALLS = (
    "fork", "forkpty", "system", "popen", "execv", "execve", "execl", "execle", "execlp",
    "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl",
    "spawnle", "spawnlp", "spawnlpe", "posix_spawn", "posix_spawnp", "kill", "killpg",
    "setsid", "setpgid", "setpgrp",
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


def limit_resources(job):
    limits = (
        (resource.RLIMIT_AS, job["memory_bytes"], job["memory_bytes"]),
        (resource.RLIMIT_CPU, job["cpu_seconds"], job["cpu_seconds"] + 1),
        (resource.RLIMIT_FSIZE, job["file_bytes"], job["file_bytes"]),
        (resource.RLIMIT_NPROC, job["max_procs"], job["max_procs"]),
        (resource.RLIMIT_CORE, 0, 0),
    )
    for which, soft, hard in limits:
        current_hard = resource.getrlimit(which)[1]
        if current_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(which, (soft, hard))
    # A write past RLIMIT_FSIZE should fail with an OSError, not kill the runner.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def guard_processes():
    deny = denied("starting or signalling processes")
    replace_all((os, posix), PROCESS_CALLS, deny)
    _posixsubprocess.fork_exec = deny
    resource.setrlimit = resource.prlimit = denied("changing resource limits")
    sys.modules["ctypes"] = sys.modules["_ctypes"] = None  # raw libc calls would bypass all of this


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


def describe(exc):
    try:
        # Skip run_snippet's own frame: the user needs their code's frames only.
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        return "\n".join(text.rstrip().splitlines()[-12:])[-1500:]
    except BaseException:
        return "MemoryError" if isinstance(exc, MemoryError) else "unprintable " + type(exc).__name__


def run_snippet(source, filename, namespace, reserve):
    # Registering the source lets tracebacks quote the failing line.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        exec(compile(source, filename, "exec"), namespace)
    except MemoryError as exc:
        # The memory may still be held (e.g. by a global list); release the reserve so
        # there is room to describe and report the error.
        reserve.clear()
        return describe(exc)
    except BaseException as exc:
        return describe(exc)
    return None


def rearm(reserve):
    if not reserve:
        try:
            reserve.append(bytearray(RESERVE_BYTES))
        except MemoryError:
            pass


def make_reporter(fd, nonce):
    def report(record):
        record["nonce"] = nonce
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        except (OSError, MemoryError):
            pass  # an unreported test counts as failed
    return report


def flush_std():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


def main(job_path, result_fd):
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    os.unlink(job_path)
    report = make_reporter(result_fd, job["nonce"])
    limit_resources(job)
    guard_processes()
    guard_network()
    guard_writes(os.path.realpath(os.getcwd()))
    # Not "__main__": solutions often end with a main block that reads input or prints demos.
    namespace = {"__name__": "solution", "__builtins__": builtins}
    reserve = [bytearray(RESERVE_BYTES)]
    load_error = run_snippet(job["code"], "<solution>", namespace, reserve)
    if load_error is None and job["setup"]:
        load_error = run_snippet(job["setup"], "<setup>", namespace, reserve)
    report({"kind": "load", "ok": load_error is None, "err": load_error or ""})
    if load_error is None:
        for i, test in enumerate(job["tests"]):
            rearm(reserve)
            error = run_snippet(test, "<test %d>" % i, namespace, reserve)
            if error is not None:
                error = "test %d failed: %s\n%s" % (i, test.strip()[:300], error)
            report({"kind": "test", "i": i, "ok": error is None, "err": error or ""})
    flush_std()
    report({"kind": "done"})
    os._exit(0)  # skip interpreter teardown, which runs more user code (__del__, atexit)


main(sys.argv[1], int(sys.argv[2]))
'''
