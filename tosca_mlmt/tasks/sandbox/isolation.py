"""Start the sandboxed child and, afterwards, make sure nothing it started survives.

With bubblewrap (``bwrap``) the child runs in new user, PID, mount, network, IPC, UTS
and cgroup namespaces, as an unprivileged uid, on a read-only root that holds only
``/usr`` (plus the interpreter's prefix) and a size-limited tmpfs work directory, with
an empty environment. When the caller is root the sandbox's uid outside is a fresh
unprivileged one, because the kernel exempts uid 0 from RLIMIT_NPROC: mapped to root, a
fork bomb would be unbounded; where it can, the run also gets its own memory and pids
cgroups (``cgroups.py``). Without bubblewrap the child is a plain process guarded
in-process (``guards.py``), which :mod:`.run` announces loudly.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tosca_mlmt.tasks.sandbox.cgroups import find_hierarchies, Hierarchy, RunCgroups, sweep_stale

MODE_BWRAP = "bwrap"
MODE_FALLBACK = "python-fallback"
WORK_DIR = "/work"
INNER_UID = 1000  # the uid the code sees; outside it is the caller's or a fresh one
_UID_BASE, _UID_SPAN = 0x70000000, 1 << 24  # far above any uid a system hands out
_SHM_BYTES = 4 * 1024 * 1024
_HOST_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_CHILD_PROGRAM = (Path(__file__).with_name("child.py")).read_text(encoding="utf-8")
_STOP_TIMEOUT_S = 5.0
# glibc reserves 64 MiB of address space per thread arena, so a few threads would exhaust
# RLIMIT_AS without using memory.
_MALLOC_ENV = ("MALLOC_ARENA_MAX", "2")
# sh -c: write 0 ("this process") to each cgroup.procs given before "--", then exec the rest.
_JOIN_CGROUPS = 'while [ "$1" != -- ]; do echo 0 > "$1" || exit 125; shift; done; shift; exec "$@"'

_uids_in_use: set[int] = set()
_uids_lock = threading.Lock()


@dataclass(frozen=True)
class Launcher:
    mode: str
    python: str  # the interpreter the child runs, as seen inside the sandbox
    bwrap: str = ""
    prefix_bind: str = ""  # the interpreter's install directory, when not under /usr
    features: frozenset[str] = frozenset()  # the optional bwrap options this bwrap knows
    cgroups: tuple[Hierarchy, ...] = ()  # where each run gets its own memory/pids cgroup
    setpriv: str = ""  # drops root after the run's process joined its cgroups


def bwrap_launchers() -> list[Launcher]:
    """The interpreters bubblewrap could run, the trainer's own first.

    Under a fresh uid the trainer's interpreter may be unreadable (e.g. pyenv under a
    0700 ``/root``); the system ``python3`` then serves, since the child needs only the
    standard library.
    """
    exe = shutil.which("bwrap", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/bin"]))
    if exe is None:
        return []
    common = {"bwrap": exe, "features": _features(exe)}
    setpriv = shutil.which("setpriv", path="/usr/bin:/bin")
    if os.geteuid() == 0 and setpriv:
        # Joining a cgroup needs root; setpriv then drops to the run's uid before bwrap.
        common.update(cgroups=tuple(find_hierarchies()), setpriv=setpriv)
        sweep_stale(list(common["cgroups"]))
    found = []
    own = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if own.startswith(prefix + os.sep):
        found.append(Launcher(MODE_BWRAP, own, prefix_bind="" if prefix.startswith("/usr/") else prefix, **common))
    system = os.path.realpath("/usr/bin/python3")
    if os.path.exists(system) and system != own:
        found.append(Launcher(MODE_BWRAP, system, **common))
    return found


def fallback_launcher() -> Launcher:
    return Launcher(MODE_FALLBACK, sys.executable)


def _features(exe: str) -> frozenset[str]:
    """The newer options this bwrap knows; older ones run without them."""
    try:
        text = subprocess.run([exe, "--help"], check=False, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(f for f in ("--disable-userns", "--unshare-cgroup-try", "--size") if f in text.split())


class Child:
    """A started sandbox: its output and result pipes, and how to end all of it."""

    def __init__(self, launcher: Launcher, job: bytes, judge: bytes | None, work_bytes: int, run_memory_bytes: int,
                 run_procs: int):
        self.launcher = launcher
        self._run_limits = {"memory": run_memory_bytes + work_bytes + _SHM_BYTES, "pids": run_procs}
        self._cgroups: RunCgroups | None = None
        self._uid: int | None = None
        self._init_pidfd: int | None = None
        self._workdir = ""
        result_r, result_w = os.pipe()
        fds = [result_w, _memfd("job", job)]
        fds.append(_memfd("judge", judge) if judge is not None else -1)
        args = [str(fd) for fd in fds]
        try:
            if launcher.mode == MODE_BWRAP:
                self.proc = self._start_bwrap(args, [fd for fd in fds if fd >= 0], work_bytes)
            else:
                self.proc = self._start_fallback(args, [fd for fd in fds if fd >= 0])
        except BaseException:
            os.close(result_r)
            self._release()
            raise
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)  # only the child may hold them: EOF means the child side is gone
        self.result_fd = result_r
        self.output_fd = self.proc.stdout.fileno()

    def _start_bwrap(self, args: list[str], fds: list[int], work_bytes: int) -> subprocess.Popen:
        la = self.launcher
        passwd = _memfd("passwd", f"sandbox:x:{INNER_UID}:{INNER_UID}:sandbox:{WORK_DIR}:/usr/sbin/nologin\n".encode())
        group = _memfd("group", f"sandbox:x:{INNER_UID}:\n".encode())
        info_r, info_w = os.pipe()
        argv = [
            la.bwrap, "--unshare-user", "--uid", str(INNER_UID), "--gid", str(INNER_UID),
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            # No nested user namespaces, hence no mounts or network stacks of the code's own.
            *(f for f in ("--disable-userns", "--unshare-cgroup-try") if f in la.features),
            "--hostname", "sandbox",
            # The sandbox dies with the trainer, and gets no controlling terminal (TIOCSTI).
            "--die-with-parent", "--new-session",
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORK_DIR,
            "--setenv", "TMPDIR", WORK_DIR, "--setenv", "LC_ALL", "C.UTF-8", "--setenv", *_MALLOC_ENV,
            "--ro-bind", "/usr", "/usr",
        ]
        for name in _HOST_DIRS:
            host = f"/{name}"
            if os.path.islink(host):
                argv += ["--symlink", os.readlink(host), host]
            elif os.path.isdir(host):
                argv += ["--ro-bind", host, host]
        if la.prefix_bind:
            argv += ["--ro-bind", la.prefix_bind, la.prefix_bind]
        def size(n):  # without --size (bwrap < 0.7) a tmpfs is bounded by the run's cgroup only
            return ["--size", str(n)] if "--size" in la.features else []

        argv += [
            "--ro-bind-data", str(passwd), "/etc/passwd", "--ro-bind-data", str(group), "/etc/group",
            "--proc", "/proc",
            "--dev", "/dev", *size(_SHM_BYTES), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
            *size(work_bytes), "--tmpfs", WORK_DIR, "--chdir", WORK_DIR,
            "--remount-ro", "/",
            "--info-fd", str(info_w),
            "--", la.python, "-I", "-S", "-X", "utf8", "-c", _CHILD_PROGRAM, *args,
        ]
        ids = {}
        if os.geteuid() == 0:
            self._uid = _claim_uid()
            ids = {"user": self._uid, "group": self._uid, "extra_groups": []}
            if la.cgroups:
                try:
                    self._cgroups = RunCgroups(list(la.cgroups), self._run_limits, str(self._uid))
                except OSError:
                    pass  # this run goes without; its rlimits still bind
            if self._cgroups is not None:
                # The shell joins the cgroups before bwrap exists, so every process it starts is inside.
                argv = ["/bin/sh", "-c", _JOIN_CGROUPS, "sh", *self._cgroups.procs, "--", la.setpriv,
                        f"--reuid={self._uid}", f"--regid={self._uid}", "--clear-groups", "--", *argv]
                ids = {}
        try:
            proc = subprocess.Popen(argv, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, pass_fds=(*fds, passwd, group, info_w),
                                    start_new_session=True, **ids)
        finally:
            for fd in (passwd, group, info_w):
                os.close(fd)
        try:
            self._init_pidfd = _open_init_pidfd(info_r, proc.pid)
        finally:
            os.close(info_r)
        return proc

    def _start_fallback(self, args: list[str], fds: list[int]) -> subprocess.Popen:
        self._workdir = tempfile.mkdtemp(prefix="tosca-sbx-")
        return subprocess.Popen(
            [*_network_isolation_prefix(), sys.executable, "-I", "-S", "-X", "utf8", "-c", _CHILD_PROGRAM, *args],
            cwd=self._workdir,
            env={"PATH": "/usr/bin:/bin", "HOME": self._workdir, "TMPDIR": self._workdir, "LC_ALL": "C.UTF-8",
                 _MALLOC_ENV[0]: _MALLOC_ENV[1]},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            pass_fds=fds, start_new_session=True,
        )

    def stop(self) -> int:
        """Kill whatever still runs, wait until it is gone, and return the exit status."""
        try:
            if self._init_pidfd is not None:
                # Killing the namespace's init makes the kernel kill every process in it.
                _pidfd_kill(self._init_pidfd)
            else:
                # Kill before reaping: an unreaped leader keeps its pid, so the group id
                # cannot have been recycled for someone else's processes.
                _kill_group(self.proc.pid)
            try:
                returncode = self.proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                returncode = self.proc.wait()
            if self._init_pidfd is not None:
                # The init exits only after every other process of the namespace is gone.
                select.select([self._init_pidfd], [], [], _STOP_TIMEOUT_S)
            if self._uid is not None:
                sweep_uid(self._uid)
            return returncode
        finally:
            self.proc.stdout.close()
            os.close(self.result_fd)
            if self._init_pidfd is not None:
                os.close(self._init_pidfd)
            self._release()

    def _release(self) -> None:
        if self._cgroups is not None:
            self._cgroups.remove()
        with _uids_lock:
            _uids_in_use.discard(self._uid)
        if self._workdir:
            _remove_tree(self._workdir)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    try:
        _write_all(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _claim_uid() -> int:
    with _uids_lock:
        while True:
            uid = _UID_BASE + secrets.randbelow(_UID_SPAN)
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid


def _open_init_pidfd(info_fd: int, bwrap_pid: int) -> int | None:
    """A pidfd for the PID namespace's init, from bwrap's ``--info-fd`` report.

    The pid is checked to be a child of our (unreaped, so not recycled) bwrap after the
    pidfd is open, so the pidfd cannot name an unrelated process that reused the pid.
    """
    data = b""
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([info_fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(info_fd, 4096) if ready else b""
        if not chunk:
            break
        data += chunk
    try:
        pid = int(json.loads(data)["child-pid"])
        pidfd = os.pidfd_open(pid)
    except (ValueError, KeyError, TypeError, OSError):
        return None  # bwrap failed before starting the namespace; stop() kills bwrap
    if _parent_of(pid) != bwrap_pid:
        os.close(pidfd)
        return None
    return pidfd


def _parent_of(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _pidfd_kill(pidfd: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _live_uid(pid: int) -> int | None:
    """The real uid of ``pid``, or None when it is gone or a zombie (already dead)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "").strip().startswith("Z"):
        return None
    try:
        return int(fields["Uid"].split()[0])
    except (KeyError, ValueError, IndexError):
        return None


def processes_of_uid(uid: int) -> list[int]:
    """Pids of live processes whose real uid is ``uid``."""
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit() and _live_uid(int(e.name)) == uid]


def sweep_uid(uid: int, timeout_s: float = _STOP_TIMEOUT_S) -> None:
    """SIGKILL every process of the run's private uid until none is left.

    The namespace kill already ended them; this also covers a bwrap that failed halfway
    and left a half-started child behind.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = processes_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                # Re-check once the pidfd pins the process: the pid may have been reused.
                if _live_uid(pid) == uid:
                    _pidfd_kill(pidfd)
            finally:
                os.close(pidfd)
        time.sleep(0.01)


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


_network_prefix: tuple[str, ...] | None = None


def _network_isolation_prefix() -> tuple[str, ...]:
    """``unshare -n`` (root) or ``unshare -r -n`` where either works: even the fallback
    then has an empty network namespace, which also binds native code."""
    global _network_prefix
    if _network_prefix is None:
        _network_prefix = ()
        exe = shutil.which("unshare")
        for prefix in ((exe, "-n"), (exe, "-r", "-n")) if exe else ():
            try:
                probe = subprocess.run([*prefix, "true"], check=False, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, timeout=10)
            except (OSError, subprocess.SubprocessError):
                continue
            if probe.returncode == 0:
                _network_prefix = prefix
                break
    return _network_prefix
