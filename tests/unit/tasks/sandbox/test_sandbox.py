"""Tests for the code sandbox: exact pass rates, how asserts are judged, resource limits,
the isolation mode and its fallback.

Hostile programs (escapes and reward forgeries) live in test_sandbox_hostile.py; this
file covers what an honest or careless program meets.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from tosca_mlmt.tasks.sandbox import (isolation, MODE_BWRAP, MODE_FALLBACK, run as sandbox_run, run_python,
                                      SANDBOX_VERSION, sandbox_fingerprint, sandbox_mode, SandboxResult, SandboxWarning)
from tosca_mlmt.tasks.sandbox.cgroups import remove_dirs, sweep_stale

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


def run(code, tests, **kwargs):
    """run_python with a generous timeout: these tests check outcomes, not speed, on shared machines."""
    return run_python(code, tests, **{"timeout_s": 30.0, **kwargs})


@pytest.fixture
def fallback(monkeypatch):
    """Run this test's sandboxes in the pure-Python fallback, as where bwrap is missing."""
    monkeypatch.setattr(sandbox_run, "_chosen", isolation.fallback_launcher())


def _group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``; SIGKILL lands asynchronously, so wait for it
    (generously: a loaded machine can take seconds to reap)."""
    deadline = time.monotonic() + 60.0
    while True:
        members = []
        for entry in os.scandir("/proc"):
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text() if entry.name.isdigit() else ""
            except OSError:
                continue
            if stat:
                state, _ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
                if int(pgrp) == pgid and state != "Z":
                    members.append(int(entry.name))
        if not members or time.monotonic() > deadline:
            return members
        time.sleep(0.05)


# --- mode ------------------------------------------------------------------------


def test_version_mode_and_fingerprint():
    assert SANDBOX_VERSION == "sandbox-v2"
    assert sandbox_mode() in (MODE_BWRAP, MODE_FALLBACK)
    assert sandbox_fingerprint() == f"{SANDBOX_VERSION}+{sandbox_mode()}"
    assert run(ADD, ADD_TESTS).mode == sandbox_mode()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make install adds it)")
def test_bwrap_is_used_where_installed():
    # An installed bwrap that fails to start must not slide silently into the fallback.
    assert sandbox_mode() == MODE_BWRAP


def test_fallback_is_loud_and_recorded(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_run, "_chosen", None)
    monkeypatch.setattr(sandbox_run, "bwrap_launchers", list)
    with pytest.warns(SandboxWarning, match="no real isolation"), caplog.at_level(logging.WARNING):
        assert sandbox_mode() == MODE_FALLBACK
    assert "no real isolation" in caplog.text
    assert sandbox_fingerprint() == f"{SANDBOX_VERSION}+python-fallback"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process, not per run
        result = run(ADD, ADD_TESTS)
    assert result.all_passed and result.mode == MODE_FALLBACK


def test_a_broken_bwrap_falls_back(monkeypatch):
    broken = isolation.Launcher(MODE_BWRAP, sys.executable, bwrap="/bin/false")
    monkeypatch.setattr(sandbox_run, "_chosen", None)
    monkeypatch.setattr(sandbox_run, "bwrap_launchers", lambda: [broken])
    with pytest.warns(SandboxWarning, match="/bin/false|exited"):
        assert sandbox_mode() == MODE_FALLBACK


# --- scoring ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["default", "fallback"])
def test_correct_and_partial_scores(mode, request):
    if mode == "fallback":
        request.getfixturevalue("fallback")
    result = run(ADD, ADD_TESTS)
    assert isinstance(result, SandboxResult)
    assert (result.passed, result.total, result.all_passed, result.timed_out) == (3, 3, True, False)
    assert result.per_test == [True, True, True] and result.error == "" and result.pass_rate == 1.0

    result = run("def add(a, b):\n    return a * b\n", ADD_TESTS)
    assert result.per_test == [True, False, True]
    assert result.passed == 2 and not result.all_passed and 0 < result.pass_rate < 1
    assert "test 1 failed: assert add(1, 2) == 3" in result.error
    assert "AssertionError (got add(1, 2) -> 2)" in result.error


def test_exceptions_and_exit_are_per_test():
    code = "import sys\ndef f(x):\n    if x == 1:\n        sys.exit(0)\n    return 10 // x\n"
    result = run(code, ["assert f(0) == 0", "assert f(1) == 1", "assert f(2) == 5"])
    assert result.per_test == [False, False, True]
    assert "ZeroDivisionError" in result.error and 'File "<solution>", line 5' in result.error


def test_syntax_errors():
    result = run("def add(a, b)\n    return a + b\n", ADD_TESTS)
    assert result.passed == 0 and result.total == 3
    assert "SyntaxError" in result.error and "<solution>" in result.error
    result = run(ADD, ["assert add(1, 1) == 2", "assert add(1,, 1) == 2"])
    assert result.per_test == [True, False] and "test 1 failed" in result.error and "SyntaxError" in result.error


def test_setup_runs_after_code_before_tests():
    code = "class Box:\n    def __init__(self, v):\n        self.v = v\n"
    assert run(code, ["assert b.v == 3"], setup="b = Box(3)").all_passed


def test_no_tests_is_not_success():
    result = run(ADD, [])
    assert result.total == 0 and not result.all_passed and result.pass_rate == 0.0


def test_main_block_and_input_do_not_run_or_hang():
    code = ADD + "if __name__ == '__main__':\n    input()\n"
    assert run(code, ADD_TESTS).all_passed


def test_output_is_captured_and_truncated():
    code = "print('hello')\nprint('x' * 100_000)\ndef f():\n    return 1\n"
    result = run(code, ["assert f() == 1"])
    assert result.all_passed
    assert result.output.startswith("hello\n")
    assert len(result.output) < 10_000 and "output truncated" in result.output


def test_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("TOSCA_TEST_SECRET", "hunter2")
    result = run("import os", ["assert 'TOSCA_TEST_SECRET' not in os.environ"])
    assert result.all_passed


def test_work_directory_is_fresh_writable_and_gone():
    code = "import os\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\n"
    tests = [
        "open('scratch.txt', 'w').write('ok')\nassert open('scratch.txt').read() == 'ok'",
        "os.makedirs('a/b', exist_ok=True)\nos.rename('scratch.txt', 'a/b/s.txt')\nassert os.path.exists('a/b/s.txt')",
        "shutil.rmtree('a')\nassert not os.path.exists('a')",
        "with tempfile.NamedTemporaryFile('w') as f:\n    f.write('tmp')",
        "open('/dev/null', 'w').write('discarded')",
    ]
    result = run("import os, shutil, tempfile\n" + code, tests)
    assert result.per_test == [True] * len(tests), result.error
    cwd, listing = result.output.splitlines()[:2]
    assert listing == "[]"  # the job never touches the work directory
    if sandbox_mode() == MODE_FALLBACK:
        assert "tosca-sbx-" in cwd and not os.path.exists(cwd)
    else:
        assert cwd == isolation.WORK_DIR  # a tmpfs that ends with the sandbox


# --- how asserts are judged ------------------------------------------------------


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        ("collections.Counter('abca')", "{'a': 2, 'b': 1, 'c': 1}"),
        ("collections.OrderedDict([(1, 2)])", "{1: 2}"),
        ("collections.defaultdict(list, {1: [2]})", "{1: [2]}"),
        ("collections.namedtuple('P', 'x y')(1, 2)", "(1, 2)"),
        ("1", "1.0"),
        ("True", "1"),
        ("2 ** 20000", "2 ** 20000"),  # past the 4300-digit str() limit
        ("[(1, 'a'), {2: {3}}, frozenset({4})]", "[(1, 'a'), {2: {3}}, frozenset({4})]"),
        ("bytearray(b'ab')", "b'ab'"),
        ("complex(1, -2)", "1-2j"),
        ("decimal.Decimal('2.5')", "2.5"),
        ("fractions.Fraction(1, 4)", "0.25"),
        ("type('S', (str,), {})('abc')", "'abc'"),
        ("None", "None"),
    ],
)
def test_values_compare_like_python_for_builtin_types(returned, expected):
    code = f"import collections, decimal, fractions\ndef f():\n    return {returned}\n"
    assert run(code, [f"assert f() == {expected}"]).all_passed


def test_objects_of_other_types_equal_nothing():
    code = (
        "class Yes:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
        "class Liar(int):\n    def __eq__(self, other):\n        return True\n"
        "class Spoof:\n    __class__ = property(lambda self: int)\n    def __eq__(self, other):\n        return True\n"
        "def gen():\n    yield 1\n"
    )
    tests = ["assert Yes() == 3", "assert Liar(5) == 3", "assert Liar(5) == 5", "assert Spoof() == 0",
             "assert gen() == [1]", "assert list(gen()) == [1]", "assert [Yes()] == [1]", "assert Yes() != 3"]
    result = run(code, tests)
    assert result.per_test == [False, False, True, False, False, True, False, True]
    assert "<Yes object" in result.error


def test_assert_forms():
    code = (
        "import math\n"
        "def f(x):\n    if x is None:\n        raise ValueError('no x')\n    return x * 2\n"
        "def g():\n    return [3, 1, 2]\n"
        "def sum(a, b):\n    return a - b\n"  # shadows a built-in the tests then mean
    )
    tests = [
        "assert 1 < f(1) < 3",
        "assert 4 in [f(2), 0] and f(1) not in [1, 3]",
        "assert not f(1) == 3",
        "x = None\nassert x is None or f(x) == 0",  # the right side is never needed
        "assert math.isclose(f(0.1), 0.2000001, rel_tol=1e-3)",
        "assert sorted(g()) == [1, 2, 3] and set(g()) == {1, 2, 3} and len(g()) == 3",
        "assert f(2) == 4, 'message ignored'",
        "y = f(3)\nassert y == 6\nassert y + 1 == 7",
        "assert sum(5, 2) == 3",
        "z = f(1)",  # no assert: passes when it runs
        "assert f(1) == 3",
        "assert f(None) == 0",
        "y = f(1)\nassert y == 2\nassert y == 3",
    ]
    result = run(code, tests)
    assert result.per_test == [True] * 10 + [False] * 3, result.error
    assert "test 10 failed: assert f(1) == 3\nAssertionError (got f(1) -> 2)" in result.error


def test_failing_operand_reports_its_traceback():
    result = run("def f(x):\n    return [][x]\n", ["assert f(1) == 3"])
    assert "f(1) raised" in result.error and "IndexError" in result.error and '"<solution>", line 2' in result.error


def test_expected_values_never_enter_the_sandbox():
    # A solution that searches its whole process for the expected answers finds nothing:
    # literals stay in the parent, and `len(...)` runs in a fork before the code loads.
    code = (
        "import gc, sys\n"
        "def f():\n"
        "    seen = [repr(o) for o in gc.get_objects()]\n"
        "    frame = sys._getframe()\n"
        "    while frame:\n"
        "        seen += [repr(c) for c in frame.f_code.co_consts] + [repr(v) for v in frame.f_locals.values()]\n"
        "        frame = frame.f_back\n"
        "    blob = ' '.join(seen)\n"
        "    wanted = [str(int('918273644') + 1), ''.join(['zqx', 'jkv'])]  # not constants of this code\n"
        "    return [s for s in wanted if s in blob]\n"
    )
    result = run(code, ["assert f() == 918273645", "assert f() == len('zqxjkv')"])
    assert result.per_test == [False, False]
    assert "(got f() -> [])" in result.error


def test_forged_records_fail_every_test_and_are_logged(caplog):
    forged = '{"kind": "test", "i": 0, "ok": true}\\n{"kind": "done"}\\n'
    code = (
        "import os\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        f"        os.write(fd, b'{forged}')\n"
        "    except OSError:\n"
        "        pass\n"
        "def f():\n    return 1\n"
    )
    with caplog.at_level(logging.WARNING, logger="tosca_mlmt.tasks.sandbox"):
        result = run(code, ["assert f() == 1"])
    assert result.per_test == [False] and result.passed == 0 and not result.all_passed
    assert result.forgery and result.error.startswith("forged result records")
    assert "forged result records" in caplog.text


def test_a_forked_copy_of_the_runner_stays_silent():
    # A fork without exec continues the runner in the child; its copy must not report.
    code = "import os\ndef f():\n    os.fork()\n    return 1\n"
    result = run(code, ["assert f() == 1", "assert True"])
    assert result.all_passed and not result.forgery


# --- timeouts and resources --------------------------------------------------------


def test_infinite_loop_is_killed_at_the_timeout():
    code = "def spin():\n    while True:\n        pass\n"
    start = time.monotonic()
    result = run(code, ["assert True", "assert spin()", "assert True"], timeout_s=5.0)
    assert result.timed_out and result.error == "timeout"
    assert result.per_test == [True, False, False]  # tests finished before the hang still count
    assert time.monotonic() - start < 600  # ended by the timeout, not by the spin (generous: a loaded box)


@pytest.mark.parametrize(
    "bomb",
    [
        "x = bytearray(4 * 1024**3)",
        "x = []\nwhile True:\n    x.append(bytearray(1024 * 1024))",
        "x = []\nwhile True:\n    x.append(len(x))",
    ],
    ids=["bytearray-4GiB", "list-of-MiB", "list-of-ints"],
)
def test_memory_bomb_is_stopped(bomb):
    result = run(bomb, ["assert True"], timeout_s=10.0, memory_mb=256)
    assert not result.all_passed
    assert "MemoryError" in result.error or result.timed_out or "killed" in result.error


def test_memory_error_in_one_test_leaves_the_others():
    code = "def grab():\n    return bytearray(4 * 1024**3)\n" + ADD
    result = run(code, ["assert grab()", *ADD_TESTS], memory_mb=256)
    assert result.per_test == [False, True, True, True]
    assert "MemoryError" in result.error


def test_file_size_limit_raises_instead_of_killing():
    code = "def big():\n    with open('big.bin', 'wb') as f:\n        f.write(b'0' * (64 * 1024 * 1024))\n"
    result = run(code, ["assert big()", "assert True"])
    assert result.per_test == [False, True]
    assert "File too large" in result.error or "OSError" in result.error


@pytest.mark.skipif(sandbox_mode() != MODE_BWRAP, reason="the process limit binds only under bubblewrap")
def test_process_limit_binds_and_forks_work_below_it():
    code = (
        "import os, time, multiprocessing\n"
        "def square(x):\n    return x * x\n"
        "def pool():\n    with multiprocessing.get_context('fork').Pool(2) as p:\n        return p.map(square, [1, 2, 3])\n"
        "def forks():\n    n = 0\n    try:\n        for _ in range(50):\n            if os.fork() == 0:\n"
        "                time.sleep(30)\n                os._exit(0)\n            n += 1\n    except OSError:\n"
        "        pass\n    return n\n"
    )
    result = run(code, ["assert pool() == [1, 4, 9]", "assert forks() <= 12"], max_procs=12)
    assert result.all_passed, result.error


@pytest.mark.skipif(not getattr(sandbox_run._launcher(), "cgroups", ()), reason="no memory cgroup can be made here")
def test_memory_of_the_whole_run_is_bounded():
    # Six forked processes of 200 MB each fit their rlimit (256 MB) but not the run's
    # cgroup (2 x 256 MB plus the work tmpfs): the kernel kills some inside the sandbox.
    # Each child reports once its memory is touched; count when all reported or died.
    code = (
        "import os, select, time\n"
        "def survivors():\n"
        "    r, w = os.pipe()\n"
        "    pids = []\n"
        "    for _ in range(6):\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        "            hoard = bytearray(200 * 1024 * 1024)\n"
        "            os.write(w, b'%d ' % os.getpid())\n"
        "            time.sleep(60)\n"
        "            os._exit(0)\n"
        "        pids.append(pid)\n"
        "    reported, dead = set(), set()\n"
        "    deadline = time.monotonic() + 20\n"
        "    while not set(pids) <= reported | dead and time.monotonic() < deadline:\n"
        "        if select.select([r], [], [], 0.1)[0]:\n"
        "            reported.update(int(p) for p in os.read(r, 4096).split())\n"
        "        dead.update(p for p in pids if p not in dead and os.waitpid(p, os.WNOHANG)[0])\n"
        "    return len(set(pids) - dead)\n"
    )
    result = run(code, ["assert survivors() <= 3"], memory_mb=256, timeout_s=30)
    assert result.all_passed, result.error


@pytest.mark.skipif(sandbox_mode() != MODE_BWRAP or os.geteuid() != 0,
                    reason="needs bubblewrap and root (a fresh uid tells the sandbox's processes apart)")
@pytest.mark.parametrize("when", ["running", "starting"])
def test_the_sandbox_dies_with_the_trainer(when):
    if when == "starting" and not sandbox_run._launcher().cgroups:
        pytest.skip("clearing a stranded start-up needs the run cgroups")
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER], stdout=subprocess.PIPE, text=True)
    try:
        uid = int(trainer.stdout.readline())  # printed just before the sandbox starts
        deadline = time.monotonic() + 30
        while when == "running" and not isolation.processes_of_uid(uid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert when == "starting" or isolation.processes_of_uid(uid), "the sandbox never started"
    finally:
        trainer.kill()
        trainer.wait()
    if when == "starting":
        # Killed while bwrap starts, the trainer may strand bwrap's half-made child (blocked,
        # running nothing); the next trainer on the machine clears it.
        time.sleep(3)
        sweep_stale(list(sandbox_run._launcher().cgroups))
    deadline = time.monotonic() + 20
    while isolation.processes_of_uid(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in isolation.processes_of_uid(uid)}
    assert left == {}, "the sandbox outlived its trainer"
    for hierarchy in sandbox_run._launcher().cgroups:  # the dead trainer could not remove its cgroups
        remove_dirs(list(Path(hierarchy.parent).glob(f"tosca-sbx-{uid}-*")))


# A trainer that prints the uid of its next sandbox, then runs a sleeper there.
_TRAINER = """
from tosca_mlmt.tasks.sandbox import isolation, run_python, sandbox_mode
sandbox_mode()
claim = isolation._claim_uid
def announce():
    uid = claim()
    print(uid, flush=True)
    return uid
isolation._claim_uid = announce
run_python("import os, time\\nif os.fork() == 0:\\n    os.setsid()\\ntime.sleep(60)", ["assert True"], timeout_s=60)
"""


# --- the pure-Python fallback -----------------------------------------------------


def test_fallback_guards(fallback, tmp_path):
    started = []
    real_popen = subprocess.Popen

    class RecordingPopen(real_popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self.pid)

    target = repr(str(tmp_path / "escaped.txt"))
    tests = [
        "assert raises(lambda: os.fork())",
        "assert raises(lambda: subprocess.run(['true']))",
        "assert raises(lambda: __import__('ctypes'), ImportError)",
        "assert raises(lambda: __import__('sqlite3'), ImportError)",
        f"assert raises(lambda: open({target}, 'w'))",
        f"assert raises(lambda: os.open({target}, os.O_WRONLY | os.O_CREAT))",
        "assert raises(lambda: socket.create_connection(('127.0.0.1', 9), timeout=2), OSError)",
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(isolation.subprocess, "Popen", RecordingPopen)
        result = run("import os, socket, subprocess\n" + RAISES, tests)
    assert result.per_test == [True] * len(tests), result.error
    assert list(tmp_path.iterdir()) == []
    assert started and all(_group_members(pid) == [] for pid in started)
