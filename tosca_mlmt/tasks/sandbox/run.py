"""Run one job in the sandbox and judge what it reports.

:func:`run_python` plans the tests (``checks.py``), picks the isolation once per process
(the first bubblewrap set-up that passes a probe job, else the fallback, announced with a
:class:`SandboxWarning`), starts the child (``isolation.py``), drains its output and
result pipes under the deadline, and reads the result channel: records out of the
runner's order, without the run's nonce, or malformed count as a forgery, and every test
then fails. Verdicts are the parent's, on values rebuilt by ``values.py``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import selectors
import signal
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tosca_mlmt.tasks.sandbox.checks import Planner, run_checks, TestPlan
from tosca_mlmt.tasks.sandbox.values import clean_text, decode, ERROR_CHARS, Forgery
from tosca_mlmt.tasks.sandbox.isolation import (bwrap_launchers, Child, fallback_launcher, Launcher, MODE_BWRAP,
                                                MODE_FALLBACK)

SANDBOX_VERSION = "sandbox-v2"

_OUTPUT_LIMIT = 8 * 1024  # bytes of the code's stdout/stderr kept for the caller
_RESULT_LIMIT = 4 * 1024 * 1024  # bytes read from the result pipe; bounds forged-record spam
_FILE_LIMIT = 16 * 1024 * 1024  # RLIMIT_FSIZE: the code may write scratch files, not fill the disk
_WORK_BYTES = 64 * 1024 * 1024  # size of the sandbox's tmpfs work directory
_DONE_GRACE_S = 0.5  # after the final record, how long to wait for the child to exit
_VALUE_BYTES = 256 * 1024  # one encoded value, as the child bounds it (child.VALUE_LIMIT)
_RECORD_SLACK = 8 * ERROR_CHARS + 4096  # a record's error text (6 bytes a char at worst) and framing
_GUARDS = (Path(__file__).with_name("guards.py")).read_text(encoding="utf-8")

logger = logging.getLogger(__name__)


class SandboxWarning(UserWarning):
    """Model-written code is running without real isolation."""


@dataclass(frozen=True)
class SandboxResult:
    passed: int
    total: int
    all_passed: bool  # False when there are no tests: vacuous success must not earn reward
    timed_out: bool
    error: str  # "" when all passed; else "timeout", a load error, or the first failing test
    per_test: list[bool]
    output: str = ""  # the code's stdout and stderr, truncated
    forgery: str = ""  # why the result channel was judged forged; then every test failed
    mode: str = ""  # the isolation that ran: "bwrap" or "python-fallback"

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
    if its statements ran without raising and every one of its asserts holds as judged
    by the parent; tests not reached count as failed. ``memory_mb`` and ``max_procs``
    bound each process and the number of processes; where a cgroup can be made, the run
    as a whole gets 2 x ``memory_mb`` plus its tmpfs.
    """
    return _run(_launcher(), code, list(tests), setup, timeout_s, memory_mb, max_procs)


def sandbox_mode() -> str:
    """``"bwrap"`` when code runs under bubblewrap here, else ``"python-fallback"``."""
    return _launcher().mode


def sandbox_fingerprint() -> str:
    """The sandbox's version and mode, for verifier versions and run manifests."""
    return f"{SANDBOX_VERSION}+{sandbox_mode()}"


_chosen: Launcher | None = None
_chosen_lock = threading.Lock()
_PROBE_TESTS = ["x = 2\nassert x == len('ab')"]  # a statement, a sandbox value and a judge value


def _launcher() -> Launcher:
    """The first bubblewrap set-up that runs a probe job correctly, else the fallback."""
    global _chosen
    with _chosen_lock:
        if _chosen is None:
            problems = []
            for launcher in bwrap_launchers():
                try:
                    probe = _run(launcher, "", _PROBE_TESTS, "", 30.0, 256, 8)
                except OSError as e:
                    problems.append(f"{launcher.python}: {e}")
                    continue
                if probe.all_passed:
                    _chosen = launcher
                    break
                problems.append(f"{launcher.python}: {(probe.error + ' ' + probe.output).strip()[:300]}")
            else:
                _chosen = fallback_launcher()
                _warn_fallback("; ".join(problems) or "bwrap is not installed")
        return _chosen


def _warn_fallback(why: str) -> None:
    message = (
        "the code sandbox has no real isolation: bubblewrap is unusable here "
        f"({why}). Model-written code runs as a plain process behind in-process guards that "
        "code can undo; install bubblewrap (`make install` does so as root) before training "
        f"on untrusted code. Run manifests record the sandbox as {SANDBOX_VERSION}+{MODE_FALLBACK}."
    )
    logger.warning(message)
    warnings.warn(message, SandboxWarning, stacklevel=3)


def _run(launcher: Launcher, code: str, tests: list[str], setup: str, timeout_s: float, memory_mb: int,
         max_procs: int) -> SandboxResult:
    planner = Planner(code, setup)
    plans = [planner.plan(t) for t in tests]
    nonce = secrets.token_hex(16)
    job = {
        "nonce": nonce,
        "code": code,
        "setup": setup,
        "tests": [p.steps for p in plans],
        "n_judge": len(planner.judge_items),
        "limits": {
            "memory_bytes": memory_mb * 1024 * 1024,
            # A single-threaded child cannot use more CPU than wall time, so this limit only
            # bites if the code spins threads; the wall-clock deadline is the real bound.
            "cpu_seconds": math.ceil(timeout_s) + 1,
            "file_bytes": _FILE_LIMIT,
            "max_procs": max_procs,
        },
        "guard_source": _GUARDS if launcher.mode == MODE_FALLBACK else "",
    }
    judge = json.dumps(planner.judge_items).encode() if planner.judge_items else None
    # The run as a whole (where a cgroup can be made): twice one process's budget, e.g. a
    # solution and a worker it forked, plus its tmpfs; never max_procs times memory_mb.
    child = Child(launcher, json.dumps(job).encode(), judge, _WORK_BYTES, 2 * memory_mb * 1024 * 1024, max_procs + 1)
    try:
        result_buf, out_buf, out_seen, hit_deadline = _collect(child.output_fd, child.result_fd, timeout_s)
    finally:
        returncode = child.stop()
    reported = read_records(result_buf, nonce, plans, len(planner.judge_items))
    timed_out = not reported.done and (hit_deadline or returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU))
    return _summarize(plans, reported, _decode_output(out_buf, out_seen), timed_out, returncode, launcher.mode)


def _collect(out_fd: int, result_fd: int, timeout_s: float) -> tuple[bytes, bytes, int, bool]:
    """Drain both pipes until EOF or the deadline; keep bounded prefixes of each.

    Returns (result bytes, output bytes, output bytes seen, hit deadline).
    """
    kept = {out_fd: bytearray(), result_fd: bytearray()}
    limits = {out_fd: _OUTPUT_LIMIT, result_fd: _RESULT_LIMIT}
    out_seen = 0
    ending = False
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        for fd in kept:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(kept[result_fd]), bytes(kept[out_fd]), out_seen, not ending
            for key, _ in sel.select(remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = kept[key.fd]
                buf += chunk[: max(0, limits[key.fd] - len(buf))]
                if key.fd == out_fd:
                    out_seen += len(chunk)
                elif not ending and b'"kind": "done"' in buf[-len(chunk) - 20:]:
                    # Whether this end record is genuine is judged later; stray processes
                    # could keep the pipes open, so do not wait on them for long.
                    ending = True
                    deadline = min(deadline, time.monotonic() + _DONE_GRACE_S)
    return bytes(kept[result_fd]), bytes(kept[out_fd]), out_seen, False


def _decode_output(kept: bytes, seen: int) -> str:
    text = kept.decode("utf-8", errors="replace")
    return text + f"\n[output truncated: {seen} bytes total]" if seen > len(kept) else text


# --- the result channel ------------------------------------------------------------------


@dataclass
class Reported:
    expected: list[Any] | None = None
    load_ok: bool | None = None
    load_error: str = ""
    tests: dict[int, tuple[bool, str, list[Any]]] = field(default_factory=dict)
    done: bool = False
    forgery: str = ""


def read_records(buf: bytes, nonce: str, plans: list[TestPlan], n_judge: int) -> Reported:
    """Parse the result channel against the only sequence the honest runner writes:
    [expected] load test0 .. testN done, each line tagged with this run's nonce."""
    out = Reported()
    lines = bytes(buf).split(b"\n")[:-1]  # a trailing partial line was cut by a kill or the limit
    for line in lines:
        try:
            # Bounded before it is parsed: the code can write records itself (values.py).
            n_values = n_judge if out.expected is None and n_judge else \
                plans[len(out.tests)].n_values if out.load_ok and len(out.tests) < len(plans) else 0
            if len(line) > n_values * _VALUE_BYTES + _RECORD_SLACK:
                raise Forgery("a record longer than the runner writes")
            _accept(out, json.loads(line), nonce, plans, n_judge)
        except (Forgery, ValueError, TypeError, KeyError, RecursionError) as e:  # JSON nested 100k deep, say
            out.forgery = f"{e}" if isinstance(e, Forgery) else "an unreadable record"
            break
    return out


def _accept(out: Reported, record: Any, nonce: str, plans: list[TestPlan], n_judge: int) -> None:
    if not isinstance(record, dict) or record.get("nonce") != nonce:
        raise Forgery("a record without this run's nonce")
    kind = record.get("kind")
    if out.done:
        raise Forgery("a record after the end of the run")
    if kind == "expected":
        if not n_judge or out.expected is not None or out.load_ok is not None:
            raise Forgery("an unexpected record of expected values")
        values = record["values"]
        if not isinstance(values, list) or len(values) != n_judge:
            raise Forgery("a wrong number of expected values")
        out.expected = [decode(v) for v in values]
    elif kind == "load":
        if out.load_ok is not None or (n_judge and out.expected is None):
            raise Forgery("a load record out of order")
        if not isinstance(record["ok"], bool) or not isinstance(record["err"], str) or len(record["err"]) > ERROR_CHARS:
            raise Forgery("a malformed load record")
        out.load_ok, out.load_error = record["ok"], record["err"]
    elif kind == "test":
        i = record["i"]
        if not out.load_ok or type(i) is not int or i != len(out.tests) or i >= len(plans):
            raise Forgery(f"a test record out of order (test {i!r:.40})")
        ok, err, values = record["ok"], record["err"], record["values"]
        if not isinstance(ok, bool) or not isinstance(err, str) or len(err) > ERROR_CHARS \
                or not isinstance(values, list):
            raise Forgery("a malformed test record")
        if len(values) > plans[i].n_values or (ok and len(values) != plans[i].n_values):
            raise Forgery(f"a wrong number of values for test {i}")
        out.tests[i] = (ok, err, [decode(v) for v in values])
    elif kind == "done":
        if out.load_ok is None or (out.load_ok and len(out.tests) != len(plans)):
            raise Forgery("an early end record")
        out.done = True
    else:
        raise Forgery(f"a record of unknown kind {kind!r:.40}")


def _summarize(plans: list[TestPlan], reported: Reported, output: str, timed_out: bool, returncode: int,
               mode: str) -> SandboxResult:
    n = len(plans)
    # Whatever the records held, the text that leaves here is short, valid UTF-8 (a lone
    # surrogate in an exception message once crashed the writer's tokenizer).
    reported.forgery = clean_text(reported.forgery, 300)
    if reported.forgery:
        logger.warning("sandbox: forged result records (%s); every test scored as failed", reported.forgery)
        # also a warning: the `mlmt` process keeps only errors of Python logging unless --verbose (cli.common)
        warnings.warn(f"sandbox: forged result records ({reported.forgery}); every test scored as failed",
                      SandboxWarning, stacklevel=2)
        return SandboxResult(passed=0, total=n, all_passed=False, timed_out=timed_out,
                             error=f"forged result records: {reported.forgery}", per_test=[False] * n,
                             output=output, forgery=reported.forgery, mode=mode)
    per_test = [False] * n
    test_errors = []
    for i, plan in enumerate(plans):
        why = _test_failure(plan, reported, i)
        per_test[i] = why == ""
        if why:  # None: never ran, explained below
            test_errors.append(f"test {i} failed: {plan.source.strip()[:300]}\n{why}")
    passed = sum(per_test)
    if timed_out:
        error = "timeout"
    elif reported.load_ok is False:
        error = reported.load_error
    elif reported.tests.keys() != set(range(n)) and not all(p.error for p in plans):
        error = _tail(f"sandbox process {_describe_exit(returncode)} before finishing the tests\n{output}")
    else:
        error = test_errors[0] if test_errors else ""
    return SandboxResult(passed=passed, total=n, all_passed=bool(plans) and passed == n, timed_out=timed_out,
                         error=clean_text(error), per_test=per_test, output=output, mode=mode)


def _test_failure(plan: TestPlan, reported: Reported, i: int) -> str | None:
    """"" when test ``i`` passed, else why not; None when it never ran."""
    if plan.error:
        return plan.error
    if i not in reported.tests:
        return None
    ok, err, values = reported.tests[i]
    # The runner reports expected values before the load record, so they are here.
    return run_checks(plan, values, reported.expected or []) if ok else err


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
