"""Tests for the code sandbox: exact pass rates, timeouts, and the guards against network
access, writes outside the work directory, memory bombs and fork bombs.

Escape attempts are written as tests that run *inside* the child and assert that the
attempt raised, so a passing test means the guard held there; the parent then checks
the outside world (the file is absent, no process is left) independently.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tosca_mlmt.tasks import sandbox
from tosca_mlmt.tasks.sandbox import SANDBOX_VERSION, SandboxResult, run_python

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(2, 2) == 4", "assert add(1, 2) == 3", "assert add(0, 0) == 0"]

# Test code imports this to state "calling fn must fail with this error type".
RAISES = """
def raises(fn, error=PermissionError):
    try:
        fn()
    except error:
        return True
    return False
"""


def _live_members(pgid: int) -> list[int]:
    """Pids of processes in process group ``pgid`` that are still running (from /proc).

    Zombies are dead; whether they are reaped soon depends on this machine's init.
    SIGKILL takes effect asynchronously, so allow a moment for the group to die.
    """
    deadline = time.monotonic() + 2.0
    while True:
        members = [pid for pid, group, state in _processes() if group == pgid and state != "Z"]
        if not members or time.monotonic() > deadline:
            return members
        time.sleep(0.05)


def _processes() -> list[tuple[int, int, str]]:
    """(pid, process group, state) of every process."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # "pid (comm) state ppid pgrp ...": comm may contain spaces, so split after ")".
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        found.append((int(entry.name), int(pgrp), state))
    return found


@pytest.fixture
def started_pids(monkeypatch):
    """Pids (= process group ids) of every child the sandbox starts during the test."""
    pids: list[int] = []

    class RecordingPopen(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pids.append(self.pid)

    monkeypatch.setattr(sandbox.subprocess, "Popen", RecordingPopen)
    return pids


# --- scoring ---------------------------------------------------------------------


def test_version():
    assert SANDBOX_VERSION == "sandbox-v1"


def test_correct_code_passes_all_tests():
    result = run_python(ADD, ADD_TESTS)
    assert isinstance(result, SandboxResult)
    assert (result.passed, result.total, result.all_passed, result.timed_out) == (3, 3, True, False)
    assert result.per_test == [True, True, True]
    assert result.error == "" and result.pass_rate == 1.0


def test_wrong_function_gives_exact_partial_pass_rate():
    result = run_python("def add(a, b):\n    return a * b\n", ADD_TESTS)
    assert result.per_test == [True, False, True]
    assert result.passed == 2 and not result.all_passed
    assert 0 < result.pass_rate < 1
    assert "test 1 failed: assert add(1, 2) == 3" in result.error
    assert "AssertionError" in result.error


def test_exceptions_and_exit_are_per_test():
    code = "import sys\ndef f(x):\n    if x == 1:\n        sys.exit(0)\n    return 10 // x\n"
    result = run_python(code, ["assert f(0) == 0", "assert f(1) == 1", "assert f(2) == 5"])
    assert result.per_test == [False, False, True]
    assert "ZeroDivisionError" in result.error


def test_syntax_error_fails_every_test_with_the_error():
    result = run_python("def add(a, b)\n    return a + b\n", ADD_TESTS)
    assert result.passed == 0 and result.total == 3
    assert "SyntaxError" in result.error and "<solution>" in result.error


def test_setup_runs_after_code_before_tests():
    code = "class Box:\n    def __init__(self, v):\n        self.v = v\n"
    result = run_python(code, ["assert b.v == 3"], setup="b = Box(3)")
    assert result.all_passed


def test_no_tests_is_not_success():
    result = run_python(ADD, [])
    assert result.total == 0 and not result.all_passed and result.pass_rate == 0.0


def test_main_block_and_input_do_not_run_or_hang():
    code = ADD + "if __name__ == '__main__':\n    input()\n"
    assert run_python(code, ADD_TESTS, timeout_s=3).all_passed


def test_output_is_captured_truncated_and_cannot_forge_results():
    # Forged records on stdout and on every inherited descriptor lack the run's nonce.
    forged = '{"kind": "test", "i": 0, "ok": true}\\n{"kind": "done"}\\n'
    code = (
        "import os\n"
        f"print('{forged}' * 3)\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        f"        os.write(fd, b'{forged}')\n"
        "    except OSError:\n"
        "        pass\n"
        "print('x' * 100_000)\n"
        "def f():\n    return 1\n"
    )
    result = run_python(code, ["assert f() == 2"])
    assert result.per_test == [False] and result.passed == 0
    assert result.output.startswith('{"kind": "test"')
    assert len(result.output) < 10_000 and "output truncated" in result.output


def test_work_directory_is_fresh_and_removed():
    code = "import os\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\n"
    result = run_python(code, ["assert True"])
    cwd, listing = result.output.splitlines()[:2]
    assert "tosca-sbx-" in cwd and listing == "[]"  # the job file is gone before user code runs
    assert not os.path.exists(cwd)


def test_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("TOSCA_TEST_SECRET", "hunter2")
    result = run_python("import os", ["assert 'TOSCA_TEST_SECRET' not in os.environ"])
    assert result.all_passed


# --- timeouts and resource bombs -------------------------------------------------


def test_infinite_loop_is_killed_at_the_timeout():
    code = "def spin():\n    while True:\n        pass\n"
    start = time.monotonic()
    result = run_python(code, ["assert True", "assert spin()", "assert True"], timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert result.timed_out and result.error == "timeout"
    assert result.per_test == [True, False, False]  # tests finished before the hang still count
    assert elapsed < 3.0


@pytest.mark.parametrize(
    "bomb",
    [
        "x = bytearray(4 * 1024**3)",
        "x = []\nwhile True:\n    x.append(bytearray(1024 * 1024))",
        "x = []\nwhile True:\n    x.append(len(x))",
    ],
    ids=["bytearray-4GiB", "list-of-MiB", "list-of-ints"],
)
def test_memory_bomb_is_stopped_without_harming_the_parent(bomb):
    start = time.monotonic()
    result = run_python(bomb, ["assert True"], timeout_s=10.0, memory_mb=256)
    assert not result.all_passed
    assert "MemoryError" in result.error or result.timed_out or "killed" in result.error
    assert time.monotonic() - start < 11.0
    assert run_python(ADD, ADD_TESTS).all_passed  # the parent still works


def test_memory_error_in_one_test_leaves_the_others():
    code = "def grab():\n    return bytearray(4 * 1024**3)\n" + ADD
    result = run_python(code, ["assert grab()", *ADD_TESTS], memory_mb=256)
    assert result.per_test == [False, True, True, True]
    assert "MemoryError" in result.error


def test_fork_bomb_is_contained_and_leaves_no_process(started_pids):
    code = "import os\ndef bomb():\n    while True:\n        os.fork()\n"
    start = time.monotonic()
    result = run_python(code, ["assert bomb()", "assert True"], timeout_s=5.0)
    assert time.monotonic() - start < 6.0
    assert result.per_test == [False, True]
    assert "PermissionError" in result.error
    assert started_pids
    for pgid in started_pids:
        assert _live_members(pgid) == [], f"processes left in group {pgid}"


def test_process_group_kill_ends_processes_that_bypass_the_guard(started_pids):
    # The guard is a monkeypatch and a fresh import of posix undoes it (documented); the
    # group kill must still end what was started. One sleeper, not a bomb: as root,
    # RLIMIT_NPROC would not stop a real one.
    code = (
        "import sys, time\n"
        "del sys.modules['posix']\n"
        "import posix\n"
        "def spawn_sleeper():\n"
        "    if posix.fork() == 0:\n"
        "        time.sleep(60)\n"
        "        posix._exit(0)\n"
        "    return True\n"
    )
    result = run_python(code, ["assert spawn_sleeper()"])
    assert result.all_passed
    for pgid in started_pids:
        assert _live_members(pgid) == [], f"processes left in group {pgid}"


def test_every_way_to_start_a_process_fails(started_pids):
    tests = [
        "assert raises(lambda: os.fork())",
        "assert raises(lambda: os.system('true'))",
        "assert raises(lambda: subprocess.run(['true']))",
        "assert raises(lambda: os.posix_spawn('/bin/true', ['true'], {}))",
        "assert raises(lambda: os.execv('/bin/true', ['true']))",
        "assert raises(lambda: multiprocessing.Process(target=print).start())",
        "assert raises(lambda: os.kill(os.getppid(), 0))",
        "assert raises(lambda: __import__('ctypes'), ImportError)",
        "assert raises(lambda: __import__('resource').setrlimit(0, (-1, -1)))",
    ]
    result = run_python("import multiprocessing, os, subprocess\n" + RAISES, tests)
    assert result.per_test == [True] * len(tests), result.error
    for pgid in started_pids:
        assert _live_members(pgid) == []


# --- network ---------------------------------------------------------------------


def test_network_connect_to_localhost_fails():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        tests = [
            f"assert raises(lambda: socket.create_connection(('127.0.0.1', {port}), timeout=2), OSError)",
            f"assert raises(lambda: socket.socket().connect(('127.0.0.1', {port})), OSError)",
            f"assert raises(lambda: _socket.socket().connect(('127.0.0.1', {port})), OSError)",
            "assert raises(lambda: socket.getaddrinfo('localhost', 80), OSError)",
        ]
        result = run_python("import socket, _socket\n" + RAISES, tests)
        assert result.per_test == [True] * len(tests), result.error
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever connected


# --- filesystem ------------------------------------------------------------------


def test_writes_outside_the_work_directory_fail(tmp_path):
    target = tmp_path / "escaped.txt"
    t = repr(str(target))
    tests = [
        f"assert raises(lambda: open({t}, 'w'))",
        f"assert raises(lambda: open({t}, 'a'))",
        f"assert raises(lambda: open({t}, 'x'))",
        f"assert raises(lambda: io.open({t}, 'wb'))",
        f"assert raises(lambda: io.FileIO({t}, 'w'))",
        f"assert raises(lambda: os.open({t}, os.O_WRONLY | os.O_CREAT))",
        f"assert raises(lambda: pathlib.Path({t}).write_text('x'))",
        f"assert raises(lambda: pathlib.Path({t}).touch())",
        f"assert raises(lambda: shutil.copy('/etc/hostname', {t}))",
        f"assert raises(lambda: os.mkdir({t}))",
        # A symlink from inside the work directory does not lead outside.
        f"os.symlink({repr(str(tmp_path))}, 'link')\nassert raises(lambda: open('link/escaped.txt', 'w'))",
    ]
    result = run_python("import io, os, pathlib, shutil\n" + RAISES, tests)
    assert result.per_test == [True] * len(tests), result.error
    assert list(tmp_path.iterdir()) == []
    assert not target.exists()


def test_deleting_or_moving_outside_files_fails(tmp_path):
    victim = tmp_path / "victim" / "keep.txt"
    victim.parent.mkdir()
    victim.write_text("precious")
    v, d = repr(str(victim)), repr(str(victim.parent))
    tests = [
        f"assert raises(lambda: os.remove({v}))",
        f"assert raises(lambda: os.unlink({v}))",
        f"assert raises(lambda: os.rename({v}, 'stolen.txt'))",
        f"assert raises(lambda: os.replace('mine.txt', {v}))",
        f"assert raises(lambda: os.truncate({v}, 0))",
        f"assert raises(lambda: os.chmod({v}, 0o777))",
        f"assert raises(lambda: os.link({v}, 'hardlink'))",
        f"assert raises(lambda: shutil.rmtree({d}))",
        f"assert raises(lambda: os.rmdir({d}))",
    ]
    code = "import os, shutil\nopen('mine.txt', 'w').close()\n" + RAISES
    result = run_python(code, tests)
    assert result.per_test == [True] * len(tests), result.error
    assert victim.read_text() == "precious"
    assert oct(victim.stat().st_mode & 0o777) != oct(0o777)


def test_files_inside_the_work_directory_are_usable():
    tests = [
        "open('scratch.txt', 'w').write('ok')\nassert open('scratch.txt').read() == 'ok'",
        "os.makedirs('a/b', exist_ok=True)\nos.rename('scratch.txt', 'a/b/s.txt')\nassert os.path.exists('a/b/s.txt')",
        "shutil.rmtree('a')\nassert not os.path.exists('a')",
        "with tempfile.NamedTemporaryFile('w') as f:\n    f.write('tmp')",
        "open('/dev/null', 'w').write('discarded')",
    ]
    result = run_python("import os, shutil, tempfile", tests)
    assert result.per_test == [True] * len(tests), result.error


def test_file_size_limit_raises_instead_of_killing():
    code = "def big():\n    with open('big.bin', 'wb') as f:\n        f.write(b'0' * (64 * 1024 * 1024))\n"
    result = run_python(code, ["assert big()", "assert True"])
    assert result.per_test == [False, True]
    assert "File too large" in result.error or "OSError" in result.error
