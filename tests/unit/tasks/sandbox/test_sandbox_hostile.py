"""The sandbox against hostile programs (tests/sandbox_programs/hostile.py).

Every program runs as a "solution" to tests it never solves honestly, with the limits a
run would use. Whatever it tries, afterwards: the caller and a bystander process are
alive, the reward is 0, a directory outside the sandbox and the host's /tmp are
unchanged, no secret of the caller (environment, files, /etc/passwd) shows in the text
the writer would see, nothing connected to the sockets the harness listens on, and no
process of the sandbox is left. Programs that schedule effects for later are checked
again after waiting for them.

The suite asserts real isolation, so it needs bubblewrap; test_sandbox.py fails when bwrap
is installed but unused, so a broken installation cannot skip it silently.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tosca_mlmt.tasks.sandbox import isolation, MODE_BWRAP, run_python, SandboxResult, sandbox_mode

_spec = importlib.util.spec_from_file_location("sandbox_hostile_programs",
                                               Path(__file__).resolve().parents[3] / "sandbox_programs" / "hostile.py")
hostile = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = hostile  # dataclasses look their module up there
_spec.loader.exec_module(hostile)

pytestmark = [
    pytest.mark.skipif(sandbox_mode() != MODE_BWRAP, reason="needs bubblewrap (make install adds it as root)"),
    pytest.mark.timeout(120),
]


class Arena:
    """The world outside the sandbox, set up to notice any change."""

    def __init__(self, tmp_path: Path, monkeypatch):
        token = secrets.token_hex(8)
        self.secrets = [f"env-{token}", f"file-{token}"]
        monkeypatch.setenv("TOSCA_HOSTILE_SECRET", self.secrets[0])
        self.sentinel = tmp_path / "sentinel"
        self.sentinel.mkdir()
        (self.sentinel / "keep.txt").write_text("precious")
        self.secret_file = self.sentinel / "secret.txt"
        self.secret_file.write_text(self.secrets[1])
        for path in (tmp_path, self.sentinel, self.secret_file):
            path.chmod(0o755 if path.is_dir() else 0o644)  # readable by anyone: only the mounts keep it out
        self.before = self._snapshot()
        self.host_tmp = Path(f"/tmp/tosca-hostile-{token}")
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.setblocking(False)
        self.abstract_name = f"tosca-hostile-{token}"
        self.abstract = socket.socket(socket.AF_UNIX)
        self.abstract.bind("\0" + self.abstract_name)
        self.abstract.listen()
        self.abstract.setblocking(False)
        self.canary = subprocess.Popen(["sleep", "300"])
        self.uids: list[int] = []
        claim = isolation._claim_uid

        def recording_claim():
            self.uids.append(claim())
            return self.uids[-1]

        monkeypatch.setattr(isolation, "_claim_uid", recording_claim)

    def fill(self, code: str) -> str:
        values = {"@SENTINEL@": self.sentinel, "@SECRET_FILE@": self.secret_file, "@HOST_TMP@": self.host_tmp,
                  "@PORT@": self.server.getsockname()[1], "@ABSTRACT@": self.abstract_name,
                  "@TRAINER@": os.getpid(), "@CANARY@": self.canary.pid}
        for key, value in values.items():
            code = code.replace(key, str(value))
        return code

    def _snapshot(self) -> dict[str, tuple[bytes, int]]:
        return {str(p.relative_to(self.sentinel)): (p.read_bytes() if p.is_file() else b"", p.stat().st_mode)
                for p in sorted(self.sentinel.rglob("*"))}

    def assert_untouched(self, result: SandboxResult) -> None:
        assert self.canary.poll() is None, "a bystander process was killed"
        assert self._snapshot() == self.before, "the directory outside the sandbox changed"
        assert not self.host_tmp.exists(), "the host's /tmp was written"
        seen = result.error + result.output
        for secret in [*self.secrets, "root:x:0:0"]:
            assert secret not in seen, f"{secret!r} leaked into the result text"
        for listener in (self.server, self.abstract):
            with pytest.raises(BlockingIOError):
                listener.accept()  # nothing ever connected
        if os.geteuid() == 0:  # otherwise the sandbox runs as our own uid: nothing to tell apart
            assert self.uids, "the sandbox did not run under a fresh uid"
            for uid in self.uids:
                assert isolation.processes_of_uid(uid) == [], "a sandbox process was left behind"

    def close(self) -> None:
        self.canary.kill()
        self.canary.wait()
        self.server.close()
        self.abstract.close()
        if self.host_tmp.exists():
            self.host_tmp.unlink()


@pytest.fixture
def arena(tmp_path, monkeypatch):
    world = Arena(tmp_path, monkeypatch)
    yield world
    world.close()


def test_the_suite_is_big_enough():
    assert len(hostile.CASES) >= 40
    assert len({c.name for c in hostile.CASES}) == len(hostile.CASES)


@pytest.mark.parametrize("case", hostile.CASES, ids=[c.name for c in hostile.CASES])
def test_hostile_program_is_contained(case, arena):
    result = run_python(arena.fill(case.code), list(hostile.TESTS), timeout_s=case.timeout_s, memory_mb=256,
                        max_procs=hostile.MAX_PROCS)
    assert isinstance(result, SandboxResult)  # we are alive to look at it
    assert result.passed == 0 and not result.all_passed, result
    assert bool(result.forgery) or not case.forged, "the forgery went unnoticed"
    if case.check is not None:
        case.check(result)
    time.sleep(case.settle_s)
    arena.assert_untouched(result)


def test_honest_solution_passes_in_the_same_arena(arena):
    # The arena itself must not make runs fail: the same harness passes a real answer.
    result = run_python("def solve(x):\n    return x * x + 7919\n", list(hostile.TESTS), memory_mb=256,
                        max_procs=hostile.MAX_PROCS)
    assert result.all_passed, result
    arena.assert_untouched(result)
