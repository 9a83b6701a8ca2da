"""Per-run memory and pids cgroups for the sandbox, where the caller may create them.

Rlimits bound each process; a cgroup bounds the run as a whole, so ``max_procs``
processes of ``memory_mb`` each cannot add up to more than the machine can spare, and
tmpfs pages the code writes are charged too. Both cgroup v1 (separate ``memory`` and
``pids`` hierarchies) and v2 are handled; a controller is used only if a child cgroup
can actually be created under the caller's own and limited. Otherwise runs go without
one: the rlimits still hold.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

# controller -> (v1 limit file, v2 limit file)
_LIMIT_FILES = {"memory": ("memory.limit_in_bytes", "memory.max"), "pids": ("pids.max", "pids.max")}
# tosca-sbx-<tag>-<trainer pid>.<trainer start time>-<random>: who may still need it
_NAME = re.compile(r"tosca-sbx-\w+-(?P<pid>\d+)\.(?P<start>\d+)-[0-9a-f]+")


@dataclass(frozen=True)
class Hierarchy:
    parent: str  # the caller's cgroup directory in this hierarchy
    controllers: tuple[str, ...]
    v2: bool

    def limit_file(self, controller: str) -> str:
        return _LIMIT_FILES[controller][1 if self.v2 else 0]


def find_hierarchies() -> list[Hierarchy]:
    """The hierarchies where a limited child of the caller's cgroup can be made."""
    usable = []
    for hierarchy in _candidate_hierarchies():
        try:
            probe = RunCgroups([hierarchy], {"memory": 64 << 20, "pids": 8}, "probe")
        except OSError:
            continue
        probe.remove()
        usable.append(hierarchy)
    return usable


def _candidate_hierarchies() -> list[Hierarchy]:
    try:
        membership = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in membership:
        _, names, path = line.split(":", 2)
        v2 = names == ""
        for fields, fstype, options in _cgroup_mounts(mounts):
            root, mountpoint = fields[3], fields[4]
            if (fstype == "cgroup2") != v2 or not (v2 or set(names.split(",")) <= set(options)):
                continue  # not the mount of this hierarchy
            if not (path == root or path.startswith(root.rstrip("/") + "/")):
                continue
            parent = os.path.normpath(mountpoint + path[len(root.rstrip("/")):])
            if v2:  # a child gets the controllers its parent enables for its subtree
                enabled = _read(Path(parent) / "cgroup.subtree_control").split()
                controllers = tuple(c for c in _LIMIT_FILES if c in enabled)
            else:
                controllers = tuple(c for c in _LIMIT_FILES if c in names.split(",") and c in options)
            if controllers:
                found.append(Hierarchy(parent, controllers, v2))
            break
    return found


def _cgroup_mounts(mounts: list[str]):
    for line in mounts:
        head, _, tail = line.partition(" - ")
        fstype, _, options = (tail.split() + ["", "", ""])[:3]
        if fstype in ("cgroup", "cgroup2"):
            yield head.split(), fstype, options.split(",")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class RunCgroups:
    """Fresh child cgroups of one run; ``procs`` are the files a process writes to join."""

    def __init__(self, hierarchies: list[Hierarchy], limits: dict[str, int], tag: str):
        self.dirs: list[Path] = []
        try:
            for h in hierarchies:
                path = Path(h.parent) / f"tosca-sbx-{tag}-{os.getpid()}.{_start_time(os.getpid())}-{secrets.token_hex(4)}"
                path.mkdir()
                self.dirs.append(path)
                if h.v2 and "memory" in h.controllers and (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
                for controller in h.controllers:
                    (path / h.limit_file(controller)).write_text(str(limits[controller]))
        except OSError:
            self.remove()
            raise
        self.procs = [str(d / "cgroup.procs") for d in self.dirs]

    def remove(self) -> None:
        remove_dirs(self.dirs)
        self.dirs = []


def sweep_stale(hierarchies: list[Hierarchy]) -> None:
    """Kill what still runs in run cgroups whose trainer is gone, and remove them.

    A trainer killed while bwrap is starting can strand bwrap's half-made child, blocked
    before it runs anything and unreachable by --die-with-parent; the next trainer on
    the machine clears it here.
    """
    for h in hierarchies:
        for path in Path(h.parent).glob("tosca-sbx-*"):
            owner = _NAME.fullmatch(path.name)
            if owner is None or _start_time(int(owner["pid"])) == owner["start"]:
                continue  # not ours, or its trainer still runs
            for _ in range(100):
                members = _read(path / "cgroup.procs").split()
                if not members:
                    break
                for pid in map(int, members):
                    _kill_if_member(pid, path.name)
                time.sleep(0.01)
            remove_dirs([path], timeout_s=1.0)


def _kill_if_member(pid: int, cgroup_name: str) -> None:
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        # Checked after the pidfd pins the process, so a recycled pid is never signalled.
        if cgroup_name in _read(Path(f"/proc/{pid}/cgroup")):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(pidfd)


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot: with the pid, it names one process."""
    stat = _read(Path(f"/proc/{pid}/stat"))
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else ""


def remove_dirs(paths: list[Path], timeout_s: float = 2.0) -> None:
    """rmdir each cgroup; one can be removed once its last process is reaped, which may
    lag the kill a little. One still busy at the deadline is left behind, empty soon."""
    deadline = time.monotonic() + timeout_s
    for path in paths:
        while True:
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
